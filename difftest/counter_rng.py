"""Counter-based random numbers that are bit-identical on every device.

Each value is a pure function of ``(seed, stream, index)`` computed with 32-bit integer
arithmetic held in int64 tensors (no product exceeds 2**63), so the CPU and any GPU produce
the same bits, and a block's data does not depend on which other blocks a case uses.
Floats are built without transcendental functions: uniforms are ``k * 2**-24`` and normals
are the Irwin-Hall sum of four 16-bit uniforms, rescaled to unit variance.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for ``h < 2**32`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser (MurmurHash3 ``fmix32``)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _key(seed: int, stream: int) -> int:
    h = torch.tensor([(seed ^ (seed >> 32) ^ (stream * 0x9E3779B9)) & _MASK32], dtype=torch.int64)
    return int(_mix32(_mix32(h) ^ ((seed >> 32) & _MASK32)).item())


def hash64(seed: int, stream: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit hashes of ``index`` (int64, values below 2**48) under ``(seed, stream)``."""
    key = _key(seed, stream)
    first = _mix32((index & _MASK32) ^ key ^ _mul32(index >> 32, 0x27D4EB2F))
    return first, _mix32(first ^ (key >> 1) ^ 0x165667B1)


def uniform(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in ``[0, 1)`` with 24 random bits."""
    first, _ = hash64(seed, stream, index)
    return (first >> 8).to(torch.float32) * (2.0**-24)


def normal(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Approximately standard-normal float32 values: Irwin-Hall of four 16-bit uniforms."""
    first, second = hash64(seed, stream, index)
    total = (first & 0xFFFF) + (first >> 16) + (second & 0xFFFF) + (second >> 16)
    # Each uniform is (k + 0.5) / 2**16; the sum is exact in float32.
    return ((total.to(torch.float32) + 2.0) * (2.0**-16) - 2.0) * 1.7320508075688772
