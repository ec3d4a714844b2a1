"""The GPU kernel behind :func:`difftest.counter_rng.normal_rows`.

The arithmetic is the torch version's, op for op: int64 lanes holding 32-bit values, each
product masked to its low 32 bits (they are right even if the 64-bit product wraps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _normal_rows_kernel(out_ptr, rows_ptr, key_ptr, row_length, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_length
    index = tl.load(rows_ptr + r).to(tl.int64) * row_length + offs
    k = tl.load(key_ptr)  # int64; a scalar argument >= 2**31 would be typed uint32
    first = _mix32((index & 0xFFFFFFFF) ^ k ^ (((index >> 32) * 0x27D4EB2F) & 0xFFFFFFFF))
    second = _mix32(first ^ (k >> 1) ^ 0x165667B1)
    total = (first & 0xFFFF) + (first >> 16) + (second & 0xFFFF) + (second >> 16)
    value = ((total.to(tl.float32) + 2.0) * (1.0 / 65536.0) - 2.0) * 1.7320508075688772
    tl.store(out_ptr + r.to(tl.int64) * row_length + offs, value, mask=mask)


def normal_rows_triton(key: int, rows: torch.Tensor, row_length: int) -> torch.Tensor:
    """Fused ``normal_rows`` on a GPU."""
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty((rows.numel(), row_length), dtype=torch.float32, device=rows.device)
    if rows.numel():
        grid = (rows.numel(), triton.cdiv(row_length, 1024))
        key_tensor = torch.tensor([key], dtype=torch.int64, device=rows.device)
        _normal_rows_kernel[grid](out, rows, key_tensor, row_length, BLOCK=1024)
    return out
