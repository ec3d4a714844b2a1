"""The GPU kernels behind :func:`difftest.primitives.counter_rng.normal_rows` and
:func:`difftest.primitives.counter_rng.stored_normal_rows`.

The arithmetic is the torch version's, op for op, in uint32 lanes: the torch version holds
32-bit values in int64 and masks each product to its low 32 bits, which a uint32 product
is (the 64-bit multiplies it spares are most of the kernel's time on a GPU). The
stored variant quantises in the same kernel as :func:`difftest.inputs.case_data.quantize` does on
the CPU: a correctly rounded float32 division by the scale (``div_rn``; CUDA's ``/`` and a
division by a scalar are not, F18), saturation at the format's maximum, and a
round-to-nearest-even cast.

The kernel compiles once per output dtype and quantisation: the key is never specialized on,
nor the rows' alignment (a view at any offset); the row length keeps its divisibility by 16,
which every case's has (head sizes are multiples of 16) and which lets the stores vectorise
(tests/test_kernel_specializations.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
# the stored dtypes the fused cast writes (fp8 e4m3fn: Hopper's cvt.rn.satfinite, after the
# clamp an exact RNE cast); others are cast by torch after the fused draw and division
_CAST = {torch.float8_e4m3fn: tl.float8e4nv, torch.bfloat16: tl.bfloat16,
         torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _mix32(h):
    """The murmur3 finaliser on uint32 lanes (products wrap mod 2**32; shifts are logical)."""
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["key"], do_not_specialize_on_alignment=["rows_ptr"])
def _normal_rows_kernel(out_ptr, rows_ptr, key, divisor, limit, row_length,
                        QUANTIZE: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_length
    index = tl.load(rows_ptr + r).to(tl.int64) * row_length + offs
    low = (index & 0xFFFFFFFF).to(tl.uint32)
    high = (index >> 32).to(tl.uint32)  # index < 2**48
    k = key.to(tl.uint32, bitcast=True)  # the 32-bit key, passed as a signed int32
    first = _mix32(low ^ k ^ (high * tl.full(high.shape, 0x27D4EB2F, tl.uint32)))
    second = _mix32(first ^ (k >> 1) ^ tl.full(first.shape, 0x165667B1, tl.uint32))
    total = ((first & 0xFFFF) + (first >> 16) + (second & 0xFFFF) + (second >> 16)).to(tl.int32)
    value = ((total.to(tl.float32) + 2.0) * (1.0 / 65536.0) - 2.0) * 1.7320508075688772
    if QUANTIZE:
        value = tl.math.div_rn(value, divisor)
        value = tl.minimum(tl.maximum(value, -limit), limit)
    tl.store(out_ptr + r.to(tl.int64) * row_length + offs, value.to(OUT), mask=mask)


def _launch(key: int, rows: torch.Tensor, row_length: int, dtype: torch.dtype,
            scale: float | None, limit: float) -> torch.Tensor:
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty((rows.numel(), row_length), dtype=dtype, device=rows.device)
    if rows.numel():
        grid = (rows.numel(), triton.cdiv(row_length, _BLOCK))
        # scalars, no host-to-device copy (which would wait for the device): the divisor is
        # typed float32, the scale rounded to it as the CPU's division rounds it; the key
        # always as int32 (a key from 2**31 would be typed uint32, another compilation)
        signed = key - (1 << 32) if key >= 1 << 31 else key
        _normal_rows_kernel[grid](out, rows, signed, scale or 1.0, limit, row_length,
                                  QUANTIZE=scale is not None, OUT=_CAST[dtype], BLOCK=_BLOCK)
    return out


def normal_rows_triton(key: int, rows: torch.Tensor, row_length: int) -> torch.Tensor:
    """Fused ``normal_rows`` on a GPU."""
    return _launch(key, rows, row_length, torch.float32, None, 0.0)


def stored_normal_rows_triton(key: int, rows: torch.Tensor, row_length: int,
                              dtype: torch.dtype, scale: float | None,
                              limit: float) -> torch.Tensor:
    """Fused ``normal_rows`` stored in ``dtype``: divided by ``scale`` and saturated at
    ``limit`` first when ``scale`` is given (fp8), else only cast."""
    if dtype in _CAST and (dtype != torch.float8_e4m3fn or _native_e4m3(rows.device)):
        return _launch(key, rows, row_length, dtype, scale, limit)
    # fnuz has no NVIDIA conversion, and OCP fp8 is converted in software before sm_89 and on
    # ROCm (unchecked against the CPU here): the fused draw and division, then torch's cast
    return _launch(key, rows, row_length, torch.float32, scale, limit).to(dtype)


def _native_e4m3(device: torch.device) -> bool:
    """Whether Triton casts float32 to fp8 e4m3fn with the hardware's RNE instruction."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)
