"""What a row attends under its window, in one place (difftest.case.selection), and its
readers: the canaries NaN exactly the slots no row reads, and the questions a model of a
kernel bug asks (the tokens before a window, the page where it starts, the last page past the
context) answer from the same spans."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from difftest.case.selection import (
    Span,
    attended_spans,
    before_window,
    build_rows,
    last_page_past_context,
    read_slots,
    window_page_before,
    window_start,
)
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.generation.dense import dense_cases
from difftest.generation.strategies import cases

# One request, blocks 5, 1, 6 (300 tokens: 128, 128, 44), window 100: the row attends the last
# 56 tokens of block 1 and the 44 of block 6.
WINDOWED = Case(num_blocks=8, seq_lens=(300,), block_tables=((5, 1, 6),),
                selections=((0, 1, 2),), sliding_window=100, canary=True, name="windowed")


def _brute_force_slots(case: Case, row_index: int) -> list[int]:
    """The row's cache slots in attend order, its window the last W of them."""
    row = build_rows(case)[row_index]
    ids = [seg.physical_block * case.block_size + t for seg in row.segments
           for t in range(seg.tokens)]
    return ids[-case.sliding_window:] if case.sliding_window else ids


def test_window_start_on_ints_and_tensors() -> None:
    assert [window_start(n, 100) for n in (0, 99, 100, 300)] == [0, 0, 0, 200]
    assert window_start(300, 0) == 0
    lengths = torch.tensor([0, 99, 100, 300])
    assert window_start(lengths, 100).tolist() == [0, 0, 0, 200]
    assert window_start(lengths, 0).tolist() == [0, 0, 0, 0]


def test_spans_and_the_questions_a_bug_model_asks() -> None:
    row = build_rows(WINDOWED)[0]
    assert attended_spans(WINDOWED, row) == (Span(0, 5, 128, 128), Span(1, 1, 72, 128),
                                             Span(2, 6, 0, 44))
    assert before_window(WINDOWED, row) == (Span(0, 5, 0, 128), Span(1, 1, 0, 72))
    # the window starts at token 72 of block 1, inside its page 64..79
    assert window_page_before(WINDOWED, row) == Span(1, 1, 64, 72)
    # the context ends at token 44 of block 6, inside its page 32..47
    assert last_page_past_context(WINDOWED, row) == Span(2, 6, 44, 48)
    assert list(Span(2, 6, 44, 48).slots(128)) == [812, 813, 814, 815]
    assert read_slots(WINDOWED) == frozenset(_brute_force_slots(WINDOWED, 0))
    unwindowed = WINDOWED.replace(sliding_window=0)
    assert before_window(unwindowed, row) == ()
    assert window_page_before(unwindowed, row) is None
    on_a_page = WINDOWED.replace(sliding_window=108)  # starts at token 64 of block 1
    assert window_page_before(on_a_page, row) is None


@settings(max_examples=max(10, min(200, settings().max_examples)))
@given(case=cases(max_blocks=512))
def test_spans_are_the_last_window_of_each_row(case: Case) -> None:
    """Property: each row's spans, in attend order, are its context's last ``W`` slots."""
    for n, row in enumerate(build_rows(case)):
        spans = attended_spans(case, row)
        assert [(s.block, s.physical_block, s.end) for s in spans] == [
            (seg.block, seg.physical_block, seg.tokens) for seg in row.segments]
        slots = [slot for s in spans for slot in s.slots(case.block_size)]
        assert slots == _brute_force_slots(case, n)


@settings(max_examples=max(5, min(50, settings().max_examples // 4)), deadline=None)
@given(case=cases(max_batch=2, max_topk=4, max_blocks=256) | dense_cases())
def test_canaries_are_nan_exactly_where_no_row_reads(case: Case) -> None:
    """Property: with ``canary``, an attended block's slot holds data iff some row reads it
    (:func:`read_slots`), in the cache a backend receives."""
    case = case.replace(canary=True)
    inputs = RunInputs(case, torch.device("cpu"))
    sides = case.layout.sides(inputs.cache("plain").raw, case)  # [n, 2, B, nkv, D]
    read = read_slots(case, inputs.rows)
    for block in inputs.data.physical_blocks:
        data = ~sides[block].isnan().all(dim=-1).all(dim=-1)  # [2, B]
        expected = torch.tensor([block * case.block_size + t in read
                                 for t in range(case.block_size)])
        assert torch.equal(data[0], expected) and torch.equal(data[1], expected), block
