"""``aiter-pa-decode``: AITER's Triton ``paged_attention_decode`` on the LBHNC views and the
dense family, and its bugs (docs/findings.md F34-F36).

The agreement tests run the setup's PyPI wheel; the findings are reproduced by calling AITER's
function directly on a few hand-made tensors, outside the adapter, on the wheel and on the
newest tag (``$DIFFTEST_AITER_REPO``; skipped with the command where it is not there).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from difftest.backends.aiter_pa_decode import AiterPaDecode, kernel_path
from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.contract.tolerance import Tolerance
from difftest.frontends.pytest_run import chosen_profile
from difftest.generation.corpus import load_corpus
from difftest.judgement.expectations import load as load_expectations
from difftest.machine import devices
from difftest.run.runner import Status, run_case
from tests.aiter_trees import aiter_tree, wheel_tree
from tests.test_geometry import dense

on_cpu = pytest.mark.skipif(not devices.interpreted(),
                            reason="runs AITER's kernels under TRITON_INTERPRET=1; on a GPU "
                            "the suite's backends run them natively")
CORPUS = {c.name: c for c in load_corpus()}
NEWEST = "v0.1.20.post1"


def agrees(backend: AiterPaDecode, case: Case) -> None:
    result = run_case(case, TorchReference(), [backend], torch.device("cpu"))
    assert result.results[0].status is Status.AGREE, result.results[0].detail


@on_cpu
@pytest.mark.parametrize("name", ["lbhnc-128-blocks-2048-2040-page-2039",
                                  "padded-request-and-empty-selection-fnuz"])
def test_agrees_on_the_lbhnc_views(name: str) -> None:
    """K [2048, ...] untrimmed against V [2040, ...]: one page id reads both sides."""
    wheel_tree()
    agrees(AiterPaDecode(), CORPUS[name])


@on_cpu
@pytest.mark.parametrize(("layout", "block", "group", "seq_lens"), [
    ("split", 64, 4, (70, 33)),  # v1 GQA
    ("LHBNC", 32, 1, (70, 33)),  # v1 MHA
    ("LBHNC", 64, 3, (1100, 20)),  # v2 GQA: two 1024-token partitions
])
def test_agrees_on_the_dense_family(layout: str, block: int, group: int,
                                    seq_lens: tuple[int, ...]) -> None:
    wheel_tree()
    case = dense(block=block, head_dim=96, kv_heads=2, group=group, layout=layout,
                 seq_lens=seq_lens)
    agrees(AiterPaDecode(), case)


def test_states_its_kernel_path_and_its_query_rounding() -> None:
    case = dense(block=64, kv_heads=2, group=1, seq_lens=(1100, 20))
    assert kernel_path(case, 1100) == "v2 MHA" and kernel_path(case, 700) == "v1 MHA"
    gqa = dense(block=64, kv_heads=2, group=4)
    assert kernel_path(gqa, 70) == "v1 GQA"
    precision = AiterPaDecode().precision(gqa, torch.device("cpu"))
    # q * scale is rounded to fp16 inside the kernel: charged though q is fp16 already
    assert precision.scaled_query_rounded and Tolerance.of(precision, gqa).rounds_query
    with pytest.raises(ValueError, match=r"unknown option 'arch' \(options: aiter\)"):
        AiterPaDecode({"arch": "gfx942"})


def direct_pa_decode(source: Any, block: int, q_heads: int, seq_len: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """AITER's ``paged_attention_decode`` called directly on one fp16 sequence of
    ``seq_len`` tokens over consecutive blocks of ``block`` tokens, ``q_heads`` query heads
    on one KV head of 64: its output and float64 attention."""
    import triton.language as tl

    path = source.find("ops/triton/attention/pa_decode.py", "ops/triton/pa_decode.py")
    module = source.load(path, None)
    generator = torch.Generator().manual_seed(0)
    blocks, d = max(1, -(-seq_len // block)), 64
    q = torch.randn(1, q_heads, d, generator=generator).half()
    k = torch.randn(blocks, 1, block, d, generator=generator).half()
    v = torch.randn(blocks, 1, block, d, generator=generator).half()
    out = torch.zeros(1, q_heads, d, dtype=torch.float16)
    module.paged_attention_decode(
        out, q, k, v, torch.tensor([seq_len], dtype=torch.int32),
        torch.arange(blocks, dtype=torch.int32)[None], d**-0.5, seq_len, tl.float16,
        torch.tensor([1.0]), torch.tensor([1.0]))
    keys = k[:, 0].reshape(-1, d)[:seq_len].double()
    values = v[:, 0].reshape(-1, d)[:seq_len].double()
    expected = torch.softmax(q[0].double() @ keys.T * d**-0.5, -1) @ values
    return out[0].double(), expected


def releases() -> list[Any]:
    return [wheel_tree(), aiter_tree(NEWEST)]


@on_cpu
def test_f34_the_v1_gqa_kernel_cannot_launch_on_48_token_blocks() -> None:
    for tree in releases():
        with pytest.raises(Exception, match="arange's range must be a power of 2"):
            direct_pa_decode(tree, 48, 8, 100)
        actual, expected = direct_pa_decode(tree, 64, 8, 100)  # a power of 2 runs
        torch.testing.assert_close(actual, expected, atol=2e-3, rtol=0)


@on_cpu
@pytest.mark.parametrize(("q_heads", "seq_len"), [(1, 100), (1, 1100), (8, 1100)],
                         ids=["v1-mha", "v2-mha", "v2-gqa"])
def test_f34_padding_lanes_of_48_token_blocks_count_as_tokens(q_heads: int,
                                                              seq_len: int) -> None:
    """Lanes 48..63 of every block but the last sit at positions below the context, so
    their logits (of K loaded as 0) are not masked: the row's weights are wrong."""
    for tree in releases():
        actual, expected = direct_pa_decode(tree, 48, q_heads, seq_len)
        assert (actual - expected).abs().max() > 0.02, tree.version
        actual, expected = direct_pa_decode(tree, 64, q_heads, seq_len)
        torch.testing.assert_close(actual, expected, atol=2e-3, rtol=0)


@on_cpu
def test_f35_a_batch_of_empty_sequences_cannot_launch() -> None:
    for tree in releases():
        with pytest.raises(Exception, match="arange's end argument must be greater"):
            direct_pa_decode(tree, 16, 8, 0)


F36_SCRIPT = """
import sys, torch
from difftest.machine import devices
devices.prepare_runtime("cpu")
import triton.language as tl
from difftest.backends.aiter_triton import resolve
tree = resolve(sys.argv[1])
module = tree.load(tree.find("ops/triton/attention/pa_decode.py", "ops/triton/pa_decode.py"),
                   None)
block, d, last = 16, 128, int(sys.argv[2])
cache = torch.zeros(last + 1, 1, block, d, dtype=torch.float8_e4m3fn)  # K and V alike
cache[last] = torch.randn(1, block, d, generator=torch.Generator().manual_seed(0)).to(
    cache.dtype)
q = torch.randn(1, 8, d, generator=torch.Generator().manual_seed(1)).half()
out = torch.zeros(1, 8, d, dtype=torch.float16)
module.paged_attention_decode(out, q, cache, cache, torch.tensor([block], dtype=torch.int32),
                              torch.tensor([[last]], dtype=torch.int32), d**-0.5, block,
                              tl.float16, torch.tensor([1.0]), torch.tensor([1.0]))
kv = cache[last, 0].double()
expected = torch.softmax(q[0].double() @ kv.T * d**-0.5, -1) @ kv
print(float((out[0].double() - expected).abs().max()))
"""


@on_cpu
@pytest.mark.skipif(chosen_profile() != "nightly", reason="2 GiB fp8 caches: the nightly "
                    "profile runs them (HYPOTHESIS_PROFILE=nightly)")
def test_f36_a_page_past_int32_offsets_faults(tmp_path: Path) -> None:
    """The last page of a cache whose offset passes 2**31 elements: a segmentation fault in
    the interpreter (the int32 offset wraps negative); the page just below runs."""
    tree = aiter_tree(NEWEST)
    per_block = 16 * 128

    def run(last: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", F36_SCRIPT, str(tree.package.parent),
                               str(last)], capture_output=True, text=True, timeout=600,
                              check=False)

    below = run(2**31 // per_block - 1)
    assert below.returncode == 0 and float(below.stdout) < 2e-3, below.stderr
    past = run(2**31 // per_block + 1)
    assert past.returncode == -11, (past.returncode, past.stdout, past.stderr[-500:])


def test_the_findings_are_expected_of_every_release() -> None:
    found: dict[str, list] = {}
    for expectation in load_expectations():
        found.setdefault(expectation.finding, []).append(expectation)
    case_48 = dense(block=48, kv_heads=1, group=8).to_dict()
    raises, miscounts = found["F34"]  # the v1 GQA path raises, the others miscount
    assert raises.error and not miscounts.error
    for entry in (raises, miscounts):
        assert entry.backends == ("aiter-pa-decode",) and entry.triggered_by(case_48)
        assert entry.releases.contains("0.1.7.post2.dev18", prereleases=True)
        assert entry.releases.contains("0.1.20.post1")
    empty = CORPUS["lbhnc-128-blocks-2048-2040-page-2039"]
    (batch,) = found["F35"]
    assert not batch.triggered_by(empty.to_dict())
    rows = tuple((-1,) * len(row) for row in empty.selections)
    assert batch.triggered_by(empty.replace(selections=rows).to_dict())
    (offsets,) = found["F36"]
    assert offsets.crash and not offsets.triggered_by(empty.to_dict())
