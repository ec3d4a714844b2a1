"""Tensor data of a case, generated from the case's seed (bit-identical on every device).

Only physical blocks that some query row attends get data; each token's K and V are drawn once and
stored in the KV dtype. fp8 values are stored as ``cast(real / scale)`` with saturation at the
format's maximum, so small scales push stored values to the fp8 maximum and large scales to
its subnormals. The real value a kernel must see is ``stored * scale``.

Besides the data, :func:`generate` tabulates every row's segments once (:class:`Segments`, on
the data's device), so the reference and the cache builder work on tensors instead of walking
the rows in Python, and nothing after generation copies between host and device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from difftest.case.selection import SparseRow, attended_spans
from difftest.case.spec import Case
from difftest.inputs.serving_terms import token_head_scales
from difftest.machine.devices import to_device
from difftest.primitives import counter_rng
from difftest.primitives.dtypes import finite_max, torch_dtype

_QUERY, _KEY, _VALUE = 1, 2, 3


@dataclass(frozen=True)
class Segments:
    """Every query row's segments in attend order, padded to ``width`` per row, on the device.

    ``slots[r, j]`` is the entry of ``k_stored``/``v_stored`` holding segment ``j`` of row
    ``r``; the row attends its tokens ``first[r, j] <= t < tokens[r, j]`` (its
    :func:`~difftest.case.selection.attended_spans`: ``tokens`` the segment's context tokens,
    ``first`` where the row's window starts in it; both 0 on padding); all
    ``[total_q, width]`` int64. ``context_lens`` is ``[total_q]`` int64 (before the window).
    """

    slots: torch.Tensor
    tokens: torch.Tensor
    first: torch.Tensor
    context_lens: torch.Tensor

    @property
    def width(self) -> int:
        """Segments of the longest row."""
        return self.slots.shape[1]


@dataclass(frozen=True)
class CaseData:
    """Stored (quantised) tensors of a case, on the device they were generated on.

    ``query`` is the real query in ``query_dtype``; with fp8 queries (``case.q_scale``) it
    is ``stored * q_scale`` in float64, exactly (``query / q_scale`` gives the stored fp8
    values back exactly).
    ``k_stored``/``v_stored`` are ``[num_attended, block_size, num_kv_heads, head_dim]`` in the
    KV dtype, one entry per attended physical block, in ascending physical id order;
    ``slot_of`` maps a physical block id to its entry.
    ``valid_tokens[i]`` is how many leading tokens of that block its request wrote;
    ``block_ids`` and ``written`` are the same two as int64 tensors on the device.
    ``k_token_scales``/``v_token_scales`` (``kv_quant = "per_token_head"`` only) are every
    stored token's scale per KV head, ``[num_attended, block_size, num_kv_heads]`` float32:
    the real value is ``stored * scale`` (:mod:`difftest.inputs.serving_terms`).
    """

    query: torch.Tensor
    k_stored: torch.Tensor
    v_stored: torch.Tensor
    physical_blocks: tuple[int, ...]
    valid_tokens: tuple[int, ...]
    slot_of: dict[int, int]
    block_ids: torch.Tensor
    written: torch.Tensor
    segments: Segments
    k_token_scales: torch.Tensor | None = None
    v_token_scales: torch.Tensor | None = None


def _draw(seed: int, stream: int, rows: torch.Tensor, row_length: int,
          distribution: str) -> torch.Tensor:
    """Values of ``rows`` of a flat index space, ``[len(rows), row_length]``."""
    if distribution == "normal":
        return counter_rng.normal_rows(seed, stream, rows, row_length)
    if distribution == "uniform":
        return counter_rng.uniform_rows(seed, stream, rows, row_length) * 2 - 1
    values = counter_rng.normal_rows(seed, stream, rows, row_length)
    spikes = counter_rng.uniform_rows(seed, 100 + stream, rows, row_length) < 1 / 64
    return torch.where(spikes, values * 8, values)


def _draw_stored(seed: int, stream: int, rows: torch.Tensor, row_length: int,
                 distribution: str, dtype_name: str, scale: float) -> torch.Tensor:
    """``quantize(_draw(...))``: one fused kernel on a GPU for normal values (the draw, the
    division by the scale, the saturation and the cast), the same bits."""
    if rows.device.type != "cuda" or distribution != "normal":
        return quantize(_draw(seed, stream, rows, row_length, distribution), dtype_name, scale)
    from difftest.primitives._counter_rng_triton import stored_normal_rows_triton

    fp8 = dtype_name.startswith("float8")
    return stored_normal_rows_triton(counter_rng.stream_key(seed, stream), rows, row_length,
                                     torch_dtype(dtype_name), scale if fp8 else None,
                                     finite_max(dtype_name) if fp8 else 0.0)


def quantize(real: torch.Tensor, dtype_name: str, scale: float) -> torch.Tensor:
    """Store real values in ``dtype_name``; fp8 stores ``real / scale`` saturated."""
    dtype = torch_dtype(dtype_name)
    if dtype_name.startswith("float8"):
        limit = finite_max(dtype_name)
        if real.device.type == "cpu":
            return (real / scale).clamp(-limit, limit).to(dtype)
        # CUDA divides by a CPU scalar as ``real * (1 / scale)``, not correctly rounded, so an
        # fp8 rounding could flip against the CPU's record (F18); a 0-d device tensor of the
        # same dtype (the scalar rounded to it as the CPU rounds it) divides exactly
        divisor = torch.full((), scale, dtype=real.dtype, device=real.device)
        return (real / divisor).clamp(-limit, limit).to(dtype)
    return real.to(dtype)


@dataclass(frozen=True)
class HostTables:
    """The host-side part of :func:`generate`: everything it derives from the rows, in numpy
    and Python, before any device work (so it can be built ahead, while another case's
    kernels run; :mod:`difftest.run.runner`).

    ``packed`` is ``blocks, written, table, context_lens`` (int64) in one array for one
    host-to-device copy; ``table_shape`` is the table's ``[3, total_q, width]``.
    """

    packed: np.ndarray
    num_blocks: int
    table_shape: tuple[int, int, int]
    physical_blocks: tuple[int, ...]
    valid_tokens: tuple[int, ...]
    slot_of: dict[int, int]


def host_tables(case: Case, rows: tuple[SparseRow, ...]) -> HostTables:
    """The attended blocks, their written tokens and every row's segment table, from one
    pass over ``rows``.

    ``blocks``: the attended physical blocks, ascending; ``written[i]``: tokens its request
    wrote in ``blocks[i]``; ``table``: ``[3, total_q, width]`` slots, tokens and firsts
    (:class:`Segments`). numpy, not torch: on arrays this small each torch op costs more than
    its work.
    """
    flat = [v for n, row in enumerate(rows) for span in attended_spans(case, row)
            for v in (n, row.request, span.block, span.physical_block, span.end, span.first)]
    row, request, logical, physical, tokens, first = np.array(
        flat, dtype=np.int64).reshape(-1, 6).T
    blocks, slot = np.unique(physical, return_inverse=True)
    # a physical block holds one logical block of one request (Case validation), so every
    # segment of a block writes the same count
    seq_lens = np.array(case.seq_lens, dtype=np.int64)
    written = np.zeros_like(blocks)
    written[slot] = np.minimum(seq_lens[request] - logical * case.block_size, case.block_size)
    counts = np.bincount(row, minlength=case.total_q)
    position = np.arange(row.size) - (np.cumsum(counts) - counts)[row]
    table = np.zeros((3, case.total_q, int(counts.max()) if row.size else 0), dtype=np.int64)
    table[:, row, position] = np.stack((slot, tokens, first))
    physical_blocks = tuple(blocks.tolist())
    return HostTables(
        packed=np.concatenate((blocks, written, table.ravel(), table[1].sum(1))),
        num_blocks=blocks.size,
        table_shape=(3, case.total_q, table.shape[2]),
        physical_blocks=physical_blocks,
        valid_tokens=tuple(written.tolist()),
        slot_of={b: i for i, b in enumerate(physical_blocks)},
    )


def generate(case: Case, rows: tuple[SparseRow, ...],
             device: str | torch.device = "cpu", tables: HostTables | None = None) -> CaseData:
    """Generate the query and the K/V of every attended block, bit-identically on any device.

    Blocks no row attends get no data: their pages are NaN canaries in the cache.
    ``tables``: :func:`host_tables` of ``case`` and ``rows`` if the caller built them ahead.
    """
    device = torch.device(device)
    host = tables if tables is not None else host_tables(case, rows)
    per_row = case.num_q_heads * case.head_dim
    q_rows = torch.arange(case.total_q, device=device)
    query = _draw(case.seed, _QUERY, q_rows, per_row, case.distribution)
    # one host-to-device copy for every table
    packed = to_device(torch.from_numpy(host.packed), device)
    n, (_, total_q, width) = host.num_blocks, host.table_shape
    block_ids, written_d, table_d, ctx_d = packed.split((n, n, 3 * total_q * width, total_q))
    table_d = table_d.view(host.table_shape)
    per_block = case.block_size * case.num_kv_heads * case.head_dim
    shape = (n, case.block_size, case.num_kv_heads, case.head_dim)
    token_scales: dict[str, torch.Tensor] = {}
    if case.kv_quant == "per_token_head":  # each token and KV head stored with its own scale
        k_stored, v_stored = (
            _draw_per_token_head(case, stream, side, block_ids, token_scales)
            for stream, side in ((_KEY, "k"), (_VALUE, "v")))
    else:
        k_stored = _draw_stored(case.seed, _KEY, block_ids, per_block, case.distribution,
                                case.kv_dtype, case.k_scale).view(shape)
        v_stored = _draw_stored(case.seed, _VALUE, block_ids, per_block, case.distribution,
                                case.kv_dtype, case.v_scale).view(shape)
    query = query.view(case.total_q, case.num_q_heads, case.head_dim)
    if case.q_scale:  # fp8 queries: the real query stored * q_scale, exact in float64
        query = quantize(query, case.kv_dtype, case.q_scale).to(torch.float64) * case.q_scale
    return CaseData(
        query=query if case.q_scale else query.to(torch_dtype(case.query_dtype)),
        k_stored=k_stored,
        v_stored=v_stored,
        physical_blocks=host.physical_blocks,
        valid_tokens=host.valid_tokens,
        slot_of=host.slot_of,
        block_ids=block_ids,
        written=written_d,
        segments=Segments(table_d[0], table_d[1], table_d[2], ctx_d),
        k_token_scales=token_scales.get("k"),
        v_token_scales=token_scales.get("v"),
    )


def _draw_per_token_head(case: Case, stream: int, side: str, block_ids: torch.Tensor,
                         scales_out: dict[str, torch.Tensor]) -> torch.Tensor:
    """One side's stored fp8 values under per-token-head scales (``fp8(real / scale)``,
    saturated); the scales go to ``scales_out[side]``."""
    per_block = case.block_size * case.num_kv_heads * case.head_dim
    shape = (-1, case.block_size, case.num_kv_heads, case.head_dim)
    real = _draw(case.seed, stream, block_ids, per_block, case.distribution).view(shape)
    scales = token_head_scales(case, side, block_ids)
    scales_out[side] = scales
    limit = finite_max(case.kv_dtype)
    return (real / scales[..., None]).clamp(-limit, limit).to(torch_dtype(case.kv_dtype))
