"""``aiter-unified``: AITER's Triton ``unified_attention``, loaded without ROCm, and its bugs.

What CI can run comes from the PyPI wheel that ``scripts/setup.sh`` unpacks into
``<venv>/difftest-aiter``; the shuffled views need an AITER tree from v0.1.16 on
(``scripts/fetch_aiter.sh v0.1.16``), and those tests skip with that reason without one.
F21 and F22 are reproduced by calling AITER's function directly on a few hand-made tensors,
outside the adapter.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from difftest.backends.aiter_triton import (
    DeviceAnswers,
    SourceError,
    answering,
    chosen_source,
    resolve,
    wheel_source,
)
from difftest.backends.aiter_unified import AiterUnified, kernel_path
from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.generation.corpus import load_corpus
from difftest.machine import devices
from difftest.run.runner import Status, run_case
from tests.aiter_trees import aiter_tree

WHEEL, WHEEL_MISSING = chosen_source(None)
needs_aiter = pytest.mark.skipif(WHEEL is None, reason=WHEEL_MISSING or "no AITER")
on_cpu = pytest.mark.skipif(not devices.interpreted(),
                            reason="runs AITER's kernels under TRITON_INTERPRET=1 with the "
                            "device answers; on a GPU the suite's backends run them natively")
CORPUS = {c.name: c for c in load_corpus()}
SMALL = Case(num_blocks=8, seq_lens=(200,), block_tables=((3, 5),), selections=((0, 1),),
             num_q_heads=2, seed=5)


def tree_from(tag: str) -> Any:
    """An AITER tree of ``tag`` fetched by scripts/fetch_aiter.sh, or a skip naming it."""
    try:
        return resolve(tag)
    except SourceError as exc:
        pytest.skip(f"{exc} (CI has only PyPI's wheel, which predates shuffled_kv_cache)")


def imported_as_aiter(package: Path) -> bool:
    """Whether any module of ``package`` was imported under the name ``aiter``."""
    return any(name.split(".")[0] == "aiter" and str(package) in str(getattr(m, "__file__", ""))
               for name, m in list(sys.modules.items()))


def ran_3d(backend: AiterUnified, case: Case, monkeypatch) -> bool:
    """Run ``case`` and say whether AITER launched its 3-D kernel."""
    module = sys.modules[backend.kernel(case, torch.device("cpu")).__module__]
    launched: list[str] = []
    original = module.kernel_unified_attention_3d

    class Recording:
        def __getitem__(self, grid: Any) -> Any:
            launched.append("3D")
            return original[grid]

    monkeypatch.setattr(module, "kernel_unified_attention_3d", Recording())
    result = run_case(case, TorchReference(), [backend], torch.device("cpu"))
    assert result.results[0].status is Status.AGREE, result.results[0].detail
    return bool(launched)


@needs_aiter
@on_cpu
def test_loads_without_rocm_and_says_what_was_answered() -> None:
    backend = AiterUnified()
    assert backend.availability().available, backend.availability().reason
    versions = backend.versions()
    assert versions["amd-aiter"] == WHEEL.version
    assert "hip/<arch>" in versions["aiter_answered"]
    assert "gfx942: 304" in versions["aiter_answered"]
    kernel = backend.kernel(SMALL, torch.device("cpu"))
    assert kernel.__module__.startswith("_difftest_aiter_")
    assert not imported_as_aiter(WHEEL.package)  # never shadows an AITER


@needs_aiter
@on_cpu
def test_the_answered_arch_sets_aiters_fp8_type() -> None:
    backend = AiterUnified()
    cpu = torch.device("cpu")
    fnuz = SMALL.replace(kv_dtype="float8_e4m3fnuz")
    fn = SMALL.replace(kv_dtype="float8_e4m3fn")
    assert backend._fp8_type(fnuz, cpu) == torch.float8_e4m3fnuz
    assert backend._fp8_type(fn, cpu) == torch.float8_e4m3fn
    pinned = backend.with_options({"arch": "gfx942"})
    assert pinned.name == "aiter-unified[arch=gfx942]"
    assert "gfx942's fp8 is float8_e4m3fnuz" in (pinned.unsupported_reason(fn, cpu) or "")
    # gfx1201's fp8 is e4m3fn; the wheel's types.py answers e4m3fnuz for every arch but
    # gfx950: the loaded release refuses the case, generation (every release) does not
    rdna = backend.with_options({"arch": "gfx1201"})
    assert rdna.unsupported_in_every_release(fn, cpu) is None
    if backend.source is not None and backend.source.origin == "wheel":
        assert "fp8 type on gfx1201 is torch.float8_e4m3fnuz" in str(
            rdna.unsupported_reason(fn, cpu))


@needs_aiter
@on_cpu
def test_agrees_on_the_lbhnc_views_both_fp8_formats() -> None:
    backend = AiterUnified()
    for case in (CORPUS["lbhnc-128-blocks-2048-2040-page-2039"],
                 CORPUS["padded-request-and-empty-selection-fnuz"]):
        result = run_case(case, TorchReference(), [backend], torch.device("cpu"))
        assert result.results[0].status is Status.AGREE, (case.name, result.results[0].detail)


@needs_aiter
@on_cpu
def test_both_kernel_paths_run_and_agree(monkeypatch) -> None:
    backend = AiterUnified()
    short = SMALL  # max_seqlen_k = 2 * 128 <= 512: the 2-D kernel
    long = SMALL.replace(num_blocks=8, seq_lens=(600,), block_tables=((3, 5, 6, 7, 1),),
                         selections=((0, 1, 2, 3, 4),))  # 640 > 512: the 3-D kernel
    assert (kernel_path(short, 256), kernel_path(long, 256)) == ("2D", "3D")
    assert not ran_3d(backend, short, monkeypatch)
    assert ran_3d(backend, long, monkeypatch)


@needs_aiter
def test_a_bad_source_is_an_error_naming_where_it_looked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DIFFTEST_AITER_ROOT", str(tmp_path))
    with pytest.raises(SourceError, match=r"aiter=v9\.9\.9: no AITER package .*fetch_aiter"):
        AiterUnified().with_options({"aiter": "v9.9.9"})
    with pytest.raises(ValueError,
                       match=r"arch='gfx90a' is not one of gfx942, gfx950, gfx1201"):
        AiterUnified().with_options({"arch": "gfx90a"})
    shuffled = AiterUnified(shuffled=True)
    if "shuffled_kv_cache" not in shuffled._kernel_source():
        # a release without the shuffled views: every case unsupported, never a fitted draw
        assert shuffled.availability().available
        reason = shuffled.unsupported_reason(CORPUS["lbhnc-128-blocks-2048-2040-page-2039"],
                                             torch.device("cpu"))
        assert "no shuffled_kv_cache (AITER v0.1.16 on)" in str(reason)


@on_cpu
@pytest.mark.parametrize(("tag", "name"), [
    ("v0.1.16", "lbhnc-128-blocks-2048-2040-page-2039"),  # K [2048,1,8,16,16], V [2040,...]
    ("v0.1.20.post1", "lbhnc-4200-blocks-page-ids-past-65536"),
])
def test_shuffled_views_agree_on_a_tree_that_has_them(tag: str, name: str) -> None:
    tree = tree_from(tag)
    backend = AiterUnified(shuffled=True, options={"aiter": tag})
    assert backend.availability().available, backend.availability().reason
    result = run_case(CORPUS[name], TorchReference(), [backend], torch.device("cpu"))
    assert result.results[0].status is Status.AGREE, (tree.version, result.results[0].detail)


def direct_kernel(source: Any, page: int, pages: int = 1, head_dim: int = 64
                  ) -> tuple[DeviceAnswers, Any, tuple[torch.Tensor, ...]]:
    """AITER's ``unified_attention`` of ``source`` loaded as for gfx950, and seeded fp16
    inputs for it: one query of one head of ``head_dim``, K and V of ``pages`` pages of
    ``page`` tokens."""
    answers = DeviceAnswers.for_arch("gfx950")
    path = source.find("ops/triton/attention/unified_attention.py",
                       "ops/triton/unified_attention.py")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, head_dim, generator=generator).half()
    k = torch.randn(pages, page, 1, head_dim, generator=generator).half()
    v = torch.randn(pages, page, 1, head_dim, generator=generator).half()
    return answers, source.load(path, answers).unified_attention, (q, k, v)


def direct_call(source: Any, softcap: float = 0.0, window: int = 0,
                nan_before_window: bool = False, context: int = 16) -> torch.Tensor:
    """AITER's ``unified_attention`` on one 16-token page, one head of 64, fp16, called
    directly (no adapter): the output row. ``context`` < 16 leaves the page's last slots
    past the row's context, NaN."""
    answers, unified_attention, (q, k, v) = direct_kernel(source, 16)
    if nan_before_window:
        v[0, : 16 - window] = float("nan")  # slots the window excludes: never attended
    v[0, context:] = float("nan")  # past the context: never attended
    out = torch.zeros(1, 1, 64, dtype=torch.float16)
    with answering(answers):
        unified_attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            max_seqlen_q=1, seqused_k=torch.tensor([context], dtype=torch.int32), max_seqlen_k=16,
            softmax_scale=1.0, causal=True, window_size=(window - 1, 0) if window else (-1, -1),
            block_table=torch.zeros(1, 1, dtype=torch.int32), softcap=softcap,
            q_descale=None, k_descale=None, v_descale=None)
    return out[0, 0]


@needs_aiter
@on_cpu
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning",
                            "ignore:divide by zero encountered:RuntimeWarning")
def test_f21_softcap_turns_large_logit_ratios_into_nan() -> None:
    """|s| reaches ~16 here, so |s / 0.01| passes 88 and e^(s/x) overflows; softcap 50
    keeps it finite."""
    assert direct_call(WHEEL, softcap=0.01).isnan().all()
    assert direct_call(WHEEL, softcap=50.0).isfinite().all()


@needs_aiter
@on_cpu
def test_f22_nan_v_slots_before_the_window_poison_the_row() -> None:
    """A window of 4 over a 16-token page: slots 0..11 are never attended, yet NaN there
    makes the output NaN; with finite values there the output is finite."""
    assert direct_call(WHEEL, window=4, nan_before_window=True).isnan().all()
    assert direct_call(WHEEL, window=4).isfinite().all()


@needs_aiter
@on_cpu
def test_f24_nan_v_slots_past_the_context_poison_the_row() -> None:
    """A 15-token context in a 16-token page whose slot 15 is NaN: the output is NaN."""
    assert direct_call(WHEEL, context=15).isnan().all()
    assert direct_call(WHEEL, context=16).isfinite().all()


@on_cpu
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning",
                            "ignore:divide by zero encountered:RuntimeWarning")
def test_f21_f22_f24_are_still_in_the_newest_tag() -> None:
    tree = tree_from("v0.1.20.post1")
    assert direct_call(tree, softcap=0.01).isnan().all()
    assert direct_call(tree, window=4, nan_before_window=True).isnan().all()
    assert direct_call(tree, context=15).isnan().all()


def direct_3d_call(source: Any, head_dim: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER's ``unified_attention`` on fp16 K/V with ``max_seqlen_k`` 640 (> 512: the 3-D
    kernel), one query row over 40 pages, called directly: the output row and float64
    attention of the same inputs."""
    answers, unified_attention, (q, k, v) = direct_kernel(source, 16, 40, head_dim)
    out = torch.zeros(1, 1, head_dim, dtype=torch.float16)
    with answering(answers):
        unified_attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            max_seqlen_q=1, seqused_k=torch.tensor([640], dtype=torch.int32), max_seqlen_k=640,
            softmax_scale=head_dim**-0.5, causal=True, window_size=(-1, -1),
            block_table=torch.arange(40, dtype=torch.int32)[None], softcap=0.0,
            q_descale=None, k_descale=None, v_descale=None)
    keys, values = k.double().flatten(0, 2), v.double().flatten(0, 2)
    expected = torch.softmax(q[0].double() @ keys.T * head_dim**-0.5, dim=-1) @ values
    return out[0, 0], expected[0]


@on_cpu
def test_f23_fp16_kv_on_the_3d_kernel_raises_in_v0_1_16_only() -> None:
    with pytest.raises(AssertionError, match="kv_cache_dtype only supports BF16"):
        direct_3d_call(tree_from("v0.1.16"))
    actual, expected = direct_3d_call(tree_from("v0.1.16.post3"))
    torch.testing.assert_close(actual.double(), expected, atol=2e-3, rtol=0)


FAKE_HOST = '''
import aiter.ops.triton.utils._triton.arch_info as arch_info
from aiter.ops.triton.utils.device_info import get_num_sms

ARCH = arch_info.get_arch()


def unified_attention(**arguments):
    return ARCH, get_num_sms()
'''
FAKE_ARCH_INFO = '''
import triton


def get_arch():
    return triton.runtime.driver.active.get_current_target().arch
'''
FAKE_DEVICE_INFO = '''
import torch


def get_num_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
'''


def fake_tree(root: Path) -> Path:
    """An AITER tree whose package ``__init__`` files fail and whose host module asks Triton
    for the arch at import and torch for the CU count at call time, as AITER's do."""
    triton_ops = root / "aiter" / "ops" / "triton"
    (triton_ops / "utils" / "_triton").mkdir(parents=True)
    for package in (root / "aiter", root / "aiter" / "ops", triton_ops):
        (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (triton_ops / "unified_attention.py").write_text(FAKE_HOST)
    (triton_ops / "utils" / "_triton" / "arch_info.py").write_text(FAKE_ARCH_INFO)
    (triton_ops / "utils" / "device_info.py").write_text(FAKE_DEVICE_INFO)
    (root / "difftest-aiter-version").write_text("0.0.7\n")
    return root


@on_cpu
def test_a_tree_loads_without_its_init_and_gets_the_answers(tmp_path: Path) -> None:
    from triton.runtime.driver import driver

    tree = resolve(str(fake_tree(tmp_path / "tree")))
    assert tree.version == "0.0.7"
    before = driver._active
    module = tree.load(tree.package / "ops/triton/unified_attention.py",
                       DeviceAnswers.for_arch("gfx942"))
    assert module.ARCH == "gfx942" and driver._active is before  # answered, then restored
    with answering(DeviceAnswers.for_arch("gfx942")):
        assert module.unified_attention() == ("gfx942", 304)
    assert module.__name__.startswith("_difftest_aiter_0_0_7_")
    assert not imported_as_aiter(tree.package)
    other = tree.load(tree.package / "ops/triton/unified_attention.py",
                      DeviceAnswers.for_arch("gfx950"))
    assert other is not module and other.ARCH == "gfx950"  # one copy per answered arch


def test_fetch_aiter_rejects_a_bad_name() -> None:
    import subprocess

    script = Path(__file__).resolve().parent.parent / "scripts" / "fetch_aiter.sh"
    result = subprocess.run(["bash", str(script), "main; rm"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 2
    assert "NAME must be an amd-aiter version like 0.1.7.post2.dev18 or a tag" in result.stderr


def direct_block_48(source: Any, shuffled: bool = False) -> torch.Tensor:
    """AITER's ``unified_attention`` on one decode row over one 48-token page (fp16, one head
    of 64; plain ``[1, 48, 1, 64]`` or shuffled K ``[1, 1, 8, 48, 8]`` / V ``[1, 1, 6, 64, 8]``
    views), called directly: the output row."""
    answers, unified_attention, (q, k, v) = direct_kernel(source, 48)
    extra = {}
    if shuffled:  # x = 8 fp16 values: K [n, h, D/x, P, x], V [n, h, P/x, D, x]
        k = k.reshape(1, 48, 1, 8, 8).permute(0, 2, 3, 1, 4).contiguous()
        v = v.reshape(1, 6, 8, 1, 64).permute(0, 3, 1, 4, 2).contiguous()
        extra["shuffled_kv_cache"] = True
    out = torch.zeros(1, 1, 64, dtype=torch.float16)
    with answering(answers):
        unified_attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            max_seqlen_q=1, seqused_k=torch.tensor([48], dtype=torch.int32), max_seqlen_k=48,
            softmax_scale=0.125, causal=True, window_size=(-1, -1),
            block_table=torch.zeros(1, 1, dtype=torch.int32), softcap=0.0,
            q_descale=None, k_descale=None, v_descale=None, **extra)
    return out[0, 0]


@on_cpu
def test_f25_a_48_token_page_fails_to_launch_before_v0_1_12() -> None:
    wheel = wheel_source()
    if wheel is None:
        pytest.skip("no amd-aiter 0.1.7.post2.dev18 wheel in <venv>/difftest-aiter "
                    "(bash scripts/setup.sh unpacks it where no AITER is installed)")
    with pytest.raises(Exception, match="arange's range must be a power of 2"):
        direct_block_48(wheel)
    assert direct_block_48(tree_from("v0.1.12")).isfinite().all()


@on_cpu
def test_f26_shuffled_views_of_48_token_pages_fail_to_launch() -> None:
    tree = tree_from("v0.1.20.post1")
    assert direct_block_48(tree).isfinite().all()  # the plain views of the same pages run
    with pytest.raises(Exception, match="arange's range must be a power of 2"):
        direct_block_48(tree, shuffled=True)


@on_cpu
def test_f30_the_3d_kernel_fails_on_a_head_size_of_80_before_v0_1_12() -> None:
    """Head size 80 pads to 128 inside the kernels; before v0.1.12 the 3-D kernel's padded
    path names ``offs_d`` before defining it. Head size 128 runs on the same release."""
    old = tree_from("v0.1.11")
    with pytest.raises(Exception, match="name 'offs_d' is not defined"):
        direct_3d_call(old, head_dim=80)
    actual, expected = direct_3d_call(old, head_dim=128)
    torch.testing.assert_close(actual.double(), expected, atol=2e-3, rtol=0)
    actual, expected = direct_3d_call(tree_from("v0.1.12"), head_dim=80)
    torch.testing.assert_close(actual.double(), expected, atol=2e-3, rtol=0)


def direct_shuffled(source: Any, head_dim: int, nan_after: bool) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """AITER's ``unified_attention`` called directly on pre-shuffled views: one fp16 decode row
    over page 0 of two 16-token pages of one head (page 1 NaN with ``nan_after``); its output
    row and float64 attention over page 0."""
    answers, unified_attention, (q, k, v) = direct_kernel(source, 16, 2, head_dim)
    if nan_after:
        k[1], v[1] = float("nan"), float("nan")
    x = 8  # fp16 values per 16 bytes: K [n, h, D/x, P, x], V [n, h, P/x, D, x]
    k_shuffled = k.reshape(2, 16, 1, head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous()
    v_shuffled = v.reshape(2, 16 // x, x, 1, head_dim).permute(0, 3, 1, 4, 2).contiguous()
    out = torch.zeros(1, 1, head_dim, dtype=torch.float16)
    with answering(answers):
        unified_attention(
            q=q, k=k_shuffled, v=v_shuffled, out=out,
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1,
            seqused_k=torch.tensor([16], dtype=torch.int32), max_seqlen_k=16,
            softmax_scale=head_dim**-0.5, causal=True, window_size=(-1, -1),
            block_table=torch.zeros(1, 1, dtype=torch.int32), softcap=0.0,
            q_descale=None, k_descale=None, v_descale=None, shuffled_kv_cache=True)
    keys, values = k[0, :, 0].double(), v[0, :, 0].double()
    expected = torch.softmax(q[0].double() @ keys.T * head_dim**-0.5, -1) @ values
    return out[0, 0].double(), expected[0]


@on_cpu
@pytest.mark.parametrize("tag", ["v0.1.16", "v0.1.20.post1"])
def test_f37_shuffled_views_of_head_sizes_80_and_96_are_misread(tag: str) -> None:
    """A pre-shuffled block of head size 96 holds 12 chunks of 8; the kernel reads 16 (its
    padded 128) in one unmasked run: the values land in the wrong places and the read runs
    into page 1 (NaN there makes the row NaN)."""
    tree = aiter_tree(tag)
    actual, expected = direct_shuffled(tree, 128, nan_after=True)
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=0)
    for head_dim in (80, 96):
        actual, _ = direct_shuffled(tree, head_dim, nan_after=True)
        assert actual.isnan().all(), (tag, head_dim)
        actual, expected = direct_shuffled(tree, head_dim, nan_after=False)
        assert (actual - expected).abs().max() > 0.5, (tag, head_dim)
