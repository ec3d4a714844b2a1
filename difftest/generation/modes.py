"""Hypothesis draws of the kernel modes where shipped bugs lived (softcap, sliding window,
canaries) and of ``unified_attention``'s other modes (fp8 queries, prefill-like query
lengths, the split-K 3-D path).

Each mode is drawn before a case's structure (:class:`ModePlan`, resolved against the case
once it is drawn), off first (so a shrink switches it off when the failure does not need
it), and otherwise biased toward its boundaries:

* ``softcap``: in three draws of five a cap small enough that ``|s / softcap|`` passes 88
  far (0.01 down to 0.002: ``exp`` overflows in float32 once the logit passes 0.88 down to
  0.18, which almost every row does: vLLM 0.30.0's NaN), else the values models ship (50,
  30) or any cap of the allowed range;
* ``sliding_window``: 1, a row's context length and its neighbours, windows that start one
  token after or before a 16- or 32-token tile boundary (so the tile a kernel loads holds
  slots outside the window: vLLM 0.13.0's NaN), and any window up to the longest context;
* ``canary``: NaN in every KV slot no row reads, in half the cases (in three of four that
  have a window, where the slots just before the window are the ones a kernel must not use);
* ``q_scale`` (fp8-KV cases): 1 (a missing descale hides), 1e-3 (queries saturate at the
  fp8 maximum), 1e-2, 10, 100 or log-uniform 1e-3..1e2;
* ``query_lens``: per request 1-4 (decode), 5, 8, 9 (vLLM's 3-D bound is 8), 16, 17
  (``BLOCK_Q`` with one query head), 127, 128 or any; prefill requests select their
  causal blocks in order, so they run as one causal sequence;
* split-K: 16 segments (vLLM's) or another power of two, with ``seq_threshold_3d`` at the
  case's query blocks (3-D), one below (2-D), vLLM's 128 or any.

The case strategy draws a :class:`ModePlan` first (:func:`mode_plans`) and applies it to the
finished case; ``draw(with_kernel_modes(case))`` or ``strategy.flatmap(with_kernel_modes)``
draws one for a given case.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from difftest.case.selection import build_rows, unified_query_blocks
from difftest.case.spec import MAX_QUERY_LEN, SOFTCAP_RANGE, Case
from difftest.generation.cover import FREE, Cover

MODEL_SOFTCAPS = (50.0, 30.0)  # largest first: a shrink keeps the mode mild
OVERFLOW_SOFTCAPS = (0.01, 0.005, 0.002)  # |s / softcap| > 88 once |s| > 0.88 .. 0.18
# the kind of cap, mild first (a shrink's target), overflowing in three draws of five
SOFTCAP_KINDS = ("model", "overflow", "overflow", "overflow", "any")
TILE_SIZES = (16, 32)


def window_edges(longest_context: int) -> list[int]:
    """Boundary windows for rows whose longest attended sequence is ``longest_context``
    tokens, ascending: 1, 2, the context and its neighbours, and windows that start one slot
    after or before a 16- or 32-token tile boundary of the longest row."""
    longest = max(longest_context, 1)
    edges = {1, 2, longest - 1, longest, longest + 1}
    edges |= {longest - tile * k - d for tile in TILE_SIZES for k in (1, 2) for d in (1, -1)}
    return sorted(w for w in edges if w >= 1)


def softcaps(kind: str | None = None) -> st.SearchStrategy[float]:
    """Softcaps: overflowing ones (:data:`OVERFLOW_SOFTCAPS`) in three draws of five, else a
    model's (50, 30) or any of :data:`~difftest.case.spec.SOFTCAP_RANGE`; shrinks toward 50.
    ``kind`` (``"model"``, ``"overflow"`` or ``"any"``) draws that kind only."""
    choices = {"model": st.sampled_from(MODEL_SOFTCAPS),
               "overflow": st.sampled_from(OVERFLOW_SOFTCAPS),
               "any": st.floats(*SOFTCAP_RANGE)}
    if kind is not None:
        return choices[kind]
    return st.sampled_from(SOFTCAP_KINDS).flatmap(choices.__getitem__)


# split-K thresholds relative to the case's query blocks (vLLM picks 3-D at or below it),
# chosen by the drawn number modulo 4 (a sampled_from here was mostly copied from other
# draws by Hypothesis's mutator: 60 cases drew only 2-D)
THRESHOLD_KINDS = ("at", "below", "vllm", "any")
VLLM_SEQ_THRESHOLD_3D = 128  # MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads, one KV head
QUERY_LENGTHS = (1, 2, 4, 5, 8, 9, 16, 17, 127, 128)  # decode, vLLM's 3-D bound 8, BLOCK_Q 16
FP8_Q_SCALES = (1.0, 0.01, 1e-3, 10.0, 100.0)  # 1e-3: queries saturate at the fp8 maximum


def q_scales() -> st.SearchStrategy[float]:
    """fp8 query scales: the boundaries of :data:`FP8_Q_SCALES` or log-uniform 1e-3..1e2."""
    return st.one_of(st.sampled_from(FP8_Q_SCALES),
                     st.integers(-30, 20).map(lambda e: round(10.0 ** (e / 10), 12)))


def query_lengths() -> st.SearchStrategy[int]:
    """Query tokens of a request with ``query_lens``: decode lengths 1-4, vLLM's 3-D bound
    (8), ``BLOCK_Q`` (16) and the 128 maximum with their neighbours, or any; shrinks to 1."""
    return st.one_of(st.sampled_from(QUERY_LENGTHS), st.integers(1, MAX_QUERY_LEN))


@dataclass(frozen=True)
class ModePlan:
    """The kernel modes of one case, drawn before its structure (see :func:`mode_plans`).

    ``window``: ``None`` (off), ``("edge", i)`` (the ``i``-th of :func:`window_edges`, cyclic),
    ``("inside", i)`` (the same among the edges shorter than the longest context, so some
    slot a row attends falls outside it) or ``("any", n)`` (``1 + n % longest``), resolved
    once the case's contexts are known.
    ``q_scale`` applies to fp8-KV cases only. ``prefill`` is read by the case strategy (each
    request draws its query length). ``split_k``: ``None`` or ``(segments, n)``, the
    threshold resolved against the case's query blocks by :data:`THRESHOLD_KINDS`
    ``[n % 4]``: exactly the blocks (3-D), one fewer (2-D), vLLM's 128, or ``n // 4``.
    """

    softcap: float = 0.0
    window: tuple[str, int] | None = None
    canary: bool = False
    q_scale: float = 0.0
    prefill: bool = False
    split_k: tuple[int, int] | None = None

    def apply(self, case: Case) -> Case:
        """``case`` with these modes (the window and threshold resolved against it)."""
        window = 0
        if self.window is not None:
            longest = max((row.context_len for row in build_rows(case)), default=0)
            kind, n = self.window
            edges = window_edges(longest)
            if kind == "inside":
                edges = [w for w in edges if w < longest] or [1]
            window = 1 + n % max(longest, 1) if kind == "any" else edges[n % len(edges)]
        segments = threshold = 0
        if self.split_k is not None:
            segments, n = self.split_k
            blocks = unified_query_blocks(case)
            kind = THRESHOLD_KINDS[n % len(THRESHOLD_KINDS)]
            threshold = {"at": blocks, "below": blocks - 1,
                         "vllm": VLLM_SEQ_THRESHOLD_3D}.get(kind, n // len(THRESHOLD_KINDS))
        return case.replace(softcap=self.softcap, sliding_window=window, canary=self.canary,
                            q_scale=self.q_scale if case.is_fp8 else 0.0,
                            split_k_segments=segments, seq_threshold_3d=max(threshold, 0))


MODE_BITS = 1 << 20  # the range of the one integer every on/off decision of a plan comes from
# bit 0: modes at all (one case in two); then one bit per mode, two for canaries and prefill
FLAG_SOFTCAP, FLAG_WINDOW, FLAG_CANARY, FLAG_Q_SCALE, FLAG_PREFILL, FLAG_SPLIT_K = (
    1, 2, 4, 16, 32, 128)
MODE_NAMES = ("softcap", "sliding_window", "canary", "q_scale", "query_lens",
              "split_k_segments")  # the case fields a plan sets


def mode_flags(kernel_modes: bool) -> st.SearchStrategy[int]:
    """The on/off decisions of a case's kernel modes, one integer drawn first in the case;
    0 (a shrink's target) is every mode off. Without ``kernel_modes``: always 0."""
    return st.integers(0, MODE_BITS - 1) if kernel_modes else st.just(0)


@st.composite
def mode_plans(draw: st.DrawFn, flags: int | None = None, cover: Cover = FREE) -> ModePlan:
    """The kernel modes whose bits ``flags`` sets (drawn here when ``None``): a softcap,
    a window (boundary-biased), canaries (three in four with a window, else half), fp8
    queries (on fp8-KV cases), prefill-like query lengths (a quarter), split-K scratch;
    each value drawn only for a mode that is on.

    ``cover`` (a stratum of the covering schedule) overrides ``flags``: ``modes`` names the
    modes on (:data:`MODE_NAMES`), ``softcap`` the kind of cap, ``window`` ``"inside"`` a
    boundary window shorter than the longest context, ``q_scale`` the query scale,
    ``threshold`` the split-K threshold's kind (:data:`THRESHOLD_KINDS`).

    Why one integer: Hypothesis's generator (6.170) copies draws between examples and spans
    of the same kind (its mutator) and extends early examples with their simplest choices,
    so on/off draws of their own were far from their odds. Measured over the first 50 cases
    of seeds 0-7 for ``triton-unified[vllm=0.13.0]``, modes asked for in one case in three:
    13% of cases had modes when drawn last, 28% with booleans drawn first, and the window
    with canaries from 0 to 13 cases of 50 (docs/kernel-modes.md has the numbers now).
    """
    if flags is None:
        flags = draw(st.integers(0, MODE_BITS - 1))
    on = flags >> 1
    window_on = bool(on & FLAG_WINDOW)
    chosen = {
        "softcap": bool(on & FLAG_SOFTCAP), "sliding_window": window_on,
        "canary": bool(on & (3 * FLAG_CANARY)) if window_on else bool(on & FLAG_CANARY),
        "q_scale": bool(on & FLAG_Q_SCALE),
        "query_lens": on & (3 * FLAG_PREFILL) == 3 * FLAG_PREFILL,
        "split_k_segments": bool(on & FLAG_SPLIT_K)}
    if cover.modes is not None:
        chosen = {name: name in cover.modes for name in MODE_NAMES}
    softcap = draw(softcaps(cover.softcap)) if chosen["softcap"] else 0.0
    window = None
    if chosen["sliding_window"]:
        if cover.window == "inside":
            window = draw(st.tuples(st.just("inside"), st.integers(0, 15)))
        else:
            window = draw(st.one_of(st.tuples(st.just("edge"), st.integers(0, 15)),
                                    st.tuples(st.just("any"), st.integers(0, 1 << 20))))
    q_scale = 0.0
    if chosen["q_scale"]:
        q_scale = cover.q_scale or draw(q_scales())
    split_k = None
    if chosen["split_k_segments"]:
        segments = draw(st.sampled_from((16, 1, 2, 4, 8, 32, 64)))
        n = draw(st.integers(0, 4 * 4096))
        if cover.threshold in THRESHOLD_KINDS:
            n += THRESHOLD_KINDS.index(cover.threshold) - n % len(THRESHOLD_KINDS)
        split_k = (segments, n)
    return ModePlan(softcap, window, chosen["canary"], q_scale, chosen["query_lens"], split_k)


@st.composite
def with_kernel_modes(draw: st.DrawFn, case: Case) -> Case:
    """``case`` with the kernel modes drawn (each may be off)."""
    return draw(mode_plans()).apply(case)
