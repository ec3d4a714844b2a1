"""The decisions a drawn case takes instead of drawing them: one stratum of the covering schedule.

:mod:`difftest.generation.covering` schedules a :class:`Cover` per early example;
:func:`difftest.generation.generate.generated_cases` passes it to the case strategy as its
``cover`` parameter (:func:`difftest.generation.strategies.cases`,
:func:`difftest.generation.dense.dense_cases`), which hands the kernel-mode part to
:func:`difftest.generation.modes.mode_plans`. A field left at its default is drawn as usual,
and so is a decision the strategy's limits rule out (top-k 16 under ``max_topk=4``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cover:
    """One example's fixed decisions; every field at its default (:data:`FREE`) fixes none."""

    # the kernel modes (difftest.generation.modes.mode_plans)
    modes: tuple[str, ...] | None = None
    """The kernel modes on, every other one off (``modes.MODE_NAMES``: fields of
    ``Case.kernel_modes`` and ``"canary"``); ``()`` all off; ``None`` drawn."""
    softcap: str | None = None
    """The kind of softcap: ``"overflow"`` or ``"model"`` (``modes.softcaps``)."""
    window: str | None = None
    """``"inside"``: a window of ``modes.window_edges`` shorter than the longest context."""
    q_scale: float | None = None
    """The fp8 query scale."""
    threshold: str | None = None
    """The split-K threshold: ``"at"`` (3-D) or ``"below"`` (2-D) the query blocks."""

    # the structure of both families
    query_len: int | None = None
    """The query tokens of the first request (prefill-like rows)."""
    long: bool = False
    """The first request longer than top-k 16 x 128 tokens (dense: 513-640 tokens)."""
    several_blocks: bool = False
    """The first request longer than one block."""
    kv_dtypes: tuple[str, ...] = ()
    """The KV dtypes to draw from, where the strategy allows some of them."""
    fp8_scales: tuple[float, float] | None = None
    """``(k_scale, v_scale)`` of an fp8 cache (the KV dtype is then fp8)."""

    # the sparse family (difftest.generation.strategies.cases)
    large_cache: bool = False
    """A cache with page ids past 2**16, its last block attended."""
    favour_last: bool = False
    """The last physical block heads the first request's table."""
    tail: int | None = None
    """The tokens in the first request's last block."""
    decode_query_len: int | None = None
    """Query tokens per decode request (1-4)."""
    topk: int | None = None
    """The top-k."""
    selection: str | None = None
    """The selection mode (one of ``strategies.SELECTION_MODES``)."""
    softmax_scale: float | None = None
    """The softmax scale."""
    padded: bool = False
    """The second request is padded."""
    block_zero: bool = False
    """Block 0 sits in some table."""

    # the dense family's geometry (difftest.generation.dense.geometries)
    dense_layout: str | None = None
    """The cache layout (``dense.DENSE_LAYOUTS``)."""
    block_size: int | None = None
    """The block size (``dense.BLOCK_SIZES``)."""
    head_dim: int | None = None
    """The head size."""
    kv_heads: int | None = None
    """The KV heads."""
    gqa: int | None = None
    """The query heads per KV head."""

    def fixes_fp8(self, kernel_modes: bool) -> bool:
        """Whether these decisions need an fp8 cache: fp8 scales, or fp8 queries among the
        modes on (where the strategy draws kernel modes at all)."""
        return self.fp8_scales is not None or (
            kernel_modes and self.modes is not None and "q_scale" in self.modes)


FREE = Cover()  # no decision fixed: a free draw
