"""Counter-based random numbers that are bit-identical on every device.

Each value is a pure function of ``(seed, stream, index)`` computed with 32-bit integer
arithmetic, so the CPU and any GPU produce the same bits, and a block's data does not depend
on which other blocks a case uses. Floats are built without transcendental functions:
uniforms are ``k * 2**-24`` and normals are the Irwin-Hall sum of four 16-bit uniforms,
rescaled to unit variance (every step exact or correctly rounded in float32).

On the CPU the arithmetic runs as torch int64 ops (no product exceeds 2**63); on a GPU one
fused Triton kernel does the same uint32 arithmetic (``tests/gpu`` checks the bits agree).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_C1, _C2, _C3 = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F
_SALT = 0x165667B1
_SQRT3 = 1.7320508075688772


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for ``h < 2**32`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser (MurmurHash3 ``fmix32``)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def _mix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * _C1) & _MASK32
    h ^= h >> 13
    h = (h * _C2) & _MASK32
    return h ^ (h >> 16)


def stream_key(seed: int, stream: int) -> int:
    """The 32-bit key of one ``(seed, stream)`` pair."""
    h = (seed ^ (seed >> 32) ^ (stream * 0x9E3779B9)) & _MASK32
    return _mix32_int(_mix32_int(h) ^ ((seed >> 32) & _MASK32))


def hash64(seed: int, stream: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit hashes of ``index`` (int64, values below 2**48) under ``(seed, stream)``."""
    key = stream_key(seed, stream)
    first = _mix32((index & _MASK32) ^ key ^ _mul32(index >> 32, _C3))
    return first, _mix32(first ^ (key >> 1) ^ _SALT)


def uniform(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in ``[0, 1)`` with 24 random bits."""
    first, _ = hash64(seed, stream, index)
    return (first >> 8).to(torch.float32) * (2.0**-24)


def normal(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Approximately standard-normal float32 values: Irwin-Hall of four 16-bit uniforms."""
    first, second = hash64(seed, stream, index)
    total = (first & 0xFFFF) + (first >> 16) + (second & 0xFFFF) + (second >> 16)
    # Each uniform is (k + 0.5) / 2**16; the sum is exact in float32.
    return ((total.to(torch.float32) + 2.0) * (2.0**-16) - 2.0) * _SQRT3


def normal_rows(seed: int, stream: int, rows: torch.Tensor, row_length: int) -> torch.Tensor:
    """``normal`` of ``rows[:, None] * row_length + arange(row_length)``, ``[len(rows), L]``.

    Fused in one Triton kernel on GPUs; the same bits as the torch ops on the CPU.
    """
    if rows.device.type == "cuda":
        from difftest._counter_rng_triton import normal_rows_triton

        return normal_rows_triton(stream_key(seed, stream), rows, row_length)
    index = rows.view(-1, 1) * row_length + torch.arange(row_length, device=rows.device)
    return normal(seed, stream, index)
