"""The GPU kernels behind ``torch-ref`` (:mod:`backends.torch_ref`): its sums read straight
from the stored per-block K/V.

Two kernels replace the gathers, the float64 copies of every gathered K/V and the four
GEMMs of the torch formulation, computing the same sums in another order (float64 or
float32 as there, within the bounds the module docstring of :mod:`backends.torch_ref`
derives; any order, with or without FMA), from the attended blocks widened to float32
(exact: fp8 and 16-bit values are float32 values):

* :func:`scores_and_largest`: per row and 128-token segment, the logits ``q . k`` in
  float64 (``-inf`` on masked tokens) and the largest float32
  ``q^2 . k^2`` over the segment's unmasked tokens (``-1`` where none is);
* :func:`weighted_values`: per row and segment, ``sum p v`` in float64 and ``sum p |v|`` in
  float32 (the torch formulation's per-block float32 sums), added over segments in float64
  by the caller.

The scale, the softcap and the softmax between them stay torch's, on the logits as the
torch formulation has them. A float64 ``tl.dot`` does not compile on operands loaded as 8-
or 16-bit values (Triton 3.6 on the H200: "Currently fp64 don't support largeK MMA"), so the
kernels read fp8 blocks as 32-bit words, four values each, and decode every byte to its
float32 value with integer operations (:func:`_fp8_values`: exact, NaN bytes to NaN); other
stored dtypes are read from float32 copies (:func:`readable`).

Each kernel compiles once per stored format, block size and head size, whatever the case's
shape: the row, head and segment counts are run-time arguments Triton does not specialize
on, and the segment tables (views into one packed
buffer, at offsets that vary from case to case) are not specialized on their alignment
(:mod:`difftest.machine.kernel_compiles`; tests/test_kernel_specializations.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

HEADS = 16  # query heads per program (tl.dot needs at least 16 rows)
CHUNK = 32  # the reduced dimension per tl.dot (the fastest of 16..128 on the H200); a block's
# tokens are reduced in chunks of min(CHUNK, B), so that a chunk never passes the block
FLOAT32, E4M3FN, E4M3FNUZ = 0, 1, 2  # how the kernels read a stored block (Stored.fmt)
_WORDS = {torch.float8_e4m3fn: E4M3FN, torch.float8_e4m3fnuz: E4M3FNUZ}


class Stored(NamedTuple):
    """Stored blocks ``[blocks, B, D]`` as the kernels read them: ``values`` holds fp8 bytes
    as int32 words (``[blocks, B, D // 4]``, a view) or float32 values (a copy)."""

    values: torch.Tensor
    fmt: int

    @property
    def head_dim(self) -> int:
        """``D``, the values per token."""
        return self.values.shape[2] * (4 if self.fmt != FLOAT32 else 1)


def readable(stored: torch.Tensor) -> Stored:
    """``stored`` (``[blocks, B, D]``) in the form the kernels read: fp8 as words when
    contiguous, anything else as a float32 copy (exact)."""
    fmt = _WORDS.get(stored.dtype)
    if fmt is not None and stored.is_contiguous() and stored.shape[2] % 4 == 0:
        return Stored(stored.view(torch.int32), fmt)
    return Stored(stored.to(torch.float32).contiguous(), FLOAT32)


@triton.jit
def _fp8_values(b, FMT: tl.constexpr):
    """The float32 values of fp8 bytes ``b`` (int32 in 0..255), exactly: e4m3fn (bias 7,
    NaN at ``0x7f``/``0xff``) or e4m3fnuz (bias 8, NaN at ``0x80``)."""
    exp = (b >> 3) & 15
    man = b & 7
    negative = b >= 128
    if FMT == 1:  # E4M3FN (a jitted function sees no module-level int)
        normal = ((exp + 120) << 23) | (man << 20)
        tiny = man.to(tl.float32) * 0.001953125  # 2^-9
        nan = (b & 127) == 127
    else:
        normal = ((exp + 119) << 23) | (man << 20)
        tiny = man.to(tl.float32) * 0.0009765625  # 2^-10
        nan = b == 128
    value = tl.where(exp > 0, normal.to(tl.float32, bitcast=True), tiny)
    value = tl.where(negative, -value, value)
    return tl.where(nan, float("nan"), value)


@triton.jit
def _k_tile(k_ptr, slot, t, c0, B: tl.constexpr, D: tl.constexpr, KC: tl.constexpr,
            FMT: tl.constexpr):
    """``[KC, B]`` float32: head-dim entries ``c0..c0 + KC`` of the block's tokens ``t``."""
    if FMT == 0:  # FLOAT32
        c = c0 + tl.arange(0, KC)
        tile = tl.load(k_ptr + slot * (B * D) + t[None, :] * D + c[:, None])
    else:
        w = c0 // 4 + tl.arange(0, KC // 4)
        words = tl.load(k_ptr + slot * (B * D // 4) + t[None, :] * (D // 4) + w[:, None])
        shift = 8 * tl.arange(0, 4)
        bytes_ = (words[:, None, :] >> shift[None, :, None]) & 255  # [KC / 4, 4, B]
        tile = _fp8_values(tl.reshape(bytes_, (KC, B)), FMT)
    return tile


@triton.jit
def _v_tile(v_ptr, slot, t, B: tl.constexpr, D: tl.constexpr, KC: tl.constexpr,
            FMT: tl.constexpr):
    """``[KC, D]`` float32: the block's tokens ``t`` (``KC`` of them), the columns in
    :func:`_v_columns`' order."""
    if FMT == 0:  # FLOAT32
        c = tl.arange(0, D)
        tile = tl.load(v_ptr + slot * (B * D) + t[:, None] * D + c[None, :])
    else:
        w = tl.arange(0, D // 4)
        words = tl.load(v_ptr + slot * (B * D // 4) + t[:, None] * (D // 4) + w[None, :])
        shift = 8 * tl.arange(0, 4)
        bytes_ = (words[:, None, :] >> shift[None, :, None]) & 255  # [KC, 4, D / 4]
        tile = _fp8_values(tl.reshape(bytes_, (KC, D)), FMT)
    return tile


@triton.jit
def _v_columns(D: tl.constexpr, FMT: tl.constexpr):
    """The head-dim entry of each column of :func:`_v_tile`: in order for float32, byte by
    byte of the words for fp8 (column ``n`` holds byte ``n // (D / 4)`` of word ``n % (D / 4)``)."""
    n = tl.arange(0, D)
    if FMT != 0:
        n = 4 * (n % (D // 4)) + n // (D // 4)
    return n


@triton.jit(do_not_specialize=["num_heads", "width"],
            do_not_specialize_on_alignment=["slots_ptr", "first_ptr", "tokens_ptr"])
def _scores_kernel(q_ptr, qsq_ptr, k_ptr, slots_ptr, first_ptr, tokens_ptr, scores_ptr,
                   largest_ptr, num_heads, width, HB: tl.constexpr, B: tl.constexpr,
                   D: tl.constexpr, KC: tl.constexpr, FMT: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2) * HB + tl.arange(0, HB)
    t = tl.arange(0, B)
    seg = r.to(tl.int64) * width + j
    slot = tl.load(slots_ptr + seg)
    valid = (t >= tl.load(first_ptr + seg)) & (t < tl.load(tokens_ptr + seg))
    heads = h < num_heads
    q_row = (r.to(tl.int64) * num_heads + h[:, None]) * D
    logits = tl.zeros((HB, B), dtype=tl.float64)
    sums = tl.zeros((HB, B), dtype=tl.float32)
    for c0 in tl.static_range(0, D, KC):  # the head dim in chunks, k loaded transposed
        c = c0 + tl.arange(0, KC)
        q = tl.load(q_ptr + q_row + c[None, :], mask=heads[:, None], other=0.0)
        q_sq = tl.load(qsq_ptr + q_row + c[None, :], mask=heads[:, None], other=0.0)
        k = _k_tile(k_ptr, slot, t, c0, B, D, KC, FMT)
        logits += tl.dot(q, k.to(tl.float64))
        sums += tl.dot(q_sq, k * k, input_precision="ieee")
    logits = tl.where(valid[None, :], logits, float("-inf"))
    out_at = (r.to(tl.int64) * num_heads + h[:, None]) * (width * B) + j * B + t[None, :]
    tl.store(scores_ptr + out_at, logits, mask=heads[:, None])
    largest = tl.max(tl.where(valid[None, :], sums, -1.0), axis=1)
    tl.store(largest_ptr + (r.to(tl.int64) * num_heads + h) * width + j, largest, mask=heads)


@triton.jit(do_not_specialize=["num_heads", "width"],
            do_not_specialize_on_alignment=["slots_ptr"])
def _values_kernel(probs_ptr, v_ptr, slots_ptr, out_ptr, abs_ptr, num_heads, width,
                   HB: tl.constexpr, B: tl.constexpr, D: tl.constexpr, KC: tl.constexpr,
                   FMT: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2) * HB + tl.arange(0, HB)
    c = _v_columns(D, FMT)
    heads = h < num_heads
    slot = tl.load(slots_ptr + r.to(tl.int64) * width + j)
    p_row = (r.to(tl.int64) * num_heads + h[:, None]) * (width * B) + j * B
    acc = tl.zeros((HB, D), dtype=tl.float64)
    block = tl.zeros((HB, D), dtype=tl.float32)  # this 128-token block's sum p |v|
    for t0 in tl.static_range(0, B, KC):  # the block's tokens in chunks
        t = t0 + tl.arange(0, KC)
        p = tl.load(probs_ptr + p_row + t[None, :], mask=heads[:, None], other=0.0)
        v = _v_tile(v_ptr, slot, t, B, D, KC, FMT)
        acc += tl.dot(p, v.to(tl.float64))
        block += tl.dot(p.to(tl.float32), tl.abs(v), input_precision="ieee")
    out_at = ((r.to(tl.int64) * num_heads + h[:, None]) * width + j) * D + c[None, :]
    tl.store(out_ptr + out_at, acc, mask=heads[:, None])
    tl.store(abs_ptr + out_at, block, mask=heads[:, None])


def scores_and_largest(query: torch.Tensor, query_sq: torch.Tensor, k: Stored,
                       slots: torch.Tensor, first: torch.Tensor, tokens: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, H, width * B]`` float64 unscaled logits ``q . k`` (``-inf`` where masked) and
    ``[R, H, width]`` float32 largest ``q^2 . k^2`` of rows ``query`` (``[R, H, D]``,
    float64) over the blocks ``k[slots]`` (:func:`readable`), each block's tokens
    ``first <= t < tokens`` attended (:class:`~difftest.inputs.case_data.Segments`)."""
    rows, heads, dim = query.shape
    width, block = slots.shape[1], k.values.shape[1]
    scores = torch.empty((rows, heads, width * block), dtype=torch.float64, device=query.device)
    largest = torch.empty((rows, heads, width), dtype=torch.float32, device=query.device)
    grid = (rows, width, triton.cdiv(heads, HEADS))
    _scores_kernel[grid](query, query_sq, k.values, slots, first, tokens, scores, largest,
                         heads, width, HB=HEADS, B=block, D=dim, KC=CHUNK, FMT=k.fmt)
    return scores, largest


def weighted_values(probs: torch.Tensor, v: Stored, slots: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, head and 128-token segment, ``sum p v`` (float64) and ``sum p |v|``
    (float32), ``[R, H, width, D]``, of ``probs`` ``[R, H, width * B]`` over ``v[slots]``
    (:func:`readable`); the caller adds the segments in float64. ``probs`` may be a view
    (the reference's weights beside a sink are a slice): the kernel reads a contiguous
    copy."""
    probs = probs.contiguous()
    rows, heads, _ = probs.shape
    width, block, dim = slots.shape[1], v.values.shape[1], v.head_dim
    out = torch.empty((rows, heads, width, dim), dtype=torch.float64, device=probs.device)
    abs_out = torch.empty((rows, heads, width, dim), dtype=torch.float32, device=probs.device)
    grid = (rows, width, triton.cdiv(heads, HEADS))
    _values_kernel[grid](probs, v.values, slots, out, abs_out, heads, width, HB=HEADS, B=block,
                         D=dim, KC=min(CHUNK, block), FMT=v.fmt)
    return out, abs_out
