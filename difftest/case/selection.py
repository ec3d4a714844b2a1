"""What each query row attends: the reference semantics of a selection, in one place.

Every reader of "which tokens does row ``n`` attend" calls this module: the reference, the
cache builder's NaN canaries, the diagnosis, the emulator, the backends' refusals and the
known-bug models. Semantics (docs/kernel-modes.md):

* **Context** (:func:`build_rows`): per query row, every lane is scanned; a lane is valid iff
  its logical block is ``0 <= blk <= self_blk`` and the row's causal length (``abs_pos + 1``:
  causal order within a request) is positive. ``-1`` lanes and blocks past the causal limit
  are ignored wherever they sit. Valid blocks before the row's own block are full
  :class:`Segment` s in top-k order (a duplicate attended once per copy); every lane on the
  row's own block is the *tail*, placed once after them and cut at the causal limit.
* **Window** (:func:`window_start`): with ``sliding_window = W`` a row attends the last ``W``
  tokens of its context in attend order; :func:`attended_spans` gives each segment's attended
  tokens ``[first, end)`` after it.
* **Pages** (:func:`page_table`, :func:`row_page_ids`): page ids ``block * block_page_stride
  + j``; cache *slots* are ``physical_block * block_size + token``.

Questions a model of a kernel bug asks, answered here: which slots some row reads
(:func:`read_slots`; with ``canary`` every other slot of an attended block is NaN), which
context tokens a row's window leaves out (:func:`before_window`), the slots of the page where
its window starts that lie before it (:func:`window_page_before`), and the slots of its last
page past its context (:func:`last_page_past_context`), each as :class:`Span` s.

Two vLLM kernels read some irregular rows differently; each reading is modelled
(:func:`portable_decode_rows`: finding F4; :func:`aiter_table_rows`: F14) and compared with
the declared one (:func:`reading_differs`), so that a backend refuses exactly the cases where
its reading changes what a row attends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from difftest.case.spec import Case


@dataclass(frozen=True, slots=True)
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


_SET_BLOCK = Segment.block.__set__  # type: ignore[attr-defined]  # slot descriptors
_SET_PHYSICAL = Segment.physical_block.__set__  # type: ignore[attr-defined]
_SET_TOKENS = Segment.tokens.__set__  # type: ignore[attr-defined]


def _segment(block: int, physical_block: int, tokens: int) -> Segment:
    """``Segment(block, physical_block, tokens)`` filling the slots directly, without the
    frozen ``__init__`` (docs/performance.md, "Segment tables"). The instance is the same
    (fields, equality, hash)."""
    seg = object.__new__(Segment)
    _SET_BLOCK(seg, block)
    _SET_PHYSICAL(seg, physical_block)
    _SET_TOKENS(seg, tokens)
    return seg


def build_rows(case: Case) -> tuple[SparseRow, ...]:
    """The logical attend list of every query row (its context, before any window)."""
    rows = []
    bs = case.block_size
    for n, lanes in enumerate(case.selections):
        req = case.request_of_row(n)
        abs_pos = case.abs_pos(n)
        segments: list[Segment] = []
        if abs_pos >= 0:  # a positive causal length: lanes 0 <= blk <= self_blk are valid
            self_blk = abs_pos // bs
            table = case.block_tables[req]
            segments = [_segment(b, table[b], bs) for b in lanes if 0 <= b < self_blk]
            if self_blk in lanes:  # the tail, once however many lanes select it
                segments.append(_segment(self_blk, table[self_blk], abs_pos + 1 - self_blk * bs))
        rows.append(SparseRow(req, abs_pos, tuple(segments)))
    return tuple(rows)


def row_page_ids(case: Case, row: SparseRow) -> tuple[int, ...]:
    """Page ids a row reads (only pages that hold at least one attended token)."""
    pages = []
    for seg in row.segments:
        base = seg.physical_block * case.block_page_stride
        pages.extend(base + j for j in range(-(-seg.tokens // case.page_size)))
    return tuple(pages)


Count = TypeVar("Count", int, torch.Tensor)


def window_start(context_len: Count, sliding_window: int) -> Count:
    """The ordinal, in attend order, of the first token a row of ``context_len`` tokens
    attends: with a sliding window ``W`` its last ``W`` tokens (``max(context_len - W, 0)``),
    else all (0). ``context_len`` is an int or an integer tensor (elementwise)."""
    if not sliding_window:
        return context_len * 0
    first = context_len - sliding_window
    return first.clamp(min=0) if isinstance(first, torch.Tensor) else max(first, 0)


class Span(NamedTuple):
    """Tokens ``first <= t < end`` of logical block ``block`` of a row's request (physical
    block ``physical_block``); empty where ``first >= end``."""

    block: int
    physical_block: int
    first: int
    end: int

    def slots(self, block_size: int) -> range:
        """Its cache slots, ``physical_block * block_size + t``."""
        base = self.physical_block * block_size
        return range(base + self.first, base + max(self.first, self.end))


def attended_spans(case: Case, row: SparseRow) -> tuple[Span, ...]:
    """What ``row`` attends, one span per segment in attend order: the segment's tokens from
    the row's :func:`window_start` on (a segment wholly before the window: an empty span)."""
    start = window_start(row.context_len, case.sliding_window)
    spans, ordinal = [], 0
    for seg in row.segments:
        spans.append(Span(seg.block, seg.physical_block,
                          min(max(start - ordinal, 0), seg.tokens), seg.tokens))
        ordinal += seg.tokens
    return tuple(spans)


def before_window(case: Case, row: SparseRow) -> tuple[Span, ...]:
    """The tokens of ``row``'s context its window leaves out (none without a window), per
    segment that has some."""
    return tuple(Span(s.block, s.physical_block, 0, s.first)
                 for s in attended_spans(case, row) if s.first > 0)


def window_page_before(case: Case, row: SparseRow) -> Span | None:
    """The tokens of the page (``page_size`` tokens of a block) where ``row``'s window starts
    that lie before the window; ``None`` where the window starts on a page boundary or the
    row has no window that cuts."""
    for s in attended_spans(case, row):
        if 0 < s.first < s.end:
            page_start = s.first - s.first % case.page_size
            return Span(s.block, s.physical_block, page_start, s.first) if (
                page_start < s.first) else None
    return None


def last_page_past_context(case: Case, row: SparseRow) -> Span | None:
    """The slots of ``row``'s last page (the page holding its last attended token) past its
    context; ``None`` where the context ends on a page boundary or is empty."""
    if not row.segments or not row.segments[-1].tokens:
        return None
    last = row.segments[-1]
    end = -(-last.tokens // case.page_size) * case.page_size
    return Span(last.block, last.physical_block, last.tokens, end) if end > last.tokens else None


def read_slots(case: Case, rows: Iterable[SparseRow] | None = None) -> frozenset[int]:
    """The cache slots some row reads, its window applied (``rows``: :func:`build_rows` of
    ``case`` where the caller has them). With ``canary`` every other slot of an attended
    block holds NaN."""
    read: set[int] = set()
    for row in build_rows(case) if rows is None else rows:
        for span in attended_spans(case, row):
            read.update(span.slots(case.block_size))
    return frozenset(read)


def page_table(case: Case, rows: Sequence[SparseRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sparse_block_table [total_q, topk * pages_per_side], context_lens [total_q])``,
    both int32, CPU.

    Row ``n``'s slot ``s`` holds the pages of its ``s``-th segment's physical block
    (``block * block_page_stride + j``, ``j < pages_per_side``); slots without a segment are
    zero."""
    if len(rows) != case.total_q:
        raise ValueError(f"rows: {len(rows)} rows, the case has total_q = {case.total_q}")
    counts = np.fromiter((len(row.segments) for row in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter((v for row in rows for seg in row.segments
                        for v in (seg.physical_block, seg.tokens)), dtype=np.int64,
                       count=2 * int(counts.sum())).reshape(-1, 2)
    row = np.repeat(np.arange(case.total_q), counts)
    slot = np.arange(row.size) - (np.cumsum(counts) - counts)[row]
    blocks = np.full((case.total_q, case.topk), -1, dtype=np.int64)
    blocks[row, slot] = flat[:, 0]
    pages = blocks[:, :, None] * case.block_page_stride + np.arange(case.pages_per_side)
    table = np.where(blocks[:, :, None] >= 0, pages, 0).reshape(case.total_q, -1)
    ctx = np.zeros(case.total_q, dtype=np.int64)
    np.add.at(ctx, row, flat[:, 1])
    return torch.from_numpy(table.astype(np.int32)), torch.from_numpy(ctx.astype(np.int32))


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


def rows_are_dense(case: Case, request: int) -> bool:
    """Whether every query row of ``request`` selects exactly its causal blocks ``0..self``
    in order (then ``-1``): the rows then share one causal sequence, the request's own."""
    for n in case.request_rows(request):
        abs_pos = case.abs_pos(n)
        if abs_pos < 0:
            return False
        own = abs_pos // case.block_size + 1
        lanes = case.selections[n]
        if list(lanes[:own]) != list(range(own)) or any(b != -1 for b in lanes[own:]):
            return False
    return True


def _attended(case: Case, row: SparseRow) -> list[tuple[int, int]]:
    return sorted((seg.block, seg.tokens) for seg in row.segments if seg.tokens)


def reading_differs(case: Case, reading: tuple[SparseRow, ...]) -> list[int]:
    """The rows whose attended tokens differ between the declared semantics
    (:func:`build_rows`) and ``reading`` (one :class:`SparseRow` per query row), compared as
    multisets of ``(block, tokens)`` segments: attention does not depend on their order."""
    return [n for n, (ours, theirs) in enumerate(zip(build_rows(case), reading, strict=True))
            if _attended(case, ours) != _attended(case, theirs)]


def portable_decode_rows(case: Case) -> tuple[SparseRow, ...]:
    """Every row as ``minimax_m3_sparse_attn_decode`` reads its lanes: the first
    ``min(topk, self_blk + 1)`` lanes only, each lane with ``0 <= blk <= self_blk`` one
    segment (a duplicate, the tail included, counted per copy), the tail truncated at the
    causal limit. The order of segments is lane order (attention does not depend on it)."""
    rows = []
    for n, lanes in enumerate(case.selections):
        req = case.request_of_row(n)
        abs_pos = case.abs_pos(n)
        causal_len = max(abs_pos + 1, 0)
        own = -(-causal_len // case.block_size)
        table = case.block_tables[req]
        segments = tuple(
            Segment(b, table[b], min(case.block_size, causal_len - b * case.block_size))
            for b in lanes[: min(case.topk, own)] if 0 <= b < own)
        rows.append(SparseRow(req, abs_pos, segments))
    return tuple(rows)


def portable_reading_differs(case: Case) -> list[int]:
    """The rows :func:`portable_decode_rows` reads differently (:func:`reading_differs`)."""
    return reading_differs(case, portable_decode_rows(case))


def aiter_table_rows(case: Case) -> tuple[SparseRow, ...]:
    """Every row as vLLM's ``_build_sparse_block_table_kernel`` (``amd/ops/sparse_pa.py``)
    builds its table and context length: the blocks of :func:`build_rows` in the same slots,
    but where no lane selects the row's own block the context is ``min(n_valid * 128,
    causal_len)`` (``n_valid``: the valid lanes, duplicates counted) instead of
    ``n_valid * 128``, and the kernel attends the first ``context`` tokens of the slots.
    Unique full blocks never reach the causal length, so only duplicated ones are cut: the
    copies past it keep their slot (and its 8 pages in the table) with fewer tokens, possibly
    none (finding F14). Rows that select their own block are the declared ones."""
    rows = []
    for row in build_rows(case):
        causal_len = max(row.abs_pos + 1, 0)
        own = row.abs_pos // case.block_size
        if row.segments and row.segments[-1].block == own:  # the tail: the declared context
            rows.append(row)
            continue
        left = min(row.context_len, causal_len)
        segments = []
        for seg in row.segments:
            segments.append(Segment(seg.block, seg.physical_block, min(seg.tokens, left)))
            left -= segments[-1].tokens
        rows.append(SparseRow(row.request, row.abs_pos, tuple(segments)))
    return tuple(rows)


def aiter_table_differs(case: Case) -> list[int]:
    """The rows :func:`aiter_table_rows` reads differently (:func:`reading_differs`): rows
    without a lane on their own block whose valid lanes hold more tokens than the causal
    length."""
    return reading_differs(case, aiter_table_rows(case))


def kernel_sequences(case: Case) -> list[tuple[int, int]]:
    """``(first row, query tokens)`` of every sequence ``triton-unified`` passes to
    ``unified_attention``: in a dense case every request that is not padded, and with
    ``query_lens`` a request of several rows that all select their causal blocks in order
    (:func:`rows_are_dense`), is one sequence, causal within it, over its block table; every
    other row is a sequence of its own over its sparse table row."""
    out = []
    for r in range(case.batch):
        rows = case.request_rows(r)
        if ((case.dense or (case.query_lens and len(rows) > 1))
                and rows_are_dense(case, r)):
            out.append((rows.start, len(rows)))
        else:
            out.extend((n, 1) for n in rows)
    return out


def unified_query_blocks(case: Case) -> int:
    """vLLM 0.33.0's ``num_seqs * cdiv(max_seqlen_q, BLOCK_Q)`` for :func:`kernel_sequences`
    (``BLOCK_M = max(16, next_pow2(G))``, ``BLOCK_Q = BLOCK_M // G``, ``G`` the query heads
    per KV head), which ``unified_attention`` compares with ``seq_threshold_3D``."""
    seqs = kernel_sequences(case)
    group = case.queries_per_kv
    block_m = 16 if group <= 16 else 1 << (group - 1).bit_length()
    block_q = block_m // group
    return len(seqs) * -(-max(n for _, n in seqs) // block_q)
