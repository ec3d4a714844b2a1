"""The covering schedule: every kernel mode and boundary class of the case strategies in the
first examples of every seed.

:func:`difftest.generation.generate.generated_cases` draws example ``i < len(SCHEDULE)`` with
``cover=SCHEDULE[i]`` (a :class:`~difftest.generation.cover.Cover`): the stratum fixes a few
decisions, the strategy draws the rest; later examples are free draws. A stratum switches
one kernel mode on and every other off, so a disagreement it finds names its mode (vLLM
0.13.0 has both the softcap and the window NaN). :data:`CLASSES` says how to tell that a case
is in each class, so :func:`first_examples` measures what any case set holds
(tests/test_strategies.py prints the table over 20 seeds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from difftest.case.selection import (
    build_rows,
    kernel_sequences,
    selection_is_canonical,
    unified_query_blocks,
)
from difftest.case.spec import BLOCK_SIZE, HEAD_DIMS, MAX_KV_HEADS, Case
from difftest.generation.cover import Cover
from difftest.generation.dense import BLOCK_SIZES
from difftest.generation.modes import MODEL_SOFTCAPS, window_edges
from difftest.generation.strategies import PAGE_IDS_PAST_2_16

MAX_3D_QUERY_LEN = 8  # vLLM's bound on the query tokens of a sequence for the 3-D kernel
SATURATING_SCALE = 1e-3  # fp8 scales this small store values at the fp8 maximum

# The dense family (difftest.generation.dense, one example per five sparse ones) reads the
# fields it has: its first five examples take every block size and head size, the first three
# every layout, the fourth a request past 512 tokens, and the kernel modes of the first six.
SCHEDULE: tuple[Cover, ...] = (
    Cover(modes=("softcap",), softcap="overflow", favour_last=True, selection="indexer",
          tail=BLOCK_SIZE, topk=16,
          dense_layout="split", block_size=48, head_dim=80, kv_heads=8, gqa=2),
    # one row per request, over its own block: slots before its window are read by no row, so
    # they hold canaries; 16-bit KV: Triton's interpreter reads fp8 NaN bytes as finite values
    Cover(modes=("sliding_window", "canary"), window="inside", tail=BLOCK_SIZE - 1,
          selection="tail-only", kv_dtypes=("float16", "bfloat16"), several_blocks=True,
          decode_query_len=1,
          dense_layout="LHBNC", block_size=16, head_dim=256, kv_heads=1, gqa=16),
    Cover(modes=("q_scale",), q_scale=SATURATING_SCALE,
          fp8_scales=(SATURATING_SCALE, 100.0), block_zero=True, decode_query_len=2,
          dense_layout="LBHNC", block_size=128, head_dim=64),
    # dense: a request past 512 tokens at a padded head size (AITER's 3-D kernel)
    Cover(modes=("split_k_segments",), threshold="at", long=True, block_size=32, head_dim=96),
    Cover(modes=("query_lens",), query_len=MAX_3D_QUERY_LEN + 1, softmax_scale=1.0,
          block_size=64, head_dim=128),
    Cover(modes=("canary",), tail=1, selection="empty-rows"),
    Cover(modes=(), large_cache=True, selection="indexer"),
    Cover(modes=("softcap",), softcap="model", selection="irregular", topk=16,
          decode_query_len=4),
    Cover(modes=("split_k_segments",), threshold="below", tail=1, padded=True),
    Cover(modes=("query_lens",), query_len=17, topk=4),
)


@dataclass(frozen=True)
class CoverClass:
    """A kernel mode or boundary class, and the test of whether a case is in it."""

    name: str
    holds: Callable[[Case], bool]


def _attended(case: Case) -> set[int]:
    return {s.physical_block for row in build_rows(case) for s in row.segments}


def _longest_context(case: Case) -> int:
    return max((row.context_len for row in build_rows(case)), default=0)


def _split_k_path(case: Case) -> str:
    """``"3D"`` or ``"2D"``: which side of vLLM's split-K threshold the case is on."""
    longest = max(n for _, n in kernel_sequences(case))
    three_d = longest <= MAX_3D_QUERY_LEN and unified_query_blocks(case) <= case.seq_threshold_3d
    return "3D" if three_d else "2D"


SOFTCAP_OVERFLOW = CoverClass("softcap overflowing float32 (<= 0.01)",
                              lambda c: 0 < c.softcap <= 0.01)
SOFTCAP_MODEL = CoverClass("softcap of a model (30, 50)", lambda c: c.softcap in MODEL_SOFTCAPS)
WINDOW_CANARIES = CoverClass(
    "sliding window at a boundary inside the context, canaries",
    lambda c: c.canary and c.sliding_window in window_edges(_longest_context(c))
    and c.sliding_window < _longest_context(c))
CANARIES = CoverClass("canaries without a window", lambda c: c.canary and not c.sliding_window)
FP8_QUERIES = CoverClass("fp8 queries", lambda c: c.q_scale > 0)
FP8_QUERIES_SATURATING = CoverClass("fp8 queries saturating (q_scale 1e-3)",
                                    lambda c: c.q_scale == SATURATING_SCALE)
PREFILL_PAST_3D = CoverClass(
    "prefill-like rows past the 3-D bound (> 8)",
    lambda c: bool(c.query_lens) and max(n for _, n in kernel_sequences(c)) > 8)
PREFILL_PAST_BLOCK_Q = CoverClass(
    "prefill-like rows past BLOCK_Q (> 16)",
    lambda c: bool(c.query_lens) and max(n for _, n in kernel_sequences(c)) > 16)
SPLIT_K_3D = CoverClass("split-K, 3-D kernel",
                        lambda c: c.split_k_segments > 0 and _split_k_path(c) == "3D")
SPLIT_K_2D = CoverClass("split-K, 2-D kernel",
                        lambda c: c.split_k_segments > 0 and _split_k_path(c) == "2D")
MODE_CLASSES: tuple[CoverClass, ...] = (
    SOFTCAP_OVERFLOW, SOFTCAP_MODEL, WINDOW_CANARIES, CANARIES, FP8_QUERIES,
    FP8_QUERIES_SATURATING, PREFILL_PAST_3D, PREFILL_PAST_BLOCK_Q, SPLIT_K_3D, SPLIT_K_2D)
# the kernel-mode classes the dense family's first six examples hold
DENSE_MODE_CLASSES: tuple[CoverClass, ...] = (
    SOFTCAP_OVERFLOW, WINDOW_CANARIES, CANARIES, FP8_QUERIES, PREFILL_PAST_3D, SPLIT_K_3D)

CLASSES: tuple[CoverClass, ...] = (
    *MODE_CLASSES,
    CoverClass("last block heads the first table",
               lambda c: next(t for t in c.block_tables if t)[0] == c.num_blocks - 1),
    CoverClass("last block attended", lambda c: c.num_blocks - 1 in _attended(c)),
    CoverClass("page ids past 2**16 read",
               lambda c: c.num_blocks >= PAGE_IDS_PAST_2_16[c.kv_layout]
               and max(_attended(c), default=0) * c.block_page_stride > 65535),
    CoverClass("block 0 in a table", lambda c: any(0 in t for t in c.block_tables)),
    CoverClass("tail of 1 token", lambda c: any(s % BLOCK_SIZE == 1 for s in c.seq_lens)),
    CoverClass("tail of 127 tokens",
               lambda c: any(s % BLOCK_SIZE == BLOCK_SIZE - 1 for s in c.seq_lens)),
    CoverClass("exact multiple of 128",
               lambda c: any(s and s % BLOCK_SIZE == 0 for s in c.seq_lens)),
    CoverClass("longer than top-k 16 x 128 tokens",
               lambda c: max(c.seq_lens) > 16 * BLOCK_SIZE),
    CoverClass("several decode query tokens", lambda c: c.decode_query_len > 1),
    CoverClass("empty selection row", lambda c: any(not r.segments for r in build_rows(c))),
    CoverClass("irregular selection row", lambda c: not selection_is_canonical(c)),
    CoverClass("top-k 16", lambda c: c.topk == 16),
    CoverClass("softmax scale other than head_dim**-0.5",
               lambda c: c.softmax_scale != c.head_dim**-0.5),
    CoverClass("fp8 scale 1e-3 (values at the fp8 maximum)",
               lambda c: c.is_fp8 and min(c.k_scale, c.v_scale) <= SATURATING_SCALE),
    CoverClass("fp8 scale 1e2", lambda c: c.is_fp8 and max(c.k_scale, c.v_scale) >= 100.0),
    CoverClass("padded request", lambda c: 0 in c.seq_lens),
)


DENSE_CLASSES: tuple[CoverClass, ...] = (
    *(CoverClass(f"dense: {size}-token blocks", lambda c, size=size: c.block_size == size)
      for size in BLOCK_SIZES),
    *(CoverClass(f"dense: head size {size}", lambda c, size=size: c.head_dim == size)
      for size in HEAD_DIMS),
    CoverClass("dense: vLLM's split K/V cache", lambda c: c.kv_layout == "split"),
    CoverClass("dense: LHBNC planes", lambda c: c.kv_layout == "LHBNC"),
    CoverClass("dense: LBHNC of 16-token pages", lambda c: c.kv_layout == "LBHNC"),
    CoverClass("dense: 8 KV heads", lambda c: c.num_kv_heads == MAX_KV_HEADS),
    CoverClass("dense: 16 query heads per KV head",
               lambda c: c.num_q_heads == 16 * c.num_kv_heads),
    CoverClass("dense: a request past 512 tokens at head size 80 or 96",
               lambda c: c.head_dim in (80, 96) and max(c.seq_lens) > 512),
    *DENSE_MODE_CLASSES,
)


def first_examples(cases: Sequence[Case], classes: Sequence[CoverClass] = CLASSES
                   ) -> dict[str, int | None]:
    """Per class of ``classes``, the index of the first case in it (``None``: none)."""
    return {cls.name: next((i for i, case in enumerate(cases) if cls.holds(case)), None)
            for cls in classes}
