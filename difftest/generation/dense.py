"""Hypothesis strategies for the dense family: paged attention at the geometry kernels serve.

Beside MiniMax-M3's sparse family (which keeps the model's geometry), a dense case attends
every block of each request (``Case.dense``: each row selects its causal blocks in order) and
draws the geometry where kernel bugs hide: cache blocks of 16, 32, 64 and 128 tokens and 48
(a multiple of 16 that is not a power of two, which vLLM accepts), head sizes 64, 80, 96, 128
and 256 (80 and 96 pad to powers of two inside the kernels), 1..8 KV heads with 1..16 query
heads per KV head, in vLLM's split K/V cache or the LHBNC planes (whose shuffled views are
AITER's 5-D caches) with one page per block, or MiniMax-M3's LBHNC cache of 16-token pages.
The kernel modes come from :mod:`difftest.generation.modes` (one case in two), prefill-like query
lengths as one causal sequence per request.

Sizes stay small for the interpreter (up to 3 requests of up to 384 tokens; a ``long``
stratum's first request has 513-640, for the 3-D kernels); ``huge``
(nightly) draws caches past 2**31 elements with the last block attended, so that a kernel's
int32 offset arithmetic is reached (docs/geometry.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from difftest.case.spec import DISTRIBUTIONS, HEAD_DIMS, MAX_KV_HEADS, MAX_Q_HEADS, Case, cdiv
from difftest.generation.cover import FREE, Cover
from difftest.generation.modes import mode_flags, mode_plans, query_lengths
from difftest.generation.strategies import KERNEL_MODES_ONE_IN, forced, fp8_scales, picks
from difftest.primitives.dtypes import FP8_DTYPES, KV_DTYPES, QUERY_DTYPES

BLOCK_SIZES = (16, 32, 64, 128, 48)  # the powers of two first: a shrink returns to 16
DENSE_LAYOUTS = ("split", "LHBNC", "LBHNC")  # vLLM's own first
MAX_GQA = 16
MAX_REQUEST_TOKENS = 384
# a "long" stratum's first request: past 512 tokens, where AITER's unified_attention takes
# its 3-D kernel (max_seqlen_k > 512) and vLLM's split-K meets longer rows
LONG_REQUEST_TOKENS = (513, 640)
MAX_BATCH = 3
MAX_PREFILL_QUERY = 17  # prefill-like requests: vLLM's 3-D bound (8) and BLOCK_Q (16) passed
DENSE_SHARE = 5  # difftest run draws one dense example per five sparse ones
SPARE_BLOCKS = 8  # blocks no request holds (NaN canaries a kernel must not read)
INT32_ELEMENTS = 1 << 31
DtypePair = tuple[str, str]  # (query_dtype, kv_dtype)


def dense_examples(examples: int) -> int:
    """How many dense examples ``difftest run --examples N`` draws beside its N sparse ones:
    one per :data:`DENSE_SHARE`."""
    return examples // DENSE_SHARE


def dtype_pairs(query_dtypes: Sequence[str] = QUERY_DTYPES,
                kv_dtypes: Sequence[str] = KV_DTYPES) -> tuple[DtypePair, ...]:
    """Every ``(query_dtype, kv_dtype)`` of the given axes."""
    return tuple((q, kv) for q in query_dtypes for kv in kv_dtypes)


@st.composite
def geometries(draw: st.DrawFn, min_kv_heads: int = 1,
               cover: Cover = FREE) -> dict[str, int | str]:
    """A cache geometry: layout, block and page sizes, head size, KV and query heads;
    ``cover`` (:class:`~difftest.generation.cover.Cover`) may fix each of them."""
    layout = forced(cover.dense_layout, draw(st.sampled_from(DENSE_LAYOUTS)),
                    lambda v: v in DENSE_LAYOUTS)
    block = forced(cover.block_size, draw(st.sampled_from(BLOCK_SIZES)),
                   lambda v: v in BLOCK_SIZES)
    head_dim = forced(cover.head_dim, draw(st.sampled_from(HEAD_DIMS)), lambda v: v in HEAD_DIMS)
    kv_heads = forced(cover.kv_heads, draw(st.integers(min_kv_heads, MAX_KV_HEADS)),
                      lambda v: min_kv_heads <= v <= MAX_KV_HEADS)
    most = min(MAX_GQA, MAX_Q_HEADS // kv_heads)
    group = forced(cover.gqa, draw(st.integers(1, most)), lambda v: 1 <= v <= most)
    return {"kv_layout": layout, "block_size": block,
            "page_size": 16 if layout == "LBHNC" else block, "head_dim": head_dim,
            "num_kv_heads": kv_heads, "num_q_heads": kv_heads * group}


def dense_rows(seq_len: int, query_len: int, block_size: int, topk: int) -> list[list[int]]:
    """The selection rows of a dense request: each row's causal blocks, then ``-1``."""
    if seq_len == 0:
        return [[-1] * topk for _ in range(query_len)]
    rows = []
    for pos in range(seq_len - query_len, seq_len):
        own = pos // block_size + 1
        rows.append(list(range(own)) + [-1] * (topk - own))
    return rows


def huge_blocks(geometry: dict[str, int | str]) -> int:
    """The fewest blocks whose cache passes 2**31 elements (so its last block's element
    offsets, and byte offsets, pass int32: 2 GiB of fp8, 4 GiB of 16-bit values)."""
    per_block = (2 * int(geometry["block_size"]) * int(geometry["num_kv_heads"])
                 * int(geometry["head_dim"]))
    return INT32_ELEMENTS // per_block + 2


@st.composite
def dense_cases(draw: st.DrawFn, *, pairs: Sequence[DtypePair] | None = None,
                kernel_modes: bool = True, huge: bool = False, cover: Cover = FREE) -> Case:
    """A dense case; ``pairs``: the ``(query_dtype, kv_dtype)`` drawn from (default: all);
    ``kernel_modes``: one case in :data:`~difftest.generation.strategies.KERNEL_MODES_ONE_IN`
    draws them; ``huge``: a cache past 2**31 elements whose last block is attended;
    ``cover``: the decisions taken instead of drawn (a stratum of the covering schedule)."""
    allowed = list(pairs) if pairs is not None else list(dtype_pairs())
    if not allowed:
        raise ValueError("dense_cases: no (query_dtype, kv_dtype) pair is allowed")
    modes_forced = kernel_modes and cover.modes is not None
    flags = draw(mode_flags(kernel_modes))
    plan = (draw(mode_plans(flags, cover)) if modes_forced or flags % KERNEL_MODES_ONE_IN == 1
            else None)
    # a huge cache of the smallest blocks needs two KV heads to stay within MAX_NUM_BLOCKS
    geometry = draw(geometries(min_kv_heads=2 if huge else 1, cover=cover))
    kv_dtypes = FP8_DTYPES if cover.fixes_fp8(kernel_modes) else cover.kv_dtypes
    query_dtype, kv_dtype = draw(st.sampled_from(
        [pair for pair in allowed if pair[1] in kv_dtypes] or allowed))
    block = int(geometry["block_size"])
    prefill = plan is not None and plan.prefill
    dql = 1 if prefill else draw(st.integers(1, 4))
    most_blocks = MAX_REQUEST_TOKENS // block
    requests = []
    for r in range(draw(st.integers(1, MAX_BATCH))):
        padded = r > 0 and draw(st.integers(0, 3)) == 3
        if r == 0 and cover.long:
            full, tail = divmod(draw(st.integers(*LONG_REQUEST_TOKENS)) - 1, block)
            tail += 1
        else:
            least = 1 if r == 0 and cover.several_blocks and most_blocks > 1 else 0
            full = draw(st.integers(least, most_blocks - 1))
            tail = draw(st.one_of(st.just(block), st.just(1), st.integers(1, block)))
        wanted = draw(query_lengths()) if prefill else dql
        if prefill and r == 0:
            wanted = forced(cover.query_len, wanted)
        query_len = min(wanted, MAX_PREFILL_QUERY, full * block + tail) if prefill else dql
        seq_len = 0 if padded else max(full * block + tail, query_len)
        requests.append((seq_len, query_len))
    needed = [cdiv(s, block) for s, _ in requests]
    if huge:
        num_blocks = huge_blocks(geometry) + draw(st.integers(0, SPARE_BLOCKS))
    else:
        num_blocks = sum(needed) + draw(st.integers(0, SPARE_BLOCKS))
    ids = draw(picks(range(num_blocks), sum(needed)))
    if ids and (huge or draw(st.booleans())):  # the last block first, where offsets peak
        if num_blocks - 1 in ids:
            ids.remove(num_blocks - 1)
        else:
            ids.pop()
        ids.insert(0, num_blocks - 1)
    tables, at = [], 0
    for count in needed:
        tables.append(tuple(ids[at:at + count]))
        at += count
    topk = max(max(needed), 1)
    rows = [row for (seq_len, query_len) in requests
            for row in dense_rows(seq_len, query_len, block, topk)]
    fp8 = kv_dtype in FP8_DTYPES
    head_dim = int(geometry["head_dim"])
    case = Case(
        num_blocks=num_blocks,
        seq_lens=tuple(s for s, _ in requests),
        block_tables=tuple(tables),
        selections=tuple(tuple(row) for row in rows),
        decode_query_len=dql,
        query_lens=tuple(q for _, q in requests) if prefill else (),
        query_dtype=query_dtype,
        kv_dtype=kv_dtype,
        k_scale=draw(fp8_scales()) if fp8 else 1.0,
        v_scale=draw(fp8_scales()) if fp8 else 1.0,
        softmax_scale=draw(st.sampled_from((head_dim**-0.5, 1.0, 0.01))),
        distribution=draw(st.sampled_from(DISTRIBUTIONS)),
        seed=draw(st.integers(0, 2**32 - 1)),
        dense=True,
        **geometry,  # type: ignore[arg-type]
    )
    return plan.apply(case) if plan is not None else case
