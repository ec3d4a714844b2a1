"""The numerics of AITER's ``pa_decode_gluon`` kernels, emulated in float32 on any device.

Input is a decoded :class:`Launch` (the arguments after the launcher's checks and addressing,
:mod:`difftest.backends.pa_decode_gluon_contract`); output is written in place into the
caller's ``output`` (and the partition scratch when there is one). Section numbers (§) refer
to ``shared/reference/aiter-pa-decode-gluon.md``:

* §3.1 (head-1 and multi-head PS kernels): q and K/V cast to ``compute_type`` (fp8
  saturating), float32 logits, masked logits ``MASKED_LOGIT``, online softmax over
  ``context_partition_size``-token tiles against the running maximum, probabilities rounded
  to ``compute_type`` before PV, V scales folded in per tensor or per token (the kernel's
  ``FP8_MAX / max_tile`` trick), ``out = acc / l`` with ``l == 0 -> 1``, sinks, the result
  rounded to ``Launch.output_dtype`` and stored in ``output.dtype``;
* §3.3, §3.4: partition slots, the scratch in AITER's format and the C++/FlyDSL PS reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftest.case.selection import window_start

LOG2E = 1.4426950408889634
MASKED_LOGIT = -3.4e38
# Work per sequence chunk: bounds the float32 temporaries to about 64 MiB each.
_CHUNK_ELEMENTS = 1 << 24


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def cdiv_tensor(values: torch.Tensor, divisor: int) -> torch.Tensor:
    """``ceil(values / divisor)`` elementwise, for non-negative integer tensors."""
    return torch.div(values + divisor - 1, divisor, rounding_mode="floor")


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of torch's 8-bit floating-point types."""
    return dtype.is_floating_point and dtype.itemsize == 1


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` rounded to ``dtype`` (fp8 saturates at its maximum), returned as float32."""
    if values.dtype == dtype:
        return values.float()
    values = values.float()
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        values = values.clamp(-limit, limit)
    return values.to(dtype).float()


@dataclass(frozen=True)
class Launch:
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


def emulate(
    launch: Launch,
    softmax_scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """Run the kernels (and the PS reduce when ``scratch`` is given) on every sequence."""
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
            _run_chunk(launch, softmax_scale, start, stop, scratch)
            start, longest = stop, 1


def _run_chunk(
    launch: Launch,
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
        span = cdiv_tensor(context, num_parts)
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
    q = round_to(launch.query[start:stop].to(device), launch.compute_type)
    k = round_to(key_tok, launch.compute_type).permute(0, 2, 3, 1)  # [n, Hkv, D, T]
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
    causal = context[:, None, None] - ext  # [n, E, 1]: the tokens query i may see
    visible = flat_used[:, None, :] & (flat_pos[:, None, :] < causal)  # [n, E, T]
    if launch.sliding_window > 0:
        # §3.5: the window of a query placed qlen positions past its causal context
        visible &= flat_pos[:, None, :] >= window_start(causal + qlen, launch.sliding_window)
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
    weight = round_to(prob, launch.compute_type) * after * rescale
    if launch.value_transposed:
        x = launch.value.shape[-1]
        value_tok = launch.value[page, :, torch.div(slot, x, rounding_mode="floor"), :, slot % x]
    else:
        value_tok = launch.value[page, :, :, slot]
    v = round_to(value_tok.to(device), launch.compute_type)  # [n, T, Hkv, D]
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
    launch: Launch, start: int, pos: torch.Tensor, used: torch.Tensor
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
    launch: Launch, start: int, context: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Max value scale over the tokens < L of each token's tile, [n, Hkv, T]."""
    n, tile = pos.shape[0], launch.tile
    tiles = max(1, cdiv(int(context.max()), tile))
    absolute = torch.arange(tiles * tile, device=pos.device).expand(n, -1)
    inside = absolute < context[:, None]
    page, slot = _locate(launch, start, absolute, inside)
    scales = _token_scales(launch.value_scale, page, slot, inside, pos.device)
    tile_max = scales.view(n, launch.kv_heads, tiles, tile).amax(-1)
    index = torch.div(pos, tile, rounding_mode="floor").clamp(max=tiles - 1)
    return tile_max.gather(-1, index[:, None, :].expand(n, launch.kv_heads, -1))


def _ps_reduce(
    launch: Launch,
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

