"""The framework's own sparse page-table builder: the reference semantics of a selection.

Per query row (one program per row in vLLM's ``_build_sparse_block_table_kernel``): a lane is
valid iff its logical block is ``0 <= blk <= self_blk`` and the row's causal length is positive.
Valid blocks before the row's own block are *full* blocks, compacted in top-k order; every lane
that selects the row's own block is the *tail*, placed once after the full blocks and truncated
at the causal limit. Page ids are ``block_table[blk] * block_page_stride + j`` for ``j < 8``;
the rest of the row is zero. Duplicated full blocks are attended once per copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftest.case import Case


@dataclass(frozen=True)
class Segment:
    """A run of tokens one query row attends: ``tokens`` tokens of logical block ``block``."""

    block: int
    physical_block: int
    tokens: int


@dataclass(frozen=True)
class SparseRow:
    """What one query row attends, in attend order (full blocks, then the tail)."""

    request: int
    abs_pos: int
    segments: tuple[Segment, ...]

    @property
    def context_len(self) -> int:
        """Tokens attended (the kernels' ``context_lens`` entry)."""
        return sum(s.tokens for s in self.segments)


def build_rows(case: Case) -> tuple[SparseRow, ...]:
    """The logical attend list of every query row."""
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


def row_page_ids(case: Case, row: SparseRow) -> tuple[int, ...]:
    """Page ids a row reads (only pages that hold at least one attended token)."""
    pages = []
    for seg in row.segments:
        base = seg.physical_block * case.block_page_stride
        pages.extend(base + j for j in range(-(-seg.tokens // case.page_size)))
    return tuple(pages)


def page_table(case: Case, rows: tuple[SparseRow, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sparse_block_table [total_q, topk*8], context_lens [total_q])``, both int32, CPU."""
    ppb = case.pages_per_side
    blocks = torch.tensor([[seg.physical_block for seg in row.segments]
                           + [-1] * (case.topk - len(row.segments)) for row in rows],
                          dtype=torch.int64).view(case.total_q, case.topk)
    pages = blocks[:, :, None] * case.block_page_stride + torch.arange(ppb)
    table = torch.where(blocks[:, :, None] >= 0, pages, 0).view(case.total_q, -1)
    ctx = torch.tensor([row.context_len for row in rows], dtype=torch.int32)
    return table.to(torch.int32), ctx


def selection_is_canonical(case: Case) -> bool:
    """Whether every row is unique valid blocks followed only by ``-1`` (what indexers emit).

    Valid means within the row's causal range. Irregular rows (duplicates, ``-1`` holes,
    blocks past the causal limit) have a defined meaning here but some kernels read them
    differently; backends declare whether they accept them.
    """
    for n, lanes in enumerate(case.selections):
        abs_pos = case.abs_pos(n)
        self_blk = abs_pos // case.block_size if abs_pos >= 0 else -1
        valid = [b for b in lanes if b != -1]
        if len(set(valid)) != len(valid) or any(not 0 <= b <= self_blk for b in valid):
            return False
        if list(lanes[: len(valid)]) != valid:
            return False
    return True
