"""``vllm-triton-sparse``: vLLM's portable Triton decode, and its pinned quirks (F3-F6)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_triton_sparse import (
    INTERPRETER_BF16_FINDING,
    IRREGULAR_FINDING,
    VllmTritonSparse,
)
from difftest.case.selection import Segment, SparseRow
from difftest.case.spec import Case, cdiv
from difftest.contract.backend import EmptyRowOutput, RunInputs
from difftest.contract.compare import Comparison, compare
from difftest.contract.tolerance import Tolerance
from difftest.generation.corpus import load_corpus
from difftest.generation.strategies import cases
from difftest.machine import devices
from difftest.run.runner import Status, run_case

ACCEPT = VllmTritonSparse({"irregular": "accept"})
CORPUS = {c.name: c for c in load_corpus()}
interpreter_only = pytest.mark.skipif(not devices.interpreted(),
                                      reason="a finding about Triton's CPU interpreter")


@pytest.fixture(scope="module")
def device(difftest_session) -> torch.device:
    return difftest_session.device


def triton_reading(case: Case) -> tuple[SparseRow, ...]:
    """What the kernel attends, per the reference notes (``ct:302-346``): of the first
    ``min(topk, cdiv(kv_len, 128))`` lanes, every one with ``0 <= blk < cdiv(kv_len, 128)``,
    each copy counted, a block's tokens cut at ``kv_len``."""
    rows = []
    for n, lanes in enumerate(case.selections):
        request = case.request_of_row(n)
        kv_len = max(case.abs_pos(n) + 1, 0)
        blocks = cdiv(kv_len, case.block_size)
        table = case.block_tables[request]
        segments = tuple(
            Segment(b, table[b], min(case.block_size, kv_len - b * case.block_size))
            for b in lanes[: min(case.topk, blocks)] if 0 <= b < blocks)
        rows.append(SparseRow(request, case.abs_pos(n), segments))
    return tuple(rows)


def against_reading(case: Case, device: torch.device) -> tuple[Comparison, Comparison]:
    """The kernel's output (irregular lanes accepted) compared with the framework's reading
    of the selection and with :func:`triton_reading`."""
    inputs = RunInputs(case, device)
    output = ACCEPT.run(inputs)
    tolerance = Tolerance(ACCEPT.precision(case, device))
    framework = compare(ACCEPT.name, output, TorchReference().reference(inputs), tolerance,
                        EmptyRowOutput.UNDEFINED, case, inputs.rows)
    predicted = RunInputs(case, device)
    predicted.__dict__["rows"] = triton_reading(case)  # the cached property, pre-empted
    quirks = compare(ACCEPT.name, output, TorchReference().reference(predicted), tolerance,
                     EmptyRowOutput.UNDEFINED, case, predicted.rows)
    return framework, quirks


def test_agrees_on_canonical_cases(device: torch.device) -> None:
    for case in (CORPUS["lbhnc-128-blocks-2048-2040-page-2039"],
                 CORPUS["lhbnc-exact-multiple-and-one-token-tail"].replace(kv_dtype="float16"),
                 CORPUS["mtp4-straddles-block-boundary"]):
        result = run_case(case, TorchReference(), [VllmTritonSparse()], device)
        r = result.results[0]
        assert r.status is Status.AGREE, r.detail or r.comparison.message(case)
        assert r.versions["irregular"] == "refuse"


SEQ = 300  # three logical blocks: 0 and 1 full, 2 the 44-token tail; the kernel scans 3 lanes


def quirk_case(selection: tuple[int, ...]) -> Case:
    return Case(num_blocks=64, seq_lens=(SEQ,), block_tables=((9, 40, 63),),
                selections=(selection,), seed=21)


def test_irregular_selections_are_declared_unsupported(device: torch.device) -> None:
    case = quirk_case((0, 2, 2, -1))
    result = run_case(case, TorchReference(), [VllmTritonSparse()], device)
    assert result.results[0].status is Status.UNSUPPORTED
    assert result.results[0].detail == IRREGULAR_FINDING


def test_f4_duplicated_tail_is_counted_twice(device: torch.device) -> None:
    """F4: the framework (and vLLM's AITER table builder) attends the tail once; this kernel
    attends it once per lane that selects it."""
    framework, quirks = against_reading(quirk_case((0, 2, 2, -1)), device)
    assert not framework.agrees and framework.mismatched > 0
    assert quirks.agrees, quirks.message(quirk_case((0, 2, 2, -1)))


def test_f4_valid_entry_after_minus_one_is_ignored(device: torch.device) -> None:
    """F4: only the first min(topk, cdiv(kv_len, 128)) = 3 lanes are scanned, so block 2 in
    lane 3, behind two -1s, is dropped; AITER's builder reads every lane."""
    case = quirk_case((0, -1, -1, 2))
    framework, quirks = against_reading(case, device)
    assert not framework.agrees
    assert quirks.agrees, quirks.message(case)
    assert [s.block for s in triton_reading(case)[0].segments] == [0]


def test_f4_harmless_irregularities_agree(device: torch.device) -> None:
    """A future block inside the scanned lanes is dropped by both readings, and a duplicated
    full block is counted per copy by both: no difference."""
    for selection in ((0, 5, 2, -1), (1, 1, 2, -1)):
        framework, _ = against_reading(quirk_case(selection), device)
        assert framework.agrees, selection


@settings(max_examples=8)
@given(case=cases(query_dtypes=("float16",), kv_dtypes=("float16", "float8_e4m3fn"),
                  selection_modes=("irregular",), max_batch=2, max_topk=8,
                  kernel_modes=False))  # the kernel has none; the test runs it directly
def test_f4_the_notes_predict_every_irregular_case(case: Case, device: torch.device) -> None:
    """On any irregular selection the kernel agrees with the reading the notes predict."""
    _, quirks = against_reading(case, device)
    assert quirks.agrees, quirks.message(case)


@interpreter_only
def test_f3_interpreter_miscomputes_bf16_queries() -> None:
    """F3: as for unified_attention (F1), bf16 queries come back wrong by orders of
    magnitude under TRITON_INTERPRET=1, while fp16 agrees."""
    forced = VllmTritonSparse({"interpreter_bf16": "accept"})
    case = quirk_case((2, 0, -1, -1))
    cpu = torch.device("cpu")
    bf16 = run_case(case.replace(query_dtype="bfloat16", kv_dtype="bfloat16"),
                    TorchReference(), [forced, VllmTritonSparse()], cpu).results
    fp16 = run_case(case, TorchReference(), [forced], cpu).results[0]
    assert bf16[0].status is Status.DISAGREE and bf16[0].comparison.max_ratio > 1e3
    assert bf16[1].status is Status.UNSUPPORTED and bf16[1].detail == INTERPRETER_BF16_FINDING
    assert fp16.status is Status.AGREE


def test_f5_non_fp8_cache_needs_the_query_dtype(device: torch.device) -> None:
    """F5: K/V are cast to the query dtype only for fp8 caches; a bf16 cache with fp16
    queries reaches ``tl.dot`` with mixed operands, which Triton rejects."""
    case = quirk_case((2, 0, -1, -1)).replace(kv_dtype="bfloat16")
    assert "pinned finding F5" in VllmTritonSparse().unsupported_reason(case, device)
    with pytest.raises(Exception, match="Both operands must be same dtype"):
        VllmTritonSparse().run(RunInputs(case, device))


def test_f6_rows_that_attend_nothing_are_nan(device: torch.device) -> None:
    """F6: padded requests and all -1 rows come out NaN (merge of -inf partials); declared
    undefined, so the comparison ignores them and the case agrees."""
    case = Case(num_blocks=16, seq_lens=(300, 0, 50), block_tables=((15, 2, 0), (), (7,)),
                selections=((2, 0, 1, -1), (-1, -1, -1, -1), (-1, -1, -1, -1)), seed=5)
    output = VllmTritonSparse().run(RunInputs(case, device)).float().cpu()
    assert bool(torch.isfinite(output[0]).all())
    assert bool(torch.isnan(output[1:]).all())
    result = run_case(case, TorchReference(), [VllmTritonSparse()], device).results[0]
    assert result.status is Status.AGREE and result.comparison.empty_rows == 2
    assert result.comparison.empty_row_policy == "undefined"
