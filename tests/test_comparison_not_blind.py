"""The comparison is not blind: a real kernel fed one classic bug is a disagreement, located.

Each test runs vLLM's ``unified_attention`` on the report's 128-block case with one input
corrupted the way a buggy adapter would corrupt it, and checks the verdict and that the
failure names the request, query token and pages of the rows the bug touched, and only those.
"""

from __future__ import annotations

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.case.selection import build_rows, row_page_ids
from difftest.case.spec import Case
from difftest.contract.compare import Comparison
from difftest.generation.corpus import load_corpus
from difftest.run.runner import Status, run_case
from mutants.injection import MutantBackend, Mutation, Table

CASE = {c.name: c for c in load_corpus()}["lbhnc-128-blocks-2048-2040-page-2039"]
ROW = 1  # request 1: blocks 5 and 0 full, block 64 a 44-token tail


@pytest.fixture(scope="module")
def device(difftest_session) -> torch.device:
    return difftest_session.device


def _comparison(mutation: Mutation, device: torch.device) -> Comparison:
    backend = TritonUnifiedAttention()
    if not backend.availability().available:
        pytest.skip(backend.availability().reason)
    result = run_case(CASE, TorchReference(), [MutantBackend(backend, mutation)], device)
    outcome = result.results[0]
    assert outcome.status is Status.DISAGREE, outcome.detail
    assert outcome.comparison is not None
    return outcome.comparison


def _one_page_off(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    table[ROW, : -(-int(ctx[ROW]) // case.page_size)] += 1
    return table, ctx


def _drop_tail(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    ctx[ROW] -= build_rows(case)[ROW].segments[-1].tokens
    return table, ctx


def _skip_scales(case: Case, scales: Table) -> Table:
    return tuple(torch.ones_like(s) for s in scales)  # type: ignore[return-value]


def _assert_located_on_row(comparison: Comparison) -> None:
    row = build_rows(CASE)[ROW]
    assert {loc.row for loc in comparison.worst} == {ROW}
    loc = comparison.worst[0]
    assert (loc.request, loc.query_token) == (1, 0)
    assert loc.pages == row_page_ids(CASE, row)
    assert loc.pages == (*range(80, 88), *range(0, 8), 1024, 1025, 1026)
    message = comparison.message(CASE)
    assert "request 1, query token 0 (row 1)" in message
    assert "on pages 80..87, 0..7, 1024..1026" in message


def test_one_page_off_is_a_located_disagreement(device: torch.device) -> None:
    comparison = _comparison(Mutation("page-off", "row 1 reads page id + 1",
                                      sparse_table=_one_page_off), device)
    _assert_located_on_row(comparison)
    assert comparison.max_ratio > 1


def test_dropped_tail_block_is_a_located_disagreement(device: torch.device) -> None:
    comparison = _comparison(Mutation("drop-tail", "row 1 without its tail block",
                                      sparse_table=_drop_tail), device)
    _assert_located_on_row(comparison)


def test_skipped_scales_are_a_disagreement_on_every_row(device: torch.device) -> None:
    comparison = _comparison(Mutation("skip-scales", "fp8 read without its scales",
                                      scales=_skip_scales), device)
    assert CASE.k_scale != 1.0 and CASE.v_scale != 1.0
    assert {loc.row for loc in comparison.worst} == {0, 1}
    assert comparison.mismatched > comparison.checked // 2
