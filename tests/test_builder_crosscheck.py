"""vLLM's MiniMax-M3 sparse block-table builder against the framework's (difftest.case.selection).

``minimax_m3_build_sparse_block_table_decode`` (vLLM's Triton kernel, interpreted on CPUs)
and :func:`difftest.case.selection.page_table` of :func:`~difftest.case.selection.aiter_table_rows`
(the declared rows, except those F14 cuts short) must give the same context length per row and
the same page ids for every block a row attends (full blocks in top-k order, then the tail),
with the row zero-filled from ``n_valid * 8`` on, at either block page stride (16 packed
LBHNC, 8 dense LHBNC); and the rows whose context differs from the declared one must be
exactly those :func:`~difftest.case.selection.aiter_table_differs` names (the rows
``vllm-aiter`` refuses). vLLM's table starts as ``torch.empty``; here it starts as a sentinel,
which shows exactly what vLLM leaves undefined: for a tail selected by ``k > 1`` lanes the
``k - 1`` slots after the tail are never written (harmless, they lie past the context).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings

from difftest.backends.vllm_imports import import_minimax_m3, kernel_availability
from difftest.case.selection import aiter_table_differs, aiter_table_rows, build_rows, page_table
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.generation.strategies import cases

SENTINEL = -7


@pytest.fixture(scope="module")
def sparse_pa(difftest_session):
    """vLLM's ``sparse_pa`` module (and the run device, which the builder needs); skipped,
    naming the missing module, where the installed vLLM cannot import it."""
    kernel = kernel_availability("amd.ops.sparse_pa")
    if not kernel.available:
        pytest.skip(kernel.reason)
    return import_minimax_m3("amd.ops.sparse_pa"), difftest_session.device


def vllm_table(module, case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's decode table and context lengths, its buffers pre-filled with the sentinel."""
    def alloc(topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table, ctx = real_alloc(topk_idx)
        return table.fill_(SENTINEL), ctx.fill_(SENTINEL)

    real_alloc = module.minimax_m3_alloc_sparse_block_table
    inputs = RunInputs(case, device)
    with mock.patch.object(module, "minimax_m3_alloc_sparse_block_table", alloc):
        table, ctx = module.minimax_m3_build_sparse_block_table_decode(
            inputs.selections(), inputs.block_table(), inputs.seq_lens(),
            case.decode_query_len, case.block_page_stride)
    return table.cpu(), ctx.cpu()


def valid_lanes(case: Case, row: int) -> int:
    """Lanes vLLM counts as valid (``n_valid``): ``0 <= blk <= self_blk`` with a positive
    causal length; duplicates and every tail lane included."""
    abs_pos = case.abs_pos(row)
    if abs_pos < 0:
        return 0
    return sum(0 <= b <= abs_pos // case.block_size for b in case.selections[row])


IRREGULAR = Case(  # duplicated tail (x3), a future block, -1 holes, a padded request, mtp 2
    num_blocks=32, seq_lens=(300, 0, 129), block_tables=((31, 4, 0), (), (7, 8)),
    selections=((2, 9, 2, -1, 0, 2), (0, -1, -1, -1, -1, -1), (1, 0, 1, -1, 3, -1),
                (0, 0, -1, 1, -1, -1), (-1, -1, -1, -1, -1, -1), (1, -1, 0, 1, 1, 5)),
    decode_query_len=2)
CUT_SHORT = Case(  # F14: rows without their own block whose duplicates pass the causal length
    num_blocks=16, seq_lens=(129, 300), block_tables=((1, 2), (3, 4, 5)),
    selections=((0, 0, -1), (0, 0, 0), (1, 1, 0), (1, -1, 1)), decode_query_len=2)


@settings(max_examples=40)
@given(case=cases(max_topk=16, kernel_modes=False))  # vllm-aiter runs no kernel mode
@example(case=IRREGULAR)
@example(case=IRREGULAR.replace(kv_layout="LHBNC"))
@example(case=CUT_SHORT)
def test_vllm_builder_matches_the_framework(sparse_pa, case: Case) -> None:
    module, device = sparse_pa
    table, ctx = vllm_table(module, case, device)
    rows = aiter_table_rows(case)
    expected_table, expected_ctx = page_table(case, rows)
    assert torch.equal(ctx, expected_ctx), (ctx.tolist(), expected_ctx.tolist())
    _, declared_ctx = page_table(case, build_rows(case))
    assert (ctx != declared_ctx).nonzero().flatten().tolist() == aiter_table_differs(case)
    width = case.topk * case.pages_per_side
    assert table.shape == (case.total_q, width)
    for n, row in enumerate(rows):
        written = len(row.segments) * case.pages_per_side  # attended blocks, tail once
        used = valid_lanes(case, n) * case.pages_per_side
        assert torch.equal(table[n, :written], expected_table[n, :written]), n
        assert bool((table[n, written:used] == SENTINEL).all()), n  # duplicated tail lanes
        assert bool((table[n, used:] == 0).all()), n
        assert bool((expected_table[n, written:] == 0).all()), n
