"""The framework's sparse page-table builder (the reference semantics of a selection)."""

from __future__ import annotations

import torch

from difftest.case.selection import (
    aiter_table_differs,
    aiter_table_rows,
    build_rows,
    page_table,
    row_page_ids,
    selection_is_canonical,
)
from difftest.case.spec import Case


def test_full_blocks_first_then_tail_and_zero_padding() -> None:
    case = Case(num_blocks=128, seq_lens=(300,), block_tables=((9, 127, 4),),
                selections=((2, 0, -1, -1),))
    (row,) = build_rows(case)
    assert [(s.block, s.physical_block, s.tokens) for s in row.segments] == [
        (0, 9, 128), (2, 4, 44)]
    table, ctx = page_table(case, build_rows(case))
    assert ctx.tolist() == [172]
    assert table[0, :8].tolist() == list(range(144, 152))
    assert table[0, 8:16].tolist() == list(range(64, 72))
    assert table[0, 16:].tolist() == [0] * 16
    assert row_page_ids(case, row) == (*range(144, 152), 64, 65, 66)


def test_mtp_rows_have_their_own_causal_limits() -> None:
    case = Case(num_blocks=16, seq_lens=(130,), block_tables=((15, 14),),
                selections=((0, 1),) * 4, decode_query_len=4)
    rows = build_rows(case)
    assert [r.abs_pos for r in rows] == [126, 127, 128, 129]
    assert [r.context_len for r in rows] == [127, 128, 129, 130]
    assert [len(r.segments) for r in rows] == [1, 1, 2, 2]


def test_duplicates_future_blocks_and_padding_follow_the_kernel_rules() -> None:
    case = Case(num_blocks=16, seq_lens=(300, 0), block_tables=((1, 2, 3), ()),
                selections=((0, 0, 2, 2, 5, -1), (0, 1, -1, -1, -1, -1)))
    first, padded = build_rows(case)
    # duplicated full block attended twice, duplicated tail once, future block dropped
    assert [(s.block, s.tokens) for s in first.segments] == [(0, 128), (0, 128), (2, 44)]
    assert padded.segments == () and padded.context_len == 0
    assert not selection_is_canonical(case)


def test_canonical_selection() -> None:
    case = Case(num_blocks=16, seq_lens=(300,), block_tables=((1, 2, 3),),
                selections=((2, 0, -1),))
    assert selection_is_canonical(case)
    hole = case.replace(selections=((2, -1, 0),))
    assert not selection_is_canonical(hole)
    table, _ = page_table(hole, build_rows(hole))
    assert table.dtype == torch.int32


def test_aiter_table_cuts_a_row_without_its_own_block_at_the_causal_length() -> None:
    """F14: position 128 (block 1) selecting block 0 three times: vLLM's builder keeps the three
    slots (24 pages) but its context is min(3 x 128, 129), so the copies get 128, 1 and 0
    tokens; the declared semantics attends 384."""
    case = Case(num_blocks=16, seq_lens=(129,), block_tables=((3, 5),),
                selections=((0, 0, 0, -1),))
    (row,) = aiter_table_rows(case)
    assert [(s.block, s.physical_block, s.tokens) for s in row.segments] == [
        (0, 3, 128), (0, 3, 1), (0, 3, 0)]
    assert row.context_len == 129 and build_rows(case)[0].context_len == 384
    assert aiter_table_differs(case) == [0]
    wide = case.replace(seq_lens=(300,), block_tables=((3, 5, 7),), selections=((1, 1, 0, 5),))
    assert [s.tokens for s in aiter_table_rows(wide)[0].segments] == [128, 128, 44]
    assert aiter_table_differs(wide) == [0]  # three full lanes, 384 > 300 tokens
    table, ctx = page_table(case, (row,))
    assert ctx.tolist() == [129]
    assert table[0, :24].tolist() == list(range(48, 56)) * 3
    assert row_page_ids(case, row) == (*range(48, 56), 48)


def test_aiter_table_is_the_declared_one_with_the_own_block_or_room_below_it() -> None:
    """With a lane on the own block (the tail: the declared context), or duplicated full blocks
    that stay within the causal length, vLLM's builder reads the row as declared."""
    for seq_len, selection in ((129, (0, 0, 1, -1)), (129, (1, 0, 0, 1)), (300, (0, 0, -1, -1)),
                               (300, (1, -1, 1, 5)), (256, (0, 0, -1, -1)),
                               (129, (0, -1, -1, -1))):
        blocks = (3, 5, 7)[: -(-seq_len // 128)]
        case = Case(num_blocks=16, seq_lens=(seq_len,), block_tables=(blocks,),
                    selections=(selection,))
        assert aiter_table_rows(case) == build_rows(case), selection
        assert aiter_table_differs(case) == [], selection
