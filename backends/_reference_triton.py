"""The GPU kernels behind ``torch-ref`` (:mod:`backends.torch_ref`): its sums read straight
from the stored per-block K/V.

Two kernels replace the gathers, the float64 copies of every gathered K/V and the four
GEMMs of the torch formulation, computing the same sums in another order (float64 or
float32 as there, within the bounds the module docstring of :mod:`backends.torch_ref`
derives; any order, with or without FMA), from float32 copies of the attended blocks (exact:
fp8 and 16-bit values are float32 values):

* :func:`scores_and_largest`: per row and 128-token segment, the logits ``q . k`` in
  float64 (``-inf`` on masked tokens) and the largest float32
  ``q^2 . k^2`` over the segment's unmasked tokens (``-1`` where none is);
* :func:`weighted_values`: per row and segment, ``sum p v`` in float64 and ``sum p |v|`` in
  float32 (the torch formulation's per-block float32 sums), added over segments in float64
  by the caller.

The scale, the softcap and the softmax between them stay torch's, on the logits as the
torch formulation has them. The operands are loaded from the float32 copies because a
float64 ``tl.dot`` does not compile on operands loaded as 8- or 16-bit values (Triton 3.6 on
the H200: "Currently fp64 don't support largeK MMA").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HEADS = 16  # query heads per program (tl.dot needs at least 16 rows)
CHUNK = 32  # the reduced dimension per tl.dot (the fastest of 16..128 on the H200)


@triton.jit
def _scores_kernel(q_ptr, qsq_ptr, k_ptr, slots_ptr, tokens_ptr, starts_ptr, ctx_ptr,
                   scores_ptr, largest_ptr, window, num_heads, width, WINDOW: tl.constexpr,
                   HB: tl.constexpr, B: tl.constexpr, D: tl.constexpr, KC: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2) * HB + tl.arange(0, HB)
    t = tl.arange(0, B)
    seg = r.to(tl.int64) * width + j
    slot = tl.load(slots_ptr + seg)
    valid = t < tl.load(tokens_ptr + seg)
    if WINDOW:
        ordinal = tl.load(starts_ptr + seg) + t
        valid &= ordinal >= tl.load(ctx_ptr + r) - window
    heads = h < num_heads
    q_row = (r.to(tl.int64) * num_heads + h[:, None]) * D
    logits = tl.zeros((HB, B), dtype=tl.float64)
    sums = tl.zeros((HB, B), dtype=tl.float32)
    for c0 in tl.static_range(0, D, KC):  # the head dim in chunks, k loaded transposed
        c = c0 + tl.arange(0, KC)
        q = tl.load(q_ptr + q_row + c[None, :], mask=heads[:, None], other=0.0)
        q_sq = tl.load(qsq_ptr + q_row + c[None, :], mask=heads[:, None], other=0.0)
        k = tl.load(k_ptr + slot * (B * D) + t[None, :] * D + c[:, None])
        logits += tl.dot(q, k.to(tl.float64))
        sums += tl.dot(q_sq, k * k, input_precision="ieee")
    logits = tl.where(valid[None, :], logits, float("-inf"))
    out_at = (r.to(tl.int64) * num_heads + h[:, None]) * (width * B) + j * B + t[None, :]
    tl.store(scores_ptr + out_at, logits, mask=heads[:, None])
    largest = tl.max(tl.where(valid[None, :], sums, -1.0), axis=1)
    tl.store(largest_ptr + (r.to(tl.int64) * num_heads + h) * width + j, largest, mask=heads)


@triton.jit
def _values_kernel(probs_ptr, v_ptr, slots_ptr, out_ptr, abs_ptr, num_heads, width,
                   HB: tl.constexpr, B: tl.constexpr, D: tl.constexpr, KC: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2) * HB + tl.arange(0, HB)
    c = tl.arange(0, D)
    heads = h < num_heads
    slot = tl.load(slots_ptr + r.to(tl.int64) * width + j)
    p_row = (r.to(tl.int64) * num_heads + h[:, None]) * (width * B) + j * B
    acc = tl.zeros((HB, D), dtype=tl.float64)
    block = tl.zeros((HB, D), dtype=tl.float32)  # this 128-token block's sum p |v|
    for t0 in tl.static_range(0, B, KC):  # the block's tokens in chunks
        t = t0 + tl.arange(0, KC)
        p = tl.load(probs_ptr + p_row + t[None, :], mask=heads[:, None], other=0.0)
        v = tl.load(v_ptr + slot * (B * D) + t[:, None] * D + c[None, :])
        acc += tl.dot(p, v.to(tl.float64))
        block += tl.dot(p.to(tl.float32), tl.abs(v), input_precision="ieee")
    out_at = ((r.to(tl.int64) * num_heads + h[:, None]) * width + j) * D + c[None, :]
    tl.store(out_ptr + out_at, acc, mask=heads[:, None])
    tl.store(abs_ptr + out_at, block, mask=heads[:, None])


def scores_and_largest(query: torch.Tensor, query_sq: torch.Tensor, k32: torch.Tensor,
                       slots: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor,
                       context_lens: torch.Tensor, window: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, H, width * B]`` float64 unscaled logits ``q . k`` (``-inf`` where masked) and
    ``[R, H, width]`` float32 largest ``q^2 . k^2`` of rows ``query`` (``[R, H, D]``,
    float64) over the blocks ``k32[slots]`` (``k32`` ``[blocks, B, D]`` float32,
    contiguous)."""
    rows, heads, dim = query.shape
    width, block = slots.shape[1], k32.shape[1]
    scores = torch.empty((rows, heads, width * block), dtype=torch.float64, device=query.device)
    largest = torch.empty((rows, heads, width), dtype=torch.float32, device=query.device)
    grid = (rows, width, triton.cdiv(heads, HEADS))
    _scores_kernel[grid](query, query_sq, k32, slots, tokens, starts, context_lens, scores,
                         largest, window, heads, width, WINDOW=bool(window), HB=HEADS, B=block,
                         D=dim, KC=CHUNK)
    return scores, largest


def weighted_values(probs: torch.Tensor, v32: torch.Tensor, slots: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, head and 128-token segment, ``sum p v`` (float64) and ``sum p |v|``
    (float32), ``[R, H, width, D]``, of ``probs`` ``[R, H, width * B]`` over ``v32[slots]``
    (float32, contiguous); the caller adds the segments in float64."""
    rows, heads, _ = probs.shape
    width, block, dim = slots.shape[1], v32.shape[1], v32.shape[2]
    out = torch.empty((rows, heads, width, dim), dtype=torch.float64, device=probs.device)
    abs_out = torch.empty((rows, heads, width, dim), dtype=torch.float32, device=probs.device)
    grid = (rows, width, triton.cdiv(heads, HEADS))
    _values_kernel[grid](probs, v32, slots, out, abs_out, heads, width, HB=HEADS, B=block,
                         D=dim, KC=CHUNK)
    return out, abs_out
