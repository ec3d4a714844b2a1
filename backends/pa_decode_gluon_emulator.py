"""Pure-torch emulator of AITER's ``pa_decode_gluon`` for machines without AMD GPUs.

It has the interface of ``aiter.ops.triton.gluon.pa_decode_gluon`` (argument names, shapes,
dtypes, layouts and the launcher's assertion messages) and computes what the Gluon kernels
compute, in float32 on any torch device. The contract it follows is
``shared/reference/aiter-pa-decode-gluon.md``; section numbers (§) below refer to it.

What is emulated:

* The launcher's preconditions (§2) with AITER's messages, raised as ``AssertionError``, per
  named contract revision (:data:`REVISIONS`). The gluon-import and arch checks are skipped.
  ``aiter.dtypes.fp8`` follows the emulated arch: ``"gfx950"`` (default, MI350/MI355)
  -> ``float8_e4m3fn``; ``"gfx942"`` (MI300/MI325) -> ``float8_e4m3fnuz``. The v0.1.26
  equal-block-count assertion is placed right after the 5-D ``key_cache`` check (its source
  is not public; only its message and line are known from the bug report).
  ``get_recommended_splits`` uses the configured CU count (default 304, an MI300X; an MI355X
  has 256).
* Addressing (§4): K, V, the per-token scales, the block table, the context lengths, the
  query and the query scale are read through the tensors' storage with the strides AITER
  passes and the unit strides it assumes, so offset or strided views (a V view starting 8
  pages into K's buffer) read exactly the bytes the kernel reads. ``x`` comes from the
  quant mode (16 with KV scales, else 8) as in the kernel. Only block-table entries
  ``j < cdiv(L, bs)`` are read, and page 0 must be readable.
* Numerics (§3.1, head-1 and multi-head PS kernels): q and K/V cast to ``compute_type``
  (a bf16/fp16 query cast to fp8 is clamped to the fp8 maximum first, so it saturates
  instead of producing NaN); logits ``(q.k) * softmax_scale * q_scale * k_scale`` in float32;
  masked logits -3.4e38; online softmax over ``context_partition_size``-token tiles (the
  running maximum after each tile is reproduced, because the probabilities are rounded
  relative to it); probabilities
  rounded to ``compute_type`` before PV; V scales folded in per tensor or per token with the
  kernel's ``FP8_MAX / max_tile`` trick; ``out = acc / l`` with ``l == 0 -> 1``; sinks; the
  result rounded to OUTPUT_DTYPE (bf16 for fp8 compute, else ``compute_type``), then stored
  in ``output.dtype`` (AITER's store of a mismatched dtype is unverified).
* Partitions (§3.3, §3.4): with ``max_context_partition_num`` S <= 1 the call is one-shot and
  rows with context length 0 are left untouched; with S > 1 each slot covers
  ``[j*c, min(L, (j+1)*c))``, ``c = cdiv(L, S)`` (``ps=True``) or one 256-token tile
  (``ps=False``), the scratch tensors are filled in AITER's format and the C++/FlyDSL PS
  reduce is emulated (an all-empty row gives 0).

Hazards where AITER gives silent garbage and the emulator raises ``ValueError`` instead:
fp8 K (or a 5-D fp8 V) without ``key_scale``/``value_scale`` (the kernel then assumes
``x = 8`` and misreads the ``x = 16`` layout; pass ``torch.ones(1)`` scales), reads outside
a tensor's storage, negative page ids, an ``output`` that cannot be reshaped as a view,
``ps=False`` with too few partitions, and scratch tensors of the wrong shape or strides.

Not emulated: the sliding-window partition schedule (any split gives the same result), the
split schedule of blocks larger than 256 tokens, the large-block non-PS kernel's
pre-scaling of fp8 probabilities by FP8_MAX (per-tensor scales), NaN/Inf propagation from
masked slots (AITER multiplies them by p = 0; the emulator drops them), the tile average
AITER returns for a row that sees no key although L > 0 (the emulator returns 0), and the
Triton PS-reduce fallback (NaN for empty rows).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

ARCH_FP8: dict[str, torch.dtype] = {
    "gfx942": torch.float8_e4m3fnuz,
    "gfx950": torch.float8_e4m3fn,
}
DEFAULT_ARCH = "gfx950"
DEFAULT_NUM_CUS = 304

LOG2E = 1.4426950408889634
MASKED_LOGIT = -3.4e38
_TILE_SIZES = (128, 256)
# Work per sequence chunk: bounds the float32 temporaries to about 64 MiB each.
_CHUNK_ELEMENTS = 1 << 24
_FAKE_MODULES = (
    "aiter",
    "aiter.dtypes",
    "aiter.ops",
    "aiter.ops.triton",
    "aiter.ops.triton.gluon",
    "aiter.ops.triton.gluon.pa_decode_gluon",
)


@dataclass(frozen=True)
class ContractRevision:
    """One version of the launcher's precondition set."""

    name: str
    aiter_versions: str
    asserts_equal_blocks: bool
    description: str


REVISIONS: dict[str, ContractRevision] = {
    rev.name: rev
    for rev in (
        ContractRevision(
            name="v0.1.20",
            aiter_versions="v0.1.14 ... v0.1.20.post1 (public ROCm/aiter tags, current signature)",
            asserts_equal_blocks=False,
            description=(
                "Public source: checks the KV scale shapes but never compares the K and V "
                "page counts; V is addressed only through its data pointer and strides."
            ),
        ),
        ContractRevision(
            name="v0.1.26",
            aiter_versions="0.1.26 (ROCm vLLM MiniMax-M3.1 image; source not public)",
            asserts_equal_blocks=True,
            description=(
                "The build in the bug report's traceback: additionally asserts "
                "key_cache.shape[0] == value_cache.shape[0], which rejects the packed LBHNC "
                "views (V starts 8 pages into K's buffer)."
            ),
        ),
    )
}
DEFAULT_REVISION = "v0.1.26"


def resolve_revision(revision: str | ContractRevision) -> ContractRevision:
    """The registered revision called ``revision`` (a revision object is returned as is)."""
    if isinstance(revision, ContractRevision):
        return revision
    if revision not in REVISIONS:
        raise ValueError(
            f"unknown pa_decode_gluon contract revision {revision!r}; known: {', '.join(REVISIONS)}"
        )
    return REVISIONS[revision]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"pa_decode_gluon emulator: {message}")


def _aiter_assert(condition: bool, message: str) -> None:
    """Raise AITER's own ``AssertionError`` with its message (kept under ``python -O``
    and untouched by pytest's assertion rewriting)."""
    if not condition:
        raise AssertionError(message)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` rounded to ``dtype`` (fp8 saturates at its maximum), returned as float32."""
    if values.dtype == dtype:
        return values.float()
    values = values.float()
    if _is_fp8(dtype):
        limit = torch.finfo(dtype).max
        values = values.clamp(-limit, limit)
    return values.to(dtype).float()


def _strided(
    tensor: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], what: str
) -> torch.Tensor:
    """``tensor``'s storage read with the kernel's ``size``/``stride`` from its data pointer."""
    try:
        return tensor.as_strided(size, stride, tensor.storage_offset())
    except RuntimeError as exc:
        raise ValueError(
            f"pa_decode_gluon emulator: AITER would read {what} outside its storage "
            f"(size {list(size)}, stride {list(stride)}): {exc}"
        ) from exc


@dataclass(frozen=True)
class _Launch:
    """Everything the kernel emulation needs, decoded from the arguments."""

    batch: int
    qlen: int
    kv_heads: int
    group: int
    head_size: int
    block_size: int
    compute_type: torch.dtype
    output_dtype: torch.dtype
    output: torch.Tensor  # [B, qlen, Hkv, G, D] view of the caller's output
    query: torch.Tensor  # [B, Hkv, E, D] raw
    query_scale: torch.Tensor | None  # [B, Hkv, E, 1] or 0-d, float32
    context: torch.Tensor  # [B] int64, >= 0
    max_context: int
    pages: torch.Tensor  # [B, W] int64, 0 beyond cdiv(L, bs)
    key: torch.Tensor  # [P, Hkv, D//x, bs, x] view
    value: torch.Tensor  # [P, Hkv, D, bs] or [P, Hkv, bs//x, D, x] view
    value_transposed: bool
    kv_quant_mode: int
    key_scale: torch.Tensor | None  # [P, Hkv, bs] view or 0-d, float32
    value_scale: torch.Tensor | None
    fp8_max: float
    sinks: torch.Tensor | None  # [Hkv, E] float32
    sliding_window: int
    partitions: int
    tile: int
    ps: bool


@dataclass(frozen=True)
class GluonEmulator:
    """An emulated AITER build: a contract revision, an arch (fp8 flavour) and a CU count."""

    revision: ContractRevision
    arch: str = DEFAULT_ARCH
    num_cus: int = DEFAULT_NUM_CUS

    def __post_init__(self) -> None:
        if self.arch not in ARCH_FP8:
            raise ValueError(f"unknown arch {self.arch!r}; known: {', '.join(ARCH_FP8)}")
        if self.num_cus < 1:
            raise ValueError(f"num_cus must be positive, got {self.num_cus}")

    @property
    def fp8(self) -> torch.dtype:
        """``aiter.dtypes.fp8`` of the emulated arch."""
        return ARCH_FP8[self.arch]

    def get_recommended_splits(
        self, num_sequences: int, num_kv_heads: int, split_kv_blocks: int = 1
    ) -> int:
        """AITER's split recommendation, with this emulator's CU count."""
        denominator = num_sequences * num_kv_heads * split_kv_blocks
        return min(8, _cdiv(2 * self.num_cus, denominator) * split_kv_blocks)

    def pa_decode_gluon(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        context_lengths: torch.Tensor,
        block_tables: torch.Tensor,
        softmax_scale: float,
        query_length: int,
        max_context_partition_num: int,
        context_partition_size: int = 256,
        compute_type: torch.dtype = torch.bfloat16,
        query_scale: torch.Tensor | None = None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
        exp_sums: torch.Tensor | None = None,
        max_logits: torch.Tensor | None = None,
        temporary_output: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        sliding_window: int = 0,
        ps: bool = True,
    ) -> None:
        """Emulate ``pa_decode_gluon``: write the attention result into ``output`` in place.

        Same arguments as AITER (§1). ``alibi_slopes`` is accepted and ignored, as in AITER.
        ``sliding_window <= 0`` means no window. Precondition failures raise AITER's
        ``AssertionError``/``RuntimeError``; inputs on which AITER silently returns garbage
        raise ``ValueError`` (see the module docstring).
        """
        del alibi_slopes  # AITER never forwards it to a kernel
        launch = self._decode(
            output,
            query,
            key_cache,
            value_cache,
            context_lengths,
            block_tables,
            query_length,
            max_context_partition_num,
            context_partition_size,
            compute_type,
            query_scale,
            key_scale,
            value_scale,
            sinks,
            sliding_window,
            ps,
        )
        scratch = None
        if launch.partitions > 1:
            scratch = self._scratch(launch, query, exp_sums, max_logits, temporary_output)
        # Sequence chunks bound the temporaries (K/V and logits of every token of a chunk).
        per_token = launch.kv_heads * (launch.head_size + launch.qlen * launch.group)
        lengths = [max(length, 1) for length in launch.context.tolist()]
        start, longest = 0, 1
        for stop in range(1, launch.batch + 1):
            longest = max(longest, lengths[stop - 1])
            if (
                stop == launch.batch
                or (stop + 1 - start) * max(longest, lengths[stop]) * per_token > _CHUNK_ELEMENTS
            ):
                _run_chunk(launch, float(softmax_scale), start, stop, scratch)
                start, longest = stop, 1

    def _decode(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        context_lengths: torch.Tensor,
        block_tables: torch.Tensor,
        query_length: int,
        partitions: int,
        context_partition_size: int,
        compute_type: torch.dtype,
        query_scale: torch.Tensor | None,
        key_scale: torch.Tensor | None,
        value_scale: torch.Tensor | None,
        sinks: torch.Tensor | None,
        sliding_window: int,
        ps: bool,
    ) -> _Launch:
        fp8, bf16, fp16, fp32 = self.fp8, torch.bfloat16, torch.float16, torch.float32
        # Dimensions are read before any check, as in AITER.
        num_query_heads = query.shape[1]
        head_size = query.shape[-1]
        batch = query.shape[0] // query_length
        kv_heads = key_cache.shape[1]
        group = num_query_heads // kv_heads
        equivalent_group = query_length * group
        block_size = key_cache.shape[-2]

        _aiter_assert(query_length <= 4, f"query_length == {query_length} exceeds maximum of 4")
        _aiter_assert(
            query.dtype in [fp8, bf16, fp16],
            f"query tensor only support dtype in [{fp8, bf16, fp16}], "
            f"but got query.dtype == {query.dtype}",
        )
        _aiter_assert(
            key_cache.dtype in [fp8, bf16, fp16],
            f"key_cache tensor only support dtype in [{fp8, bf16, fp16}], "
            f"but got key_cache.dtype == {key_cache.dtype}",
        )
        _aiter_assert(
            value_cache.dtype in [fp8, bf16, fp16],
            f"value_cache tensor only support dtype in [{fp8, bf16, fp16}], "
            f"but got value_cache.dtype == {value_cache.dtype}",
        )
        _aiter_assert(
            output.dtype in [bf16, fp16],
            f"output tensor only support dtype in [{bf16, fp16}], "
            f"but got output.dtype == {output.dtype}",
        )
        _aiter_assert(
            equivalent_group <= 64,
            f"equivalent_query_group_size={equivalent_group} exceeds maximum of 64",
        )
        _aiter_assert(
            len(output.shape) == 3, f"Expected 3D output tensor, but got shape {output.shape}"
        )
        _aiter_assert(
            len(query.shape) == 3, f"Expected 3D query tensor, but got shape {query.shape}"
        )
        _aiter_assert(
            len(key_cache.shape) == 5,
            f"Expected 5D key_cache tensor, but got shape {key_cache.shape}",
        )
        if self.revision.asserts_equal_blocks:
            _aiter_assert(
                key_cache.shape[0] == value_cache.shape[0],
                "key/value caches must have the same number of blocks, but got "
                f"key={key_cache.shape}, value={value_cache.shape}",
            )

        query_quant_mode = -1
        if query_scale is not None:
            _aiter_assert(
                isinstance(query_scale, torch.Tensor) and query_scale.dtype == fp32,
                f"query_scale tensor only support dtype == {fp32}, "
                f"but got query_scale.dtype == {query_scale.dtype}",
            )
            query_quant_mode = 0
            if query_scale.numel() != 1:
                _aiter_assert(
                    len(query_scale.shape) == 3,
                    f"Expected 3D query_scale tensor, but got shape {query_scale.shape}",
                )
                _aiter_assert(
                    query_scale.shape[-1] == 1,
                    "Expected query_scale.shape[-1] == 1, "
                    f"but got query_scale.shape[-1]={query_scale.shape[-1]}",
                )
                query_quant_mode = 1

        kv_quant_mode = -1
        if key_scale is not None and value_scale is not None and key_cache.dtype == fp8:
            _aiter_assert(
                isinstance(key_scale, torch.Tensor) and key_scale.dtype == fp32,
                f"key_scale tensor only support dtype == {fp32}, "
                f"but got key_scale.dtype == {key_scale.dtype}",
            )
            _aiter_assert(
                isinstance(value_scale, torch.Tensor) and value_scale.dtype == fp32,
                f"value_scale tensor only support dtype == {fp32}, "
                f"but got value_scale.dtype == {value_scale.dtype}",
            )
            kv_quant_mode = 0
            if key_scale.numel() != 1:
                _aiter_assert(
                    len(key_scale.shape) == 4,
                    f"Expected 4D key_scale tensor, but got shape {key_scale.shape}",
                )
                _aiter_assert(
                    key_scale.shape[-1] == 1,
                    "Expected key_scale.shape[-1] == 1, "
                    f"but got key_scale.shape[-1]={key_scale.shape[-1]}",
                )
                kv_quant_mode = 1
            _aiter_assert(
                key_scale.shape == value_scale.shape,
                "Key and value scales must have same shape, but got "
                f"key: {key_scale.shape}, value: {value_scale.shape}",
            )

        if len(value_cache.shape) not in (4, 5):
            raise RuntimeError(f"Unsupported value cache shape: {value_cache.shape}")
        value_transposed = len(value_cache.shape) == 5

        # Implicit in AITER: these reshapes fail unless Hq == Hkv * G and qlen | rows.
        query5 = query.reshape(batch, query_length, kv_heads, group, head_size)
        output5 = output.reshape(batch, query_length, kv_heads, group, head_size)

        # Past AITER's checks: what the emulator needs, or refuses to fake.
        if not isinstance(compute_type, torch.dtype):
            raise KeyError(compute_type)  # AITER's torch_to_triton_dtype lookup
        _aiter_assert(
            compute_type in (fp8, bf16, fp16),
            f"compute_type must be one of {fp8, bf16, fp16} on {self.arch}, got {compute_type}",
        )
        _aiter_assert(
            partitions >= 1,
            "max_context_partition_num must be >= 1 (AITER launches an empty grid)",
        )
        _aiter_assert(
            context_partition_size in _TILE_SIZES,
            f"context_partition_size must be one of {_TILE_SIZES} (AITER defines layouts "
            f"only for these), got {context_partition_size}",
        )
        _require(
            output5.data_ptr() == output.data_ptr() and output.stride(-1) == 1,
            "output must reshape to [B, qlen, Hkv, G, D] as a view with unit last stride; "
            "AITER would write into a temporary copy or the wrong elements",
        )
        x = 16 if kv_quant_mode >= 0 else 8
        _check_16b_elements(key_cache, x, kv_quant_mode, "key_cache")
        if value_transposed:
            _check_16b_elements(value_cache, x, kv_quant_mode, "value_cache")

        context = _strided(context_lengths, (batch,), (1,), "context_lengths")
        context = context.to(torch.int64).clamp(min=0)
        max_context = int(context.max()) if batch else 0
        width = max(1, _cdiv(max_context, block_size))
        # Entry j of row b sits at b * stride(0) + j; only entries j < cdiv(L, bs) are read.
        table_device = block_tables.device
        blocks = _cdiv_tensor(context, block_size).to(table_device)
        entries = torch.arange(width, device=table_device)
        used = entries < blocks[:, None]
        offsets = torch.arange(batch, device=table_device)[:, None] * block_tables.stride(0)
        offsets = torch.where(used, offsets + entries, 0)
        available = block_tables.untyped_storage().nbytes() // block_tables.element_size()
        flat = _strided(
            block_tables, (available - block_tables.storage_offset(),), (1,), "block_tables"
        )
        _require(
            offsets.numel() == 0 or int(offsets.max()) < flat.numel(),
            "a used block-table entry lies outside block_tables' storage",
        )
        pages = torch.where(used, flat[offsets].to(torch.int64), 0)
        _require(bool((pages >= 0).all()), "negative page id in a used block-table entry")
        num_pages = int(pages.max()) + 1 if pages.numel() else 1

        ks0, ks1, ks2, ks3 = key_cache.stride()[:4]
        key = _strided(
            key_cache,
            (num_pages, kv_heads, _cdiv(head_size, x), block_size, x),
            (ks0, ks1, ks2, ks3, 1),
            "key_cache",
        )
        vs0, vs1, vs2 = value_cache.stride()[:3]
        if value_transposed:
            value = _strided(
                value_cache,
                (num_pages, kv_heads, _cdiv(block_size, x), head_size, x),
                (vs0, vs1, vs2, x, 1),
                "value_cache",
            )
        else:
            value = _strided(
                value_cache,
                (num_pages, kv_heads, head_size, block_size),
                (vs0, vs1, vs2, 1),
                "value_cache",
            )

        key_scale_arg = value_scale_arg = None
        if kv_quant_mode == 0:
            key_scale_arg = key_scale.reshape(-1)[0].float()
            value_scale_arg = value_scale.reshape(-1)[0].float()
        elif kv_quant_mode == 1:
            size, stride = (num_pages, kv_heads, block_size), (*key_scale.stride()[:2], 1)
            key_scale_arg = _strided(key_scale, size, stride, "key_scale")
            # The kernel indexes value_scale with key_scale's strides (§5).
            value_scale_arg = _strided(value_scale, size, stride, "value_scale")

        query_scale_arg = None
        if query_quant_mode == 0:
            query_scale_arg = query_scale.reshape(-1)[0].float()
        elif query_quant_mode == 1:
            scale5 = query_scale.reshape(batch, query_length, kv_heads, group, 1)
            scale4 = _strided(
                scale5,
                (batch, query_length, kv_heads, group),
                (*scale5.stride()[:3], 1),
                "query_scale",
            )
            query_scale_arg = _rows(scale4).float()[..., None]

        query4 = _strided(query5, tuple(query5.shape), (*query5.stride()[:4], 1), "query")
        sink_rows = None
        if sinks is not None:
            heads = torch.arange(kv_heads, device=sinks.device)[:, None] * group
            heads = heads + torch.arange(equivalent_group, device=sinks.device) % group
            sink_rows = sinks.float()[heads]
        one_shot = partitions <= 1
        return _Launch(
            batch=batch,
            qlen=query_length,
            kv_heads=kv_heads,
            group=group,
            head_size=head_size,
            block_size=block_size,
            compute_type=compute_type,
            output_dtype=bf16 if _is_fp8(compute_type) else compute_type,
            output=output5,
            query=_rows(query4),
            query_scale=query_scale_arg,
            context=context,
            max_context=max_context,
            pages=pages,
            key=key,
            value=value,
            value_transposed=value_transposed,
            kv_quant_mode=kv_quant_mode,
            key_scale=key_scale_arg,
            value_scale=value_scale_arg,
            fp8_max=float(torch.finfo(fp8).max) if value_cache.dtype == fp8 else 1.0,
            sinks=sink_rows,
            sliding_window=max(0, int(sliding_window)),
            partitions=1 if one_shot else partitions,
            tile=context_partition_size,
            ps=ps or one_shot,
        )

    def _scratch(
        self,
        launch: _Launch,
        query: torch.Tensor,
        exp_sums: torch.Tensor | None,
        max_logits: torch.Tensor | None,
        temporary_output: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The partition scratch, allocated as AITER does when not given (§1, §9.3)."""
        shape = (launch.batch, launch.kv_heads, launch.partitions, launch.qlen * launch.group)
        device = query.device
        if exp_sums is None:
            exp_sums = torch.empty(shape, dtype=torch.float32, device=device)
        if max_logits is None:
            max_logits = torch.empty(shape, dtype=torch.float32, device=device)
        if temporary_output is None:
            temporary_output = torch.empty(
                (*shape, launch.head_size), dtype=query.dtype, device=device
            )
        _require(
            tuple(exp_sums.shape) == shape and tuple(max_logits.shape) == shape,
            f"exp_sums/max_logits must have shape {list(shape)}",
        )
        _require(
            exp_sums.stride() == max_logits.stride(),
            "exp_sums and max_logits must have equal strides (AITER passes only exp_sums')",
        )
        _require(
            tuple(temporary_output.shape) == (*shape, launch.head_size)
            and temporary_output.stride(-1) == 1,
            f"temporary_output must have shape {[*shape, launch.head_size]} and unit last stride",
        )
        if not launch.ps:
            tokens = launch.partitions * launch.tile
            _require(
                launch.max_context <= tokens,
                f"ps=False covers only {tokens} tokens with max_context_partition_num="
                f"{launch.partitions}; AITER drops the rest and reduces unwritten scratch",
            )
        return exp_sums, max_logits, temporary_output


def _cdiv_tensor(values: torch.Tensor, divisor: int) -> torch.Tensor:
    return torch.div(values + divisor - 1, divisor, rounding_mode="floor")


def _rows(tensor5: torch.Tensor) -> torch.Tensor:
    """[B, qlen, Hkv, G, ...] -> [B, Hkv, qlen*G, ...] (row e = i*G + g)."""
    b, qlen, hkv, g = tensor5.shape[:4]
    return tensor5.transpose(1, 2).reshape(b, hkv, qlen * g, *tensor5.shape[4:])


def _check_16b_elements(cache: torch.Tensor, x: int, kv_quant_mode: int, name: str) -> None:
    """Refuse caches whose 16-byte groups the kernel would misread (§4, §9.1)."""
    if 16 // cache.element_size() == x:
        return
    if kv_quant_mode < 0:
        raise ValueError(
            f"pa_decode_gluon emulator: {name} is {cache.dtype} but key_scale/value_scale are "
            "missing (or key_cache is not fp8), so AITER's kernel assumes 8 elements per 16 "
            "bytes and misreads the x=16 fp8 layout, returning silent garbage; pass fp32 "
            "scales (torch.ones(1) if there are none)"
        )
    raise ValueError(
        f"pa_decode_gluon emulator: {name} is {cache.dtype} but KV scales are active, so "
        "AITER's kernel reads it with 16 elements per 16 bytes and returns garbage"
    )


def _run_chunk(
    launch: _Launch,
    softmax_scale: float,
    start: int,
    stop: int,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """Emulate sequences ``[start, stop)``: kernel, scratch stores and PS reduce."""
    device = launch.query.device
    n, hkv, qlen, group = stop - start, launch.kv_heads, launch.qlen, launch.group
    rows, d, tile, num_parts = qlen * group, launch.head_size, launch.tile, launch.partitions
    context = launch.context[start:stop].to(device)

    # Token positions in partition layout [n, S, C]: slot s covers [s*c, min(L, (s+1)*c)).
    if num_parts == 1:
        span = context
    elif launch.ps:
        span = _cdiv_tensor(context, num_parts)
    else:
        span = torch.full_like(context, tile)
    width = max(1, int(span.max()))
    cols = torch.arange(width, device=device)
    part_start = torch.arange(num_parts, device=device)[None, :] * span[:, None]  # [n, S]
    pos = part_start[:, :, None] + cols  # [n, S, C]
    in_part = (cols < span[:, None, None]) & (pos < context[:, None, None])
    nonempty = torch.minimum(context[:, None], part_start + span[:, None]) > part_start
    flat_pos, flat_used = pos.reshape(n, -1), in_part.reshape(n, -1)  # [n, T], T = S*C
    page, slot = _locate(launch, start, flat_pos, flat_used)

    # Logits [n, Hkv, E, T] in float32.
    key_tok = launch.key[page, :, :, slot, :].flatten(-2)[..., :d].to(device)  # [n, T, Hkv, D]
    q = _round_to(launch.query[start:stop].to(device), launch.compute_type)
    k = _round_to(key_tok, launch.compute_type).permute(0, 2, 3, 1)  # [n, Hkv, D, T]
    scale = torch.tensor(softmax_scale, dtype=torch.float32, device=device)
    if launch.query_scale is not None:
        qs = launch.query_scale
        scale = scale * (qs if qs.dim() == 0 else qs[start:stop].to(device))
    if launch.kv_quant_mode == 0:
        scale = scale * launch.key_scale
    elif launch.kv_quant_mode == 1:
        scale = scale * _token_scales(launch.key_scale, page, slot, flat_used, device)[:, :, None]
    logits = scale * torch.matmul(q, k)

    # Visibility of token t to row e = i*G + g: inside its slot, causal and window (§3.1, §3.5).
    ext = (qlen - 1 - torch.arange(rows, device=device) // group)[None, :, None]
    shifted = ext + flat_pos[:, None, :]  # [n, E, T]
    visible = flat_used[:, None, :] & (shifted < context[:, None, None])
    if launch.sliding_window > 0:
        lower = context - launch.sliding_window + qlen
        visible &= shifted >= lower[:, None, None]
    visible = visible[:, None]  # [n, 1, E, T]
    shape5 = (n, hkv, rows, num_parts, width)
    logits = torch.where(visible, logits, MASKED_LOGIT).view(shape5)
    visible = visible.view(n, 1, rows, num_parts, width)

    # Online softmax over tiles of context_partition_size tokens: each probability is taken
    # against the running maximum after its tile, then rescaled to the slot maximum.
    running = torch.cummax(logits, dim=-1).values
    tile_end = (torch.div(pos, tile, rounding_mode="floor") + 1) * tile - part_start[:, :, None]
    last = (tile_end.clamp(max=width) - 1).clamp(min=0)[:, None, None]
    m_run = running.gather(-1, last.expand(shape5))
    m_slot = running[..., -1]  # [n, Hkv, E, S]
    prob = torch.where(visible, torch.exp2((logits - m_run) * LOG2E), 0.0)
    rescale = torch.exp2((m_run - m_slot[..., None]) * LOG2E)
    exp_sum = (prob * rescale).sum(-1)

    # PV operands: probabilities rounded to compute_type, V scales folded in (§3.1 step 5).
    if launch.kv_quant_mode == 1:
        token_scale = _token_scales(launch.value_scale, page, slot, flat_used, device)
        tile_max = _tile_value_scale_max(launch, start, context, flat_pos)
        token_scale = token_scale * (launch.fp8_max * (1.0 / (tile_max + 1e-8)))
        prob = prob * token_scale.view(n, hkv, 1, num_parts, width)
        after = (tile_max * (1.0 / launch.fp8_max)).view(n, hkv, 1, num_parts, width)
    elif launch.kv_quant_mode == 0:
        after = launch.value_scale
    else:
        after = 1.0
    weight = _round_to(prob, launch.compute_type) * after * rescale
    if launch.value_transposed:
        x = launch.value.shape[-1]
        value_tok = launch.value[page, :, torch.div(slot, x, rounding_mode="floor"), :, slot % x]
    else:
        value_tok = launch.value[page, :, :, slot]
    v = _round_to(value_tok.to(device), launch.compute_type)  # [n, T, Hkv, D]
    v = torch.where(flat_used[:, :, None, None], v, 0.0)
    v = v.view(n, num_parts, width, hkv, d).permute(0, 3, 1, 2, 4)  # [n, Hkv, S, C, D]
    acc = torch.matmul(weight.transpose(2, 3), v)  # [n, Hkv, S, E, D]

    exp_sum = exp_sum.transpose(2, 3)  # [n, Hkv, S, E]
    max_logit = torch.where(nonempty[:, None, :, None], m_slot.transpose(2, 3), -torch.inf)
    if num_parts == 1 and launch.sinks is not None:
        exp_sum = exp_sum + torch.exp2((launch.sinks[:, None, :] - max_logit) * LOG2E)
    safe = torch.where(exp_sum > 0, exp_sum, 1.0)
    partial = (acc * (1.0 / safe)[..., None]).to(launch.output_dtype)

    target = launch.output[start:stop]
    if scratch is None:
        result = _to_output_layout(partial[:, :, 0], qlen, group)
        written = context > 0  # one-shot: the kernel returns early for L == 0
        target[written] = result[written].to(target.dtype)
        return
    exp_sums, max_logits, temporary_output = (t[start:stop] for t in scratch)
    exp_sums.copy_(exp_sum)
    max_logits.copy_(max_logit)
    temporary_output.copy_(partial)
    reduced = _ps_reduce(launch, exp_sums, max_logits, temporary_output)
    target.copy_(_to_output_layout(reduced, qlen, group))


def _locate(
    launch: _Launch, start: int, pos: torch.Tensor, used: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page ids and in-page slots of token positions ``pos`` (page 0 where unused), on the
    caches' device."""
    n, bs = pos.shape[0], launch.block_size
    block = torch.div(pos, bs, rounding_mode="floor").clamp(max=launch.pages.shape[1] - 1)
    pages = launch.pages[start : start + n].to(pos.device)
    page = torch.where(used, pages.gather(1, block), 0)
    return page.to(launch.key.device), (pos % bs).to(launch.key.device)


def _token_scales(
    scales: torch.Tensor,
    page: torch.Tensor,
    slot: torch.Tensor,
    used: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """Per-token scales [n, Hkv, T] (0 for unused tokens, as the kernel zeroes V's)."""
    values = scales[page, :, slot].transpose(1, 2).float().to(device)
    return torch.where(used[:, None, :], values, 0.0)


def _tile_value_scale_max(
    launch: _Launch, start: int, context: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Max value scale over the tokens < L of each token's tile, [n, Hkv, T]."""
    n, tile = pos.shape[0], launch.tile
    tiles = max(1, _cdiv(int(context.max()), tile))
    absolute = torch.arange(tiles * tile, device=pos.device).expand(n, -1)
    inside = absolute < context[:, None]
    page, slot = _locate(launch, start, absolute, inside)
    scales = _token_scales(launch.value_scale, page, slot, inside, pos.device)
    tile_max = scales.view(n, launch.kv_heads, tiles, tile).amax(-1)
    index = torch.div(pos, tile, rounding_mode="floor").clamp(max=tiles - 1)
    return tile_max.gather(-1, index[:, None, :].expand(n, launch.kv_heads, -1))


def _ps_reduce(
    launch: _Launch,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    temporary_output: torch.Tensor,
) -> torch.Tensor:
    """The C++/FlyDSL PS reduce (§3.3): [n, Hkv, E, D] float32, 0 for all-empty rows."""
    global_max = max_logits.amax(dim=2, keepdim=True)  # [n, Hkv, 1, E]
    any_part = global_max > -torch.inf
    safe_max = torch.where(any_part, global_max, 0.0)
    part_scale = torch.where(
        max_logits > -torch.inf, torch.exp2((max_logits - safe_max) * LOG2E), 0.0
    )
    weights = exp_sums * part_scale
    denominator = weights.sum(dim=2, keepdim=True)
    if launch.sinks is not None:
        sink = torch.exp2((launch.sinks[:, None, :] - safe_max) * LOG2E)
        denominator = denominator + torch.where(any_part, sink, 0.0)
    denominator = torch.where(denominator > 0, denominator, 1.0)
    weights = (weights / denominator)[..., None]
    return (weights * temporary_output.float()).sum(dim=2)


def _to_output_layout(rows: torch.Tensor, qlen: int, group: int) -> torch.Tensor:
    """[n, Hkv, qlen*G, D] -> [n, qlen, Hkv, G, D]."""
    n, hkv, _, d = rows.shape
    return rows.view(n, hkv, qlen, group, d).transpose(1, 2)


def make_emulator(
    revision: str | ContractRevision = DEFAULT_REVISION,
    arch: str = DEFAULT_ARCH,
    num_cus: int = DEFAULT_NUM_CUS,
) -> GluonEmulator:
    """An emulated AITER build (unknown revision names raise ``ValueError``)."""
    return GluonEmulator(resolve_revision(revision), arch, num_cus)


def make_pa_decode_gluon(
    revision: str | ContractRevision = DEFAULT_REVISION,
    arch: str = DEFAULT_ARCH,
    num_cus: int = DEFAULT_NUM_CUS,
) -> Callable[..., None]:
    """``pa_decode_gluon`` of the emulated build ``(revision, arch, num_cus)``."""
    return make_emulator(revision, arch, num_cus).pa_decode_gluon


_DEFAULT_EMULATOR = make_emulator()
pa_decode_gluon = _DEFAULT_EMULATOR.pa_decode_gluon
get_recommended_splits = _DEFAULT_EMULATOR.get_recommended_splits


def _aiter_keys() -> dict[str, types.ModuleType]:
    return {
        name: module
        for name, module in sys.modules.items()
        if name == "aiter" or name.startswith("aiter.")
    }


@contextlib.contextmanager
def installed_as_aiter(
    revision: str | ContractRevision = DEFAULT_REVISION,
    arch: str = DEFAULT_ARCH,
    num_cus: int = DEFAULT_NUM_CUS,
    *,
    shadow_real: bool = False,
) -> Iterator[GluonEmulator]:
    """Register fake ``aiter`` modules backed by the emulator for the duration of the block.

    vLLM's unmodified ``_run_gluon_decode`` then imports ``aiter.dtypes`` and
    ``aiter.ops.triton.gluon.pa_decode_gluon`` from them. Every fake module carries
    ``__difftest_emulator__`` = the revision name. Raises ``RuntimeError`` rather than
    shadow a real AITER (already imported or importable) unless ``shadow_real`` is set,
    which a caller running the emulator beside the real kernel in one process must ask for
    explicitly; an emulator is never nested. ``sys.modules`` is restored exactly on exit
    (a real AITER imported before the block included).
    """
    emulator = make_emulator(revision, arch, num_cus)
    present = sys.modules.get("aiter")
    if present is not None and hasattr(present, "__difftest_emulator__"):
        raise RuntimeError(
            "refusing to install the pa_decode_gluon emulator: an emulated "
            "'aiter' module is already imported"
        )
    if present is not None and not shadow_real:
        raise RuntimeError(
            "refusing to install the pa_decode_gluon emulator: a real "
            "'aiter' module is already imported"
        )
    if not shadow_real and importlib.util.find_spec("aiter") is not None:
        raise RuntimeError(
            "refusing to install the pa_decode_gluon emulator: a real 'aiter' "
            "package is importable and would be shadowed"
        )
    saved = _aiter_keys()
    for name in saved:  # no real submodule stays reachable beside the fakes
        del sys.modules[name]
    modules = {name: types.ModuleType(name) for name in _FAKE_MODULES}
    for name, module in modules.items():
        module.__difftest_emulator__ = emulator.revision.name
        if name != _FAKE_MODULES[-1]:
            module.__path__ = []
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    dtypes = modules["aiter.dtypes"]
    dtypes.fp8, dtypes.bf16, dtypes.fp16 = emulator.fp8, torch.bfloat16, torch.float16
    dtypes.fp32 = torch.float32
    leaf = modules[_FAKE_MODULES[-1]]
    leaf.pa_decode_gluon = emulator.pa_decode_gluon
    leaf.get_recommended_splits = emulator.get_recommended_splits
    modules["aiter"].pa_decode_gluon = emulator.pa_decode_gluon
    sys.modules.update(modules)
    try:
        yield emulator
    finally:
        for name in _aiter_keys():
            del sys.modules[name]
        sys.modules.update(saved)
