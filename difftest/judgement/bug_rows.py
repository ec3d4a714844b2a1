"""Which query rows and heads a known kernel bug makes wrong in a case: the bugs' models.

Each model names a finding's mechanism (docs/findings.md) and predicts, from the case, what
its rows attend and read (the selection's one rule, :mod:`difftest.case.selection`) and
where the cache holds NaN (with ``canary``, every slot of an attended block that no row
reads), the ``[total_q, num_q_heads]`` elements the bug may make wrong.
A prediction is an allowance, wide where the kernel's choice is not modelled (its tile size,
which rows of a sequence share a tile); :func:`difftest.judgement.expectations.explain`
accepts a failure as the bug only where every wrong element lies inside it. ``expectations.json``
names a model per entry (``"model"``); :data:`MODELS` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from difftest.case.selection import (
    Span,
    SparseRow,
    before_window,
    kernel_sequences,
    last_page_past_context,
    read_slots,
    window_start,
)
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs

SOFTCAP_OVERFLOW = 88.0  # |s / softcap| past which exp(|s / softcap|) overflows float32 (88.72)
UNIFIED_TILES = (64,)  # unified_attention's tile besides the page, in a batch of sequences
# of several rows (a decode batch, one row per sequence, loads tiles of a page)
LOGIT_ELEMENTS = 1 << 24  # gathered K values per chunk of rows in :func:`softcap_overflow`


@dataclass(frozen=True)
class _Canaries:
    """Where a case's cache holds NaN: with ``canary``, every slot of an attended block that
    no row reads (:func:`~difftest.case.selection.read_slots`)."""

    case: Case
    read: frozenset[int]

    @classmethod
    def of(cls, case: Case, rows: Sequence[SparseRow]) -> _Canaries:
        return cls(case, read_slots(case, rows) if case.canary else frozenset())

    def in_span(self, span: Span | None) -> bool:
        """Whether ``span``'s slots hold a NaN."""
        return (self.case.canary and span is not None
                and not all(slot in self.read for slot in span.slots(self.case.block_size)))

    def between(self, row: SparseRow, first: int, last: int) -> bool:
        """Whether positions ``first..last - 1`` of ``row``'s attend list hold a NaN slot."""
        ordinal = 0
        for seg in row.segments:
            lo, hi = max(first - ordinal, 0), min(last - ordinal, seg.tokens)
            if lo < hi and self.in_span(Span(seg.block, seg.physical_block, lo, hi)):
                return True
            ordinal += seg.tokens
        return False


def _as_heads(case: Case, rows: np.ndarray) -> torch.Tensor:
    """``[total_q]`` predicted rows as ``[total_q, num_q_heads]`` (every head of a row)."""
    return torch.from_numpy(rows)[:, None].expand(case.total_q, case.num_q_heads).clone()


def _sequences_closed(case: Case, rows: np.ndarray) -> np.ndarray:
    """``rows`` widened to every row of a kernel sequence of several rows
    (:func:`kernel_sequences`) that holds a predicted one: the rows of a sequence share the
    tiles a kernel loads, and which share which is not modelled."""
    closed = rows.copy()
    for first, count in kernel_sequences(case):
        if count > 1 and rows[first: first + count].any():
            closed[first: first + count] = True
    return closed


def nan_before_window(inputs: RunInputs) -> torch.Tensor:
    """F28: a kernel that loads every token of a row before its sliding window and weights it
    by zero: the rows whose tokens before the window include a NaN slot."""
    case, rows = inputs.case, inputs.rows
    nan = _Canaries.of(case, rows)
    hit = np.array([any(nan.in_span(span) for span in before_window(case, row))
                    for row in rows], dtype=bool)
    return _as_heads(case, hit)


def nan_in_tile_before_window(inputs: RunInputs) -> torch.Tensor:
    """F22: a kernel that skips whole tiles before the sliding window but loads the tile
    holding the window's first token whole: the rows whose tile (of a page; in a batch with a
    sequence of several rows, also of :data:`UNIFIED_TILES` tokens) holds a NaN slot before
    the window; every row of a sequence that holds one."""
    case, rows = inputs.case, inputs.rows
    nan = _Canaries.of(case, rows)
    hit = np.zeros(case.total_q, dtype=bool)
    decode = all(count == 1 for _, count in kernel_sequences(case))
    sizes = (case.page_size,) if decode else (case.page_size, *UNIFIED_TILES)
    for n, row in enumerate(rows):
        first = window_start(row.context_len, case.sliding_window)
        tile = min(first - first % size for size in sizes)
        hit[n] = first > 0 and nan.between(row, tile, first)
    return _as_heads(case, _sequences_closed(case, hit))


def nan_past_context_in_page(inputs: RunInputs) -> torch.Tensor:
    """F24: a kernel that loads a row's last page whole: the rows whose last page holds a NaN
    slot past the row's context; every row of a sequence that holds one."""
    case, rows = inputs.case, inputs.rows
    nan = _Canaries.of(case, rows)
    hit = np.array([nan.in_span(last_page_past_context(case, row)) for row in rows],
                   dtype=bool)
    return _as_heads(case, _sequences_closed(case, hit))


def every_attending_row(inputs: RunInputs) -> torch.Tensor:
    """A bug in every tile a kernel reads (a lane mask, a misread block layout): every row
    that attends a token."""
    case, rows = inputs.case, inputs.rows
    return _as_heads(case, np.array([row.context_len > 0 for row in rows], dtype=bool))


def alibi_offset_beside_sinks(inputs: RunInputs) -> torch.Tensor:
    """F39: ALiBi offset from the context's end instead of the query position, which a sink
    does not forgive: every query row of a kernel sequence past its first."""
    case = inputs.case
    hit = np.zeros(case.total_q, dtype=bool)
    if case.alibi and case.sinks:
        for first, count in kernel_sequences(case):
            hit[first + 1: first + count] = True
    return _as_heads(case, hit)


def softcap_overflow(inputs: RunInputs) -> torch.Tensor:
    """F21: ``softcap * tanh(s / softcap)`` computed from ``exp(+-s / softcap)`` in float32,
    which is ``inf / inf`` once ``|s / softcap|`` passes 88.7: the rows and heads whose
    logits over the tokens they read (their window) reach :data:`SOFTCAP_OVERFLOW`."""
    case = inputs.case
    if not case.softcap:
        return torch.zeros((case.total_q, case.num_q_heads), dtype=torch.bool)
    return (largest_logits(inputs) >= SOFTCAP_OVERFLOW * case.softcap).cpu()


def largest_logits(inputs: RunInputs) -> torch.Tensor:
    """``[total_q, num_q_heads]`` float64: each row's and head's largest ``|s|`` (the scaled
    logit ``softmax_scale * q . k`` before any softcap) over the tokens it reads, 0 for a
    row that reads none; gathered like the reference, by chunks of rows."""
    case, data = inputs.case, inputs.data
    seg = data.segments
    out = torch.zeros((case.total_q, case.num_q_heads), dtype=torch.float64,
                      device=data.query.device)
    length = seg.width * case.block_size
    if length == 0:
        return out
    chunk = max(1, LOGIT_ELEMENTS // (length * case.num_kv_heads * case.head_dim))
    token = torch.arange(case.block_size, device=seg.slots.device)
    group = case.queries_per_kv
    scale = case.softmax_scale * case.k_scale
    for start in range(0, case.total_q, chunk):
        rows = slice(start, min(start + chunk, case.total_q))
        mask = (token >= seg.first[rows, :, None]) & (token < seg.tokens[rows, :, None])
        keys = data.k_stored[seg.slots[rows]].to(torch.float64)  # [n, width, B, nkv, D]
        keys = keys.flatten(1, 2)  # [n, L, nkv, D]
        for g in range(case.num_kv_heads):
            query = data.query[rows, g * group:(g + 1) * group].to(torch.float64)
            logits = torch.einsum("rhd,rld->rhl", query, keys[:, :, g]).abs() * scale
            logits = logits.masked_fill(~mask.flatten(1)[:, None, :], 0.0)
            out[rows, g * group:(g + 1) * group] = logits.amax(dim=-1)
    return out


Model = Callable[[RunInputs], torch.Tensor]
MODELS: dict[str, Model] = {
    "alibi_offset_beside_sinks": alibi_offset_beside_sinks,
    "every_attending_row": every_attending_row,
    "nan_before_window": nan_before_window,
    "nan_in_tile_before_window": nan_in_tile_before_window,
    "nan_past_context_in_page": nan_past_context_in_page,
    "softcap_overflow": softcap_overflow,
}
