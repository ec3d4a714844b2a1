"""Hypothesis strategies for MiniMax-M3 sparse decode cases.

Every structural choice is a Hypothesis draw: the number of requests, each request's length,
each physical block id of the block tables (an index into the blocks still free) and each
lane of the top-k selections (an index into the row's causal blocks still unpicked). So
Hypothesis shrinks a failing case toward fewer requests, shorter rows and the smallest ids
(tables ``0, 1, 2, ...``, selections ``0, 1, 2, ...``, one request, float16, no flags). Only
the tensor data comes from a drawn seed, through the counter-based generator of
:mod:`difftest.inputs.case_data`.

Draws are weighted toward where this family of bugs hides: the last physical block (page ids
up to ``(N-1)*16+7``, 2039 at 128 blocks) in a block every row attends, block 0, caches large
enough for page ids past 2**16 (always with their last block attended), tails of 1 and 127
tokens and exact multiples of 128, rows longer than top-k 16 x 128 tokens, empty selections,
several query tokens per request, softmax scales other than ``head_dim**-0.5``, fp8 scales
from 1e-3 (stored values at the fp8 maximum) to 1e2, and the kernel
modes (softcap, sliding window, NaN canaries) of :mod:`difftest.generation.modes` in one case in
two (:data:`KERNEL_MODES_ONE_IN`; enough that the default strategies find vLLM 0.30.0's
softcap NaN and 0.13.0's sliding-window NaN within 50 examples, docs/kernel-modes.md).

Given a ``cover`` (:class:`~difftest.generation.cover.Cover`), a drawn case takes some decisions
from it instead of drawing them (a kernel mode on with its boundary kind, the first request's
tail, top-k 16, ...); :mod:`difftest.generation.covering` schedules them so that the first
examples of every seed hold every mode and boundary class. A decision the strategy's limits
rule out (top-k 16 under ``max_topk=4``) is drawn as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from hypothesis import strategies as st

from difftest.case.spec import (
    BLOCK_SIZE,
    DISTRIBUTIONS,
    HEAD_DIM,
    KV_LAYOUTS,
    MAX_NUM_BLOCKS,
    Case,
    cdiv,
)
from difftest.generation.cover import FREE, Cover
from difftest.generation.modes import mode_flags, mode_plans, query_lengths
from difftest.primitives.dtypes import FP8_DTYPES, KV_DTYPES, QUERY_DTYPES

PAGE_IDS_PAST_2_16 = {"LBHNC": 4097, "LHBNC": 8193}  # smallest cache with a page id > 65536
SELECTION_MODES = ("indexer", "all", "tail-only", "empty-rows", "irregular")
MAX_FULL_BLOCKS = 20  # up to 21 blocks per request: rows longer than top-k 16 x 128 tokens
PREFILL_FULL_BLOCKS = 1  # a request of several query tokens: up to 2 blocks (256 tokens)
# ascending, so a shrink shortens the rows; 32 and 64 (rows past 2048 tokens) only where a
# caller raises max_topk past the model's 16 (the default draws are unchanged)
TOPKS = (1, 2, 3, 4, 8, 16, 32, 64)
Q_HEADS = (1, 8, 16, 64)
SOFTMAX_SCALES = (HEAD_DIM**-0.5, 1.0, 0.01, 0.5)  # the model's first: a shrink returns to it
KERNEL_MODES_ONE_IN = 2  # cases with softcap, sliding window and canaries drawn (modes.py)
DtypeCombo = tuple[str, str, str]  # (kv_layout, query_dtype, kv_dtype)
T = TypeVar("T")


def forced(value: T | None, drawn: T, allowed: Callable[[T], bool] = lambda _: True) -> T:
    """``value`` (a decision of a :class:`~difftest.generation.cover.Cover`) if it is set and
    ``allowed``, else the ``drawn`` one."""
    return value if value is not None and allowed(value) else drawn


def num_blocks(layout: str, max_blocks: int = MAX_NUM_BLOCKS) -> st.SearchStrategy[int]:
    """Cache sizes: the report's 128 blocks, small caches, and ones past page id 2**16; none
    above ``max_blocks`` (at least 1)."""
    big = PAGE_IDS_PAST_2_16[layout]
    ranges = ((128, 128), (1, 160), (512, 512), (big, big + 64))
    return st.one_of([st.integers(low, min(high, max_blocks)) for low, high in ranges
                      if low <= max_blocks])


def tails() -> st.SearchStrategy[int]:
    """Tokens in a request's last block: 128 (exact multiple), 1, 127 or anything between."""
    return st.one_of(st.just(BLOCK_SIZE), st.just(1), st.just(BLOCK_SIZE - 1),
                     st.integers(1, BLOCK_SIZE))


def fp8_scales() -> st.SearchStrategy[float]:
    """Log-uniform 1e-3..1e2 in tenths of a decade; shrinks toward 1.0."""
    return st.integers(-30, 20).map(lambda e: round(10.0 ** (e / 10), 12))


class FreeBlocks:
    """The physical blocks of a cache of ``n`` not yet in a block table, in ascending order.

    With ``favour_last``, the first block any request takes is the last one, ``n - 1``.
    """

    def __init__(self, n: int, favour_last: bool) -> None:
        self.ids = list(range(n - 1 if favour_last else n))
        self.last = n - 1 if favour_last else None
        self.requests = 0

    def __len__(self) -> int:
        return len(self.ids) + (self.last is not None)


@st.composite
def picks(draw: st.DrawFn, pool: Sequence[int], count: int) -> list[int]:
    """``count`` distinct items of ``pool``, each an index into the items still unpicked.

    Uniform in generation; a shrink moves every index to 0, i.e. toward ``pool``'s head.
    """
    free = list(pool)
    return [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(min(count, len(free)))]


@st.composite
def request(draw: st.DrawFn, free: FreeBlocks, decode_query_len: int, topk: int, mode: str,
            max_batch: int, prefill: bool = False, cover: Cover = FREE
            ) -> tuple[int, list[int], list[list[int]]]:
    """One request, drawn in one piece: ``(seq_len, block table, selection rows)``.

    Its length fits the blocks still free, keeping one for each request that may follow
    (up to ``max_batch``); 0 marks a padded request (about one in three, never the first; a
    shrink unpads it). Its table takes free blocks (the last block first where favoured); a shrink
    moves them toward 0, 1, 2, ...

    ``prefill``: the request draws its own query length (:func:`~difftest.generation.modes.
    query_lengths`, one row per query token); one of several tokens fits top-k and
    :data:`PREFILL_FULL_BLOCKS` full blocks, and every row selects its causal blocks in
    order (the rows then share one causal sequence).

    ``cover`` fixes the first request's query length, tail, a length past one block or past
    top-k 16 x 128 tokens, an empty first row, and the second request's padding.
    """
    r = free.requests
    free.requests += 1
    padded = r > 0 and (draw(st.integers(0, 2)) == 2 or (r == 1 and cover.padded))
    query_len = draw(query_lengths()) if prefill else decode_query_len
    if prefill and r == 0 and cover.query_len is not None:
        query_len = cover.query_len
    budget = len(free)
    share = max(1, budget - (max_batch - r - 1))
    # a prefill request fits top-k and at most PREFILL_FULL_BLOCKS full blocks: its rows each
    # attend up to the whole request, so a long one costs the interpreter minutes
    most = min(share - 1, MAX_FULL_BLOCKS,
               min(topk - 1, PREFILL_FULL_BLOCKS) if prefill and query_len > 1 else budget)
    least = 16 if cover.long else 1 if cover.several_blocks else 0
    full = draw(st.integers(least if r == 0 and most >= least else 0, max(most, 0)))
    tail = draw(tails())
    if r == 0 and cover.tail is not None:
        tail = cover.tail
    length = max(full * BLOCK_SIZE + tail, query_len)
    needed = cdiv(length, BLOCK_SIZE)
    if padded or needed > budget:
        return 0, [], [[-1] * topk for _ in range(1 if prefill else decode_query_len)]
    table = []
    for _ in range(needed):
        # drawn even for the favoured last block, so that unfavouring it keeps the draws
        # that follow in place and a shrink can reach block 0
        at = draw(st.integers(0, len(free.ids) - 1)) if free.ids else 0
        table.append(free.last if free.last is not None else free.ids.pop(at))
        free.last = None
    if prefill and query_len > 1 and needed <= topk:
        rows = [list(range(pos // BLOCK_SIZE + 1)) + [-1] * (topk - pos // BLOCK_SIZE - 1)
                for pos in range(length - query_len, length)]
    else:
        empty = r == 0 and cover.selection == "empty-rows"
        rows = [draw(selection_row(mode, topk, length - query_len + i, empty and i == 0))
                for i in range(query_len)]
    return length, table, rows


@st.composite
def with_block_zero(draw: st.DrawFn, tables: list[list[int]], skip_first: bool) -> None:
    """Put block 0 (vLLM's null block) at a drawn place of ``tables`` if it is in none;
    ``skip_first`` keeps the favoured last block at the first table's head."""
    slots = [(r, lb) for r, t in enumerate(tables) for lb in range(len(t))]
    if skip_first and slots:
        slots.pop(0)
    if slots and not any(0 in t for t in tables):
        r, lb = draw(st.sampled_from(slots))
        tables[r][lb] = 0


@st.composite
def selection_row(draw: st.DrawFn, mode: str, topk: int, abs_pos: int,
                  empty: bool = False) -> list[int]:
    """One query row's ``topk`` logical block ids (``-1`` padding) under ``mode``; ``empty``:
    none."""
    if abs_pos < 0 or empty or (mode == "empty-rows" and draw(st.booleans())):
        return [-1] * topk
    self_blk = abs_pos // BLOCK_SIZE
    count = min(topk, self_blk + 1)
    if mode == "tail-only":
        picked = [self_blk]
    elif mode == "all":
        picked = draw(picks(range(self_blk + 1), count))
    else:  # indexer: forced init block 0 and local block first, then drawn others
        forced = [0] + ([self_blk] if self_blk else [])
        others = range(1, self_blk)
        picked = (forced + draw(picks(others, max(0, count - len(forced)))))[:count]
    if mode == "irregular":
        picked = draw(irregular(picked, topk, self_blk))
    return (picked + [-1] * topk)[:topk]


@st.composite
def irregular(draw: st.DrawFn, picked: list[int], topk: int, self_blk: int) -> list[int]:
    """Duplicates, -1 holes and blocks past the causal limit, as a buggy indexer might emit."""
    row = list(picked)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("duplicate", "hole", "future")))
        at = draw(st.integers(0, len(row)))
        if kind == "duplicate" and row:
            row.insert(at, draw(st.sampled_from(row)))
        elif kind == "hole":
            row.insert(at, -1)
        else:
            row.insert(at, self_blk + draw(st.integers(1, 3)))
    return row[:topk]


def dtype_combos(layouts: Sequence[str] = KV_LAYOUTS,
                 query_dtypes: Sequence[str] = QUERY_DTYPES,
                 kv_dtypes: Sequence[str] = KV_DTYPES) -> tuple[DtypeCombo, ...]:
    """Every ``(kv_layout, query_dtype, kv_dtype)`` of the given axes, in their order."""
    return tuple((lay, q, kv) for lay in layouts for q in query_dtypes for kv in kv_dtypes)


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    query_dtypes: tuple[str, ...] = QUERY_DTYPES,
    kv_dtypes: tuple[str, ...] = KV_DTYPES,
    layouts: tuple[str, ...] = KV_LAYOUTS,
    selection_modes: tuple[str, ...] = SELECTION_MODES,
    max_batch: int = 4,
    max_topk: int = 16,
    max_blocks: int = MAX_NUM_BLOCKS,
    kernel_modes: bool = True,
    combos: Sequence[DtypeCombo] | None = None,
    accept: Callable[[Case], bool] | None = None,
    redraws: int = 4,
    cover: Cover = FREE,
) -> Case:
    """A valid case; restrict dtypes, layouts or selection modes to fit a backend, or the
    batch, top-k and cache size to keep a test cheap.

    ``kernel_modes``: one case in :data:`KERNEL_MODES_ONE_IN` draws the kernel modes (softcap,
    sliding window, NaN canaries, fp8 queries, prefill-like query lengths, split-K:
    :func:`difftest.generation.modes.mode_plans`, drawn first; a shrink switches them off).
    ``combos`` narrows the ``(kv_layout, query_dtype, kv_dtype)`` triples further (the ones
    the chosen backends support: :func:`difftest.generation.capabilities.cases_for`).
    ``accept`` rejects a drawn case, which is then drawn again, up to ``redraws`` more times
    (the last draw is returned whatever ``accept`` says). ``cover``: the decisions taken
    instead of drawn (a stratum of :data:`difftest.generation.covering.SCHEDULE`).
    """
    allowed = [c for c in dtype_combos(layouts, query_dtypes, kv_dtypes)
               if combos is None or c in combos]
    if not allowed:
        raise ValueError("cases: no (kv_layout, query_dtype, kv_dtype) is left: allowed "
                         f"layouts {layouts}, query dtypes {query_dtypes}, KV dtypes "
                         f"{kv_dtypes}, combos {tuple(combos or ())}")
    one_case = _case(allowed, selection_modes, max_batch, max_topk, max_blocks, kernel_modes,
                     cover)
    for _ in range(redraws if accept is not None else 0):
        case = draw(one_case)
        if accept is not None and accept(case):
            return case
    return draw(one_case)


@st.composite
def _case(draw: st.DrawFn, allowed: Sequence[DtypeCombo], selection_modes: tuple[str, ...],
          max_batch: int, max_topk: int, max_blocks: int, kernel_modes: bool,
          cover: Cover) -> Case:
    modes_forced = kernel_modes and cover.modes is not None
    # every on/off decision of the modes comes from one integer drawn first (see
    # modes.mode_plans); it shrinks to 0: modes off
    flags = draw(mode_flags(kernel_modes))
    plan = (draw(mode_plans(flags, cover)) if modes_forced or flags % KERNEL_MODES_ONE_IN == 1
            else None)
    kv_dtypes = FP8_DTYPES if cover.fixes_fp8(kernel_modes) else cover.kv_dtypes
    pool = [c for c in allowed if c[2] in kv_dtypes] or list(allowed)
    layout = draw(st.sampled_from(sorted({c[0] for c in pool}, key=KV_LAYOUTS.index)))
    q_dtype = draw(st.sampled_from([q for q in QUERY_DTYPES
                                    if any(c[:2] == (layout, q) for c in pool)]))
    kv_dtype = draw(st.sampled_from([kv for kv in KV_DTYPES if (layout, q_dtype, kv) in pool]))
    n = draw(num_blocks(layout, max_blocks))
    big = PAGE_IDS_PAST_2_16[layout]
    if cover.large_cache and big <= max_blocks:
        n = draw(st.integers(big, min(big + 64, max_blocks)))
    elif cover.long and max_blocks >= 128:
        n = max(n, 128)
    prefill = plan is not None and plan.prefill
    dql = 1 if prefill else draw(st.integers(1, 4))
    dql = forced(cover.decode_query_len, dql, lambda v: not prefill)
    topk = draw(st.sampled_from([t for t in TOPKS if t <= max_topk]))
    topk = forced(cover.topk, topk, lambda v: v in TOPKS and v <= max_topk)
    mode = draw(st.sampled_from(selection_modes))
    mode = forced(cover.selection, mode, lambda v: v in selection_modes)
    # A cache past page id 2**16 is only worth its size if a block past 2**16 is attended:
    # the last block goes where every row looks, logical block 0 of the first request (the
    # indexer's forced init block, full whenever the request is longer than one block); a
    # uniform draw from thousands of blocks almost never selects the few past page id 2**16.
    # (two in three smaller caches too; a shrink unfavours it)
    favour_last = (n >= big or draw(st.sampled_from((False, True, True)))
                   or cover.favour_last)
    free = FreeBlocks(n, favour_last)
    least = 2 if cover.padded and max_batch >= 2 else 1
    requests = draw(st.lists(request(free, dql, topk, mode, max_batch, prefill, cover),
                             min_size=least, max_size=max_batch))
    lens = [length for length, _, _ in requests]
    tables = [table for _, table, _ in requests]
    rows = [row for _, _, request_rows in requests for row in request_rows]
    if draw(st.booleans()) or cover.block_zero:
        draw(with_block_zero(tables, skip_first=favour_last))
    fp8 = kv_dtype in FP8_DTYPES
    k_scale = draw(fp8_scales()) if fp8 else 1.0
    v_scale = draw(fp8_scales()) if fp8 else 1.0
    if fp8 and cover.fp8_scales is not None:
        k_scale, v_scale = cover.fp8_scales
    heads = draw(st.sampled_from(Q_HEADS))
    softmax_scale = draw(st.sampled_from(SOFTMAX_SCALES))
    case = Case(
        num_blocks=n,
        seq_lens=tuple(lens),
        block_tables=tuple(tuple(t) for t in tables),
        selections=tuple(tuple(r) for r in rows),
        decode_query_len=dql,
        query_lens=tuple(len(q) for _, _, q in requests) if prefill else (),
        num_q_heads=heads,
        query_dtype=q_dtype,
        kv_dtype=kv_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=forced(cover.softmax_scale, softmax_scale),
        kv_layout=layout,
        distribution=draw(st.sampled_from(DISTRIBUTIONS)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    return plan.apply(case) if plan is not None else case
