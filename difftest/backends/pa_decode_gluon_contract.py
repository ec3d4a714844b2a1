"""The contract of AITER's ``pa_decode_gluon`` launcher: its preconditions and addressing.

:class:`GluonEmulator` has the launcher's interface (argument names, shapes, dtypes, layouts
and its assertion messages) for one emulated build: a contract revision
(:data:`REVISIONS`), an arch (which fp8 flavour ``aiter.dtypes.fp8`` is) and a CU count
(for ``get_recommended_splits``). A call decodes and checks the arguments into a
:class:`~difftest.backends.pa_decode_gluon_numerics.Launch` (§2, §4 of
``shared/reference/aiter-pa-decode-gluon.md``), then runs the emulated numerics on it.
:meth:`GluonEmulator.decode_call` also says which kernels AITER's launcher launches for the
call and with what (:class:`KernelLaunch`: the kernel its dispatch picks, the grid, every
stride, scalar and constexpr), which ``aiter-gluon@compiled`` checks against the launches the
real launcher makes (:mod:`difftest.backends.aiter_gluon_compiled`).

AITER's preconditions are explicit ``raise AssertionError`` (:func:`_aiter_assert`), never
``assert`` statements: pytest rewrites the asserts of an entry-point plugin's whole
distribution, which holds this module, and ``python -O`` would drop them. Inputs on which
AITER silently returns garbage raise ``ValueError`` (:func:`_require`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from difftest.backends.pa_decode_gluon_numerics import (
    Launch,
    cdiv,
    cdiv_tensor,
    emulate,
    is_fp8,
)

ARCH_FP8: dict[str, torch.dtype] = {
    "gfx942": torch.float8_e4m3fnuz,
    "gfx950": torch.float8_e4m3fn,
}
DEFAULT_ARCH = "gfx950"
DEFAULT_NUM_CUS = 304
CDNA_VERSION = {"gfx942": 3, "gfx950": 4}
_TILE_SIZES = (128, 256)
# torch_to_triton_dtype of AITER's ops/triton/utils/types.py, by the Triton dtype's name
TRITON_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8", torch.bfloat16: "bf16",
    torch.float16: "fp16", torch.float32: "fp32",
}
CXX_PS_REDUCE = "launch_pa_decode_ps_reduce"  # csrc/cpp_itfs/pa/pa_ps.py (C++ PS reduce)


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


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"pa_decode_gluon emulator: {message}")


def _check_fp32_scale(name: str, scale: object) -> None:
    """AITER's check that a scale is a float32 tensor."""
    _aiter_assert(isinstance(scale, torch.Tensor) and scale.dtype == torch.float32,
                  f"{name} tensor only support dtype == {torch.float32}, "
                  f"but got {name}.dtype == {getattr(scale, 'dtype', None)}")


def _scale_mode(name: str, scale: torch.Tensor, dims: int) -> int:
    """AITER's quant mode of a scale: 0 for one value, 1 for a ``dims``-D tensor of one value
    per token and head (its last dimension 1; checked)."""
    if scale.numel() == 1:
        return 0
    _aiter_assert(len(scale.shape) == dims,
                  f"Expected {dims}D {name} tensor, but got shape {scale.shape}")
    _aiter_assert(scale.shape[-1] == 1, f"Expected {name}.shape[-1] == 1, "
                  f"but got {name}.shape[-1]={scale.shape[-1]}")
    return 1


def _aiter_assert(condition: bool, message: str) -> None:
    """Raise AITER's own ``AssertionError`` with its message (kept under ``python -O``
    and untouched by pytest's assertion rewriting)."""
    if not condition:
        raise AssertionError(message)


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
class Operand:
    """A tensor argument of a launch: the call's argument ``name`` (or a view of it), or
    ``"allocated"`` for scratch the launcher allocates itself, with its dtype."""

    name: str
    dtype: torch.dtype


@dataclass(frozen=True)
class KernelLaunch:
    """One launch AITER's launcher makes for a call: the kernel its dispatch picks (or the
    C++ PS reduce, :data:`CXX_PS_REDUCE`, which takes no grid), the grid, and the arguments
    by the kernel's parameter names: ints, floats, bools and ``None`` as passed, tensors as
    :class:`Operand`, ``COMPUTE_TYPE`` by Triton's dtype name."""

    kernel: str
    grid: tuple[int, ...]
    arguments: dict[str, Any]


@dataclass(frozen=True)
class DecodedCall:
    """A call decoded: what the numerics need, the partition scratch (``None`` one-shot) and
    the launches AITER's launcher makes for it."""

    launch: Launch
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    kernels: list[KernelLaunch]


def _pow2(n: int) -> int:
    """``triton.next_power_of_2``."""
    return 1 << max(0, n - 1).bit_length()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


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
        return min(8, cdiv(2 * self.num_cus, denominator) * split_kv_blocks)

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
        call = self.decode_call(
            output, query, key_cache, value_cache, context_lengths, block_tables,
            softmax_scale, query_length, max_context_partition_num, context_partition_size,
            compute_type, query_scale, key_scale, value_scale, exp_sums, max_logits,
            temporary_output, alibi_slopes, sinks, sliding_window, ps)
        emulate(call.launch, float(softmax_scale), call.scratch)

    def decode_call(
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
        *,
        reduce: str = "cxx",
    ) -> DecodedCall:
        """Check and decode a ``pa_decode_gluon`` call (same arguments) without running it:
        the numerics' launch, the scratch, and the launches AITER's launcher makes, its PS
        reduce the C++ one (``reduce="cxx"``, a ROCm install) or the Triton fallback
        (``"triton"``: an install without the C++ reduce and FlyDSL)."""
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
        operands = {
            name: Operand(name, tensor.dtype) for name, tensor in (
                ("output", output), ("query", query), ("key_cache", key_cache),
                ("value_cache", value_cache), ("context_lengths", context_lengths),
                ("block_tables", block_tables), ("query_scale", query_scale),
                ("key_scale", key_scale), ("value_scale", value_scale),
                ("exp_sums", exp_sums), ("max_logits", max_logits),
                ("temporary_output", temporary_output), ("sinks", sinks))
            if tensor is not None}
        kernels = self._launches(launch, operands, output, query, key_cache, value_cache,
                                 block_tables, softmax_scale, max_context_partition_num,
                                 query_scale, key_scale, exp_sums, temporary_output,
                                 sliding_window, ps, reduce)
        return DecodedCall(launch, scratch, kernels)

    def _launches(
        self,
        launch: Launch,
        operands: dict[str, Operand],
        output: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        softmax_scale: float,
        partitions: int,
        query_scale: torch.Tensor | None,
        key_scale: torch.Tensor | None,
        exp_sums: torch.Tensor | None,
        temporary_output: torch.Tensor | None,
        sliding_window: int,
        ps: bool,
        reduce: str,
    ) -> list[KernelLaunch]:
        """The launches of AITER's launcher (v0.1.14 on: ``pa_decode_gluon``, its kernel
        wrapper's dispatch and grid, and the reduce wrapper's first choice)."""
        b, qlen, hkv, g, d = (launch.batch, launch.qlen, launch.kv_heads, launch.group,
                              launch.head_size)
        one_shot = partitions <= 1
        ps = ps or one_shot
        scratch_shape = (b, hkv, partitions, qlen * g)
        sums = exp_sums.stride() if exp_sums is not None else _contiguous_strides(scratch_shape)
        temporary = (temporary_output.stride() if temporary_output is not None
                     else _contiguous_strides((*scratch_shape, d)))
        scratch_out = operands.get("temporary_output", Operand("allocated", query.dtype))
        output5 = output.reshape(b, qlen, hkv, g, d)
        query5 = query.reshape(b, qlen, hkv, g, d)
        per_token_q = query_scale is not None and query_scale.numel() > 1
        q_scale_strides = (query_scale.reshape(b, qlen, hkv, g, 1).stride()[:3] if per_token_q
                           else (0, 0, 0))
        kv_scale_strides = (key_scale.stride()[:2] if launch.kv_quant_mode == 1 else (0, 0))
        out_strides = output5.stride()[:4] if one_shot else temporary[:4]
        common: dict[str, Any] = {
            "exp_sums_ptr": operands.get("exp_sums", Operand("allocated", torch.float32)),
            "max_logits_ptr": operands.get("max_logits", Operand("allocated", torch.float32)),
            "output_ptr": operands["output"] if one_shot else scratch_out,
            "query_ptr": operands["query"], "key_cache_ptr": operands["key_cache"],
            "value_cache_ptr": operands["value_cache"],
            "block_tables_ptr": operands["block_tables"],
            "context_lengths_ptr": operands["context_lengths"],
            "softmax_scale": softmax_scale, "query_scale": operands.get("query_scale"),
            "key_scale": operands.get("key_scale"), "value_scale": operands.get("value_scale"),
            **dict(zip(("stride_max_logits_seq", "stride_max_logits_head",
                        "stride_max_logits_part"), sums[:3], strict=True)),
            **dict(zip(("stride_query_bs", "stride_query_qlen", "stride_query_kv_head",
                        "stride_query_group_size"), query5.stride()[:4], strict=True)),
            **dict(zip(("stride_key_block", "stride_key_head", "stride_key_head_split",
                        "stride_key_block_elem"), key_cache.stride()[:4], strict=True)),
            **dict(zip(("stride_value_block", "stride_value_head", "stride_value_head_size"),
                       value_cache.stride()[:3], strict=True)),
            "stride_block_table_seq": block_tables.stride(0),
            **dict(zip(("stride_query_scale_bs", "stride_query_scale_qlen",
                        "stride_query_scale_kv_head"), q_scale_strides, strict=True)),
            "kv_scale_stride_0": kv_scale_strides[0], "kv_scale_stride_1": kv_scale_strides[1],
            "head_size": d,
            "COMPUTE_TYPE": TRITON_DTYPE_NAMES.get(launch.compute_type),
            "HEAD_SIZE_POW2": _pow2(d), "KV_BLOCK_SIZE": launch.block_size,
            "CONTEXT_PARTITION_SIZE": launch.tile,
            "QUERY_QUANT_MODE": -1 if query_scale is None else int(per_token_q),
            "KV_QUANT_MODE": launch.kv_quant_mode, "FP8_MAX_VALUE": launch.fp8_max,
            "VALUE_TRANSPOSED": launch.value_transposed, "IS_CAUSAL": qlen > 1,
            "SLIDING_WINDOW": sliding_window, "CDNA_VERSION": CDNA_VERSION[self.arch],
        }
        sinks = operands.get("sinks")
        launches = []
        if ps and not (sliding_window > 0 and launch.block_size == 1024):
            group_pow2, qlen_pow2 = _pow2(g), _pow2(qlen)
            grid: tuple[int, ...] = (b, hkv, partitions)
            kernel = "paged_attention_decode_sliding_window"
            if hkv == 1:
                kernel += "_head_1"
                if group_pow2 >= 16:
                    grid, qlen_pow2 = (b, qlen * hkv, partitions), 1
                else:
                    mtp_splits = cdiv(qlen * hkv, cdiv(16, group_pow2))
                    grid, qlen_pow2 = (b, mtp_splits, partitions), cdiv(qlen_pow2, mtp_splits)
            launches.append(KernelLaunch(kernel, grid, {
                **common, "sinks_ptr": sinks if one_shot else None,
                **dict(zip(("stride_output_bs", "stride_output_len", "stride_output_kv_head",
                            "stride_output_group_size"), out_strides, strict=True)),
                "query_seq_len": qlen, "query_group_size": g, "QUERY_SEQ_LEN_POW2": qlen_pow2,
                "ONE_QUERY_GROUP_SIZE_POW2": group_pow2, "ONE_SHOT": one_shot}))
        else:
            kernel = ("paged_attention_decode_v2_gluon_large_block_dot_kernel"
                      if launch.block_size > launch.tile
                      else "paged_attention_decode_v2_gluon_dot_kernel")
            launches.append(KernelLaunch(kernel, (b, hkv, partitions), {
                **common,
                **dict(zip(("stride_output_seq", "stride_output_head", "stride_output_part",
                            "stride_output_group"), out_strides, strict=True)),
                "num_seqs": b, "num_kv_heads": hkv, "max_context_partition_num": partitions,
                "QUERY_SEQ_LEN": qlen, "ONE_QUERY_GROUP_SIZE": g,
                "KV_COMPUTE_BLOCK_SIZE": launch.tile}))
        if one_shot:
            return launches
        reduce_strides = {
            **dict(zip(("stride_output_bs", "stride_output_len", "stride_output_kv_head",
                        "stride_output_group_size"), output5.stride()[:4], strict=True)),
            **dict(zip(("stride_exp_sums_seq", "stride_exp_sums_head", "stride_exp_sums_part"),
                       sums[:3], strict=True)),
            **dict(zip(("stride_logits_seq", "stride_logits_head", "stride_logits_part",
                        "stride_logits_group"), temporary[:4], strict=True)),
        }
        reduced = {"output_ptr": operands["output"], "exp_sums_ptr": common["exp_sums_ptr"],
                   "max_logits_ptr": common["max_logits_ptr"], "logits_ptr": scratch_out,
                   "sink_token_ptr": sinks, **reduce_strides}
        if ps and reduce == "cxx":
            launches.append(KernelLaunch(CXX_PS_REDUCE, (), {
                **reduced, "query_seq_len": qlen, "query_group_size": g, "head_size": d,
                "context_partition_num": partitions}))
        elif ps:
            launches.append(KernelLaunch("paged_attention_decode_ps_reduce_kernel",
                                         (b, hkv, qlen * g), {
                **reduced, "head_size": d, "context_partition_num": partitions,
                "query_group_size": g, "HEAD_SIZE_POW2": _pow2(d), "USE_SINKS": sinks is not None,
                "MAX_CONTEXT_PARTITION_NUM": _pow2(partitions)}))
        else:
            launches.append(KernelLaunch("paged_attention_decode_v2_reduce_kernel",
                                         (b, hkv, 1), {
                **reduced, "context_lengths_ptr": operands["context_lengths"], "head_size": d,
                "num_seqs": b, "num_kv_heads": hkv,
                "OUTPUT_SEQ_LEN": qlen, "ONE_OUTPUT_GROUP_SIZE": g,
                "HEAD_SIZE_POW2": _pow2(d), "CONTEXT_PARTITION_SIZE": launch.tile,
                "USE_SINKS": sinks is not None}))
        return launches

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
    ) -> Launch:
        fp8, bf16, fp16 = self.fp8, torch.bfloat16, torch.float16
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
            _check_fp32_scale("query_scale", query_scale)
            query_quant_mode = _scale_mode("query_scale", query_scale, 3)

        kv_quant_mode = -1
        if key_scale is not None and value_scale is not None and key_cache.dtype == fp8:
            _check_fp32_scale("key_scale", key_scale)
            _check_fp32_scale("value_scale", value_scale)
            kv_quant_mode = _scale_mode("key_scale", key_scale, 4)
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
        width = max(1, cdiv(max_context, block_size))
        # Entry j of row b sits at b * stride(0) + j; only entries j < cdiv(L, bs) are read.
        table_device = block_tables.device
        blocks = cdiv_tensor(context, block_size).to(table_device)
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
            (num_pages, kv_heads, cdiv(head_size, x), block_size, x),
            (ks0, ks1, ks2, ks3, 1),
            "key_cache",
        )
        vs0, vs1, vs2 = value_cache.stride()[:3]
        if value_transposed:
            value = _strided(
                value_cache,
                (num_pages, kv_heads, cdiv(block_size, x), head_size, x),
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
        return Launch(
            batch=batch,
            qlen=query_length,
            kv_heads=kv_heads,
            group=group,
            head_size=head_size,
            block_size=block_size,
            compute_type=compute_type,
            output_dtype=bf16 if is_fp8(compute_type) else compute_type,
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
        launch: Launch,
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


def make_emulator(
    revision: str | ContractRevision = DEFAULT_REVISION,
    arch: str = DEFAULT_ARCH,
    num_cus: int = DEFAULT_NUM_CUS,
) -> GluonEmulator:
    """An emulated AITER build (unknown revision names raise ``ValueError``)."""
    return GluonEmulator(resolve_revision(revision), arch, num_cus)
