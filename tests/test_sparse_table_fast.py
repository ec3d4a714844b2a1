"""The vectorised :func:`build_rows` and :func:`page_table` give exactly what the former
row-by-row implementation gave (rows, segments, page table, context lengths: values, types,
dtypes, shapes, order), on the pinned corpus and on irregular selections; so do the readings
built on them (:func:`aiter_table_rows`, :func:`aiter_table_differs`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from difftest.case.selection import (
    Segment,
    SparseRow,
    aiter_table_differs,
    aiter_table_rows,
    build_rows,
    page_table,
    reading_differs,
)
from difftest.case.spec import Case

RECORD = Path(__file__).with_name("test_bit_identical.json")


# ----- ORACLE: the row-by-row implementation before vectorising (commit 563c74b), kept here
# only to pin the new one to it; the library does not use it. --------------------------------
def oracle_build_rows(case: Case) -> tuple[SparseRow, ...]:
    rows = []
    for n, lanes in enumerate(case.selections):
        req = case.request_of_row(n)
        abs_pos = case.abs_pos(n)
        causal_len = max(abs_pos + 1, 0)
        self_blk = abs_pos // case.block_size
        table = case.block_tables[req]
        valid = [b for b in lanes if causal_len > 0 and 0 <= b <= self_blk]
        full = [Segment(b, table[b], case.block_size) for b in valid if b < self_blk]
        if self_blk in valid:
            tail_tokens = causal_len - self_blk * case.block_size
            full.append(Segment(self_blk, table[self_blk], tail_tokens))
        rows.append(SparseRow(req, abs_pos, tuple(full)))
    return tuple(rows)


def oracle_page_table(case: Case, rows: tuple[SparseRow, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    ppb = case.pages_per_side
    blocks = torch.tensor([[seg.physical_block for seg in row.segments]
                           + [-1] * (case.topk - len(row.segments)) for row in rows],
                          dtype=torch.int64).view(case.total_q, case.topk)
    pages = blocks[:, :, None] * case.block_page_stride + torch.arange(ppb)
    table = torch.where(blocks[:, :, None] >= 0, pages, 0).view(case.total_q, -1)
    ctx = torch.tensor([row.context_len for row in rows], dtype=torch.int32)
    return table.to(torch.int32), ctx
# ----- end of the oracle ------------------------------------------------------------------


def irregular_case(seed: int) -> Case:
    """A random case with every irregularity a selection can have: duplicates (the tail's
    too), ``-1`` holes before valid lanes, blocks past the causal limit, padded requests,
    MTP rows or prefill-like query lengths, and both KV layouts."""
    rng = random.Random(seed)
    batch = rng.randint(1, 6)
    mtp = rng.choice((1, 1, 2, 4))
    use_query_lens = mtp == 1 and rng.random() < 0.4
    query_lens = tuple(rng.randint(1, 6) for _ in range(batch)) if use_query_lens else ()
    seq_lens = []
    for r in range(batch):
        q = query_lens[r] if query_lens else mtp
        seq_lens.append(0 if rng.random() < 0.15 else rng.randint(q, 900))
    tables_len = [-(-s // 128) for s in seq_lens]
    num_blocks = 64
    physical = rng.sample(range(num_blocks - 1), sum(tables_len))
    tables, at = [], 0
    for n in tables_len:
        tables.append(tuple(physical[at:at + n]))
        at += n
    topk = rng.randint(1, 12)
    total_q = sum(query_lens) if query_lens else batch * mtp
    lanes = (-1, -1, 0, 0, 1, 2, 3, 5, 6, 7, 9, 40)
    selections = tuple(tuple(rng.choice(lanes) for _ in range(topk)) for _ in range(total_q))
    return Case(num_blocks=num_blocks, seq_lens=tuple(seq_lens), block_tables=tuple(tables),
                selections=selections, decode_query_len=1 if query_lens else mtp,
                query_lens=query_lens, kv_layout=rng.choice(("LBHNC", "LHBNC")),
                name=f"irregular-{seed}")


def corpus() -> list[Case]:
    entries = json.loads(RECORD.read_text())["entries"]
    return [Case.from_dict(entry["case"]) for entry in entries]


def assert_rows_identical(new: tuple[SparseRow, ...], old: tuple[SparseRow, ...]) -> None:
    assert type(new) is tuple and len(new) == len(old)
    for a, b in zip(new, old, strict=True):
        assert type(a) is SparseRow and a == b
        assert type(a.segments) is tuple
        fields = [(a.request, a.abs_pos)] + [(s.block, s.physical_block, s.tokens)
                                             for s in a.segments]
        assert all(type(v) is int for group in fields for v in group)  # no numpy ints


def assert_tables_identical(new: tuple[torch.Tensor, torch.Tensor],
                            old: tuple[torch.Tensor, torch.Tensor]) -> None:
    for a, b in zip(new, old, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [*corpus(), *map(irregular_case, range(300))],
                         ids=lambda c: c.name)
def test_rows_and_page_table_match_the_row_by_row_implementation(case: Case) -> None:
    old_rows = oracle_build_rows(case)
    assert_rows_identical(build_rows(case), old_rows)
    assert_tables_identical(page_table(case, build_rows(case)),
                            oracle_page_table(case, old_rows))
    # the F14 reading is built on build_rows and read through page_table
    modelled = aiter_table_rows(case)
    assert_tables_identical(page_table(case, modelled), oracle_page_table(case, modelled))
    old_differs = [n for n, row in enumerate(old_rows)
                   if sorted((s.block, s.tokens) for s in row.segments if s.tokens)
                   != sorted((s.block, s.tokens) for s in modelled[n].segments if s.tokens)]
    assert aiter_table_differs(case) == reading_differs(case, modelled) == old_differs


def test_the_irregular_cases_reach_every_irregularity() -> None:
    """The generated cases are not all regular (else the comparison above would be weak)."""
    cases = [irregular_case(seed) for seed in range(300)]
    rows = [oracle_build_rows(c) for c in cases]
    assert any(c.query_lens for c in cases) and any(c.decode_query_len > 1 for c in cases)
    assert any(0 in c.seq_lens for c in cases)
    assert any(len({s.block for s in r.segments}) < len(r.segments) for rs in rows for r in rs)
    assert any(aiter_table_differs(c) for c in cases)
    assert any(not r.segments for rs in rows for r in rs)


def test_page_table_rejects_rows_of_another_case() -> None:
    case = irregular_case(1)
    with pytest.raises(ValueError, match="total_q"):
        page_table(case, build_rows(case)[:-1])
