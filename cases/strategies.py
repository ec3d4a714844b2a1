"""Hypothesis strategies for MiniMax-M3 sparse decode cases.

Each strategy draws a few small numbers and a seed, then builds the data from the seed, so
Hypothesis shrinks toward small, readable cases (one request, seed 0, float16, no flags).
Draws are weighted toward where this family of bugs hides: the last physical block (page ids
up to ``(N-1)*16+7``, 2039 at 128 blocks) in a block every row attends, block 0, caches large
enough for page ids past 2**16 (always with their last block attended), tails of 1 and 127
tokens and exact multiples of 128, empty selections, several query tokens per request, and
fp8 scales from 1e-3 (stored values at the fp8 maximum) to 1e2.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from difftest.case import BLOCK_SIZE, DISTRIBUTIONS, KV_LAYOUTS, Case, cdiv
from difftest.dtypes import FP8_DTYPES, KV_DTYPES, QUERY_DTYPES

PAGE_IDS_PAST_2_16 = {"LBHNC": 4097, "LHBNC": 8193}  # smallest cache with a page id > 65536
SELECTION_MODES = ("indexer", "all", "tail-only", "empty-rows", "irregular")


def num_blocks(layout: str) -> st.SearchStrategy[int]:
    """Cache sizes: the report's 128 blocks, small caches, and ones past page id 2**16."""
    big = PAGE_IDS_PAST_2_16[layout]
    return st.one_of(
        st.just(128),
        st.integers(1, 160),
        st.just(512),
        st.integers(big, big + 64),
    )


def tails() -> st.SearchStrategy[int]:
    """Tokens in a request's last block: 128 (exact multiple), 1, 127 or anything between."""
    return st.one_of(st.just(BLOCK_SIZE), st.just(1), st.just(BLOCK_SIZE - 1),
                     st.integers(1, BLOCK_SIZE))


def fp8_scales() -> st.SearchStrategy[float]:
    """Log-uniform 1e-3..1e2 in tenths of a decade; shrinks toward 1.0."""
    return st.integers(-30, 20).map(lambda e: round(10.0 ** (e / 10), 12))


@st.composite
def seq_lens(draw: st.DrawFn, batch: int, decode_query_len: int, max_blocks: int) -> list[int]:
    """Per-request lengths whose blocks fit ``max_blocks``; 0 marks a padded request."""
    lens = []
    budget = max_blocks
    for r in range(batch):
        padded = r > 0 and draw(st.integers(0, 7)) == 0
        share = max(1, budget - (batch - r - 1))
        full = draw(st.integers(0, min(share - 1, 20)))
        length = full * BLOCK_SIZE + draw(tails())
        length = max(length, decode_query_len)
        if padded or cdiv(length, BLOCK_SIZE) > budget:
            lens.append(0)
            continue
        lens.append(length)
        budget -= cdiv(length, BLOCK_SIZE)
    return lens


def _block_tables(rng: random.Random, lens: list[int], n: int, favour_last: bool,
                  favour_first: bool) -> list[list[int]]:
    """Distinct physical blocks, uniformly drawn, then moved to the boundaries.

    ``favour_first`` puts block 0 (vLLM's null block) somewhere in the tables. ``favour_last``
    puts the last physical block where every row looks: logical block 0 of the first request
    (the indexer's forced init block, full whenever the request is longer than one block), so
    the highest page ids are really read; a uniform draw from thousands of blocks almost
    never selects the few past page id 2**16.
    """
    needed = [cdiv(s, BLOCK_SIZE) for s in lens]
    chosen = rng.sample(range(n), sum(needed))
    if chosen and favour_first and 0 not in chosen:
        chosen[rng.randrange(1, len(chosen)) if len(chosen) > 1 else 0] = 0
    if chosen and favour_last:
        if n - 1 in chosen:
            i = chosen.index(n - 1)
            chosen[0], chosen[i] = chosen[i], chosen[0]
        else:
            chosen[0] = n - 1
    tables, start = [], 0
    for count in needed:
        tables.append(chosen[start : start + count])
        start += count
    return tables


def _row(rng: random.Random, mode: str, topk: int, abs_pos: int) -> list[int]:
    if abs_pos < 0 or (mode == "empty-rows" and rng.random() < 0.5):
        return [-1] * topk
    self_blk = abs_pos // BLOCK_SIZE
    causal = list(range(self_blk + 1))
    if mode == "tail-only":
        picked = [self_blk]
    elif mode == "all":
        picked = rng.sample(causal, min(topk, len(causal)))
    else:  # indexer: forced init block 0 and local block first, then random others
        count = min(topk, len(causal))
        forced = [0] + ([self_blk] if self_blk else [])
        others = [b for b in causal if b not in forced]
        picked = (forced + rng.sample(others, max(0, count - len(forced))))[:count]
    if mode == "irregular":
        picked = _irregular(rng, picked, topk, self_blk)
    return (picked + [-1] * topk)[:topk]


def _irregular(rng: random.Random, picked: list[int], topk: int, self_blk: int) -> list[int]:
    """Duplicates, -1 holes and blocks past the causal limit, as a buggy indexer might emit."""
    row = list(picked)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("duplicate", "hole", "future"))
        if kind == "duplicate" and row:
            row.insert(rng.randrange(len(row) + 1), rng.choice(row))
        elif kind == "hole":
            row.insert(rng.randrange(len(row) + 1), -1)
        else:
            row.insert(rng.randrange(len(row) + 1), self_blk + rng.randint(1, 3))
    return row[:topk]


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
) -> Case:
    """A valid case; restrict dtypes, layouts or selection modes to fit a backend."""
    layout = draw(st.sampled_from(layouts))
    q_dtype = draw(st.sampled_from(query_dtypes))
    kv_dtype = draw(st.sampled_from(kv_dtypes))
    n = draw(num_blocks(layout))
    dql = draw(st.integers(1, 4))
    batch = draw(st.integers(1, max_batch))
    lens = draw(seq_lens(batch, dql, n))
    if all(s == 0 for s in lens):
        lens[0] = max(dql, 1)
    topk = draw(st.sampled_from([t for t in (16, 1, 2, 4, 8, 3) if t <= max_topk]))
    mode = draw(st.sampled_from(selection_modes))
    # A cache past page id 2**16 is only worth its size if a block past 2**16 is attended.
    favour_last = n >= PAGE_IDS_PAST_2_16[layout] or draw(st.booleans())
    favour_first = draw(st.booleans())
    layout_seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(layout_seed)
    tables = _block_tables(rng, lens, n, favour_last, favour_first)
    rows = []
    for s in lens:
        for i in range(dql):
            rows.append(_row(rng, mode, topk, s - dql + i if s else -1))
    fp8 = kv_dtype in FP8_DTYPES
    k_scale = draw(fp8_scales()) if fp8 else 1.0
    v_scale = draw(fp8_scales()) if fp8 else 1.0
    return Case(
        num_blocks=n,
        seq_lens=tuple(lens),
        block_tables=tuple(tuple(t) for t in tables),
        selections=tuple(tuple(r) for r in rows),
        decode_query_len=dql,
        num_q_heads=draw(st.sampled_from([16, 8, 1, 64])),
        query_dtype=q_dtype,
        kv_dtype=kv_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_layout=layout,
        distribution=draw(st.sampled_from(DISTRIBUTIONS)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
