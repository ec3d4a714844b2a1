"""Counter-based random numbers that are bit-identical on every device.

Each value is a pure function of ``(seed, stream, index)`` computed with 32-bit integer
arithmetic, so the CPU and any GPU produce the same bits, and a block's data does not depend
on which other blocks a case uses. Floats are built without transcendental functions:
uniforms are ``k * 2**-24`` and normals are the Irwin-Hall sum of four 16-bit uniforms,
rescaled to unit variance (every step exact or correctly rounded in float32).

On the CPU the hashing runs in numpy uint32, whose multiplication wraps exactly mod 2**32,
chunk by chunk so that each chunk stays in cache (30 times faster than the torch int64 ops
it replaced, the same bits: ``tests/test_counter_rng.py`` pins them); on a GPU the hashing
runs as torch int64 ops (no product exceeds 2**63), and ``normal_rows`` as one fused Triton
kernel of the same arithmetic (``tests/test_device_determinism.py`` checks the bits agree).
"""

from __future__ import annotations

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_C1, _C2, _C3 = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F
_SALT = 0x165667B1
_SQRT3 = 1.7320508075688772
_CHUNK = 1 << 16  # values hashed per numpy pass on the CPU (a few L2-sized arrays)


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


def _mix32_numpy(h: np.ndarray) -> None:
    """``_mix32`` in place on a uint32 array (its multiplications wrap mod 2**32)."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(_C1)
    h ^= h >> np.uint32(13)
    h *= np.uint32(_C2)
    h ^= h >> np.uint32(16)


def _cpu_words(key: int, index: np.ndarray, normal: bool) -> np.ndarray:
    """``hash64`` of an int64 array, reduced as ``uniform`` (``first >> 8``) or ``normal``
    (the sum of the four 16-bit halves) need it: uint32, chunk by chunk."""
    flat = index.reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint32)
    k1, k2 = np.uint32(key), np.uint32((key >> 1) ^ _SALT)
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start:start + _CHUNK]
        first = (chunk & _MASK32).astype(np.uint32)
        high = (chunk >> 32).astype(np.uint32)
        high *= np.uint32(_C3)
        first ^= k1
        first ^= high
        _mix32_numpy(first)
        if normal:
            second = first ^ k2
            _mix32_numpy(second)
            first = (first & np.uint32(0xFFFF)) + (first >> np.uint32(16)) + (
                second & np.uint32(0xFFFF)) + (second >> np.uint32(16))
        else:
            first >>= np.uint32(8)
        out[start:start + chunk.size] = first
    return out.reshape(index.shape)


def _cpu_row_words(key: int, rows: torch.Tensor, row_length: int, normal: bool) -> torch.Tensor:
    """:func:`_cpu_words` of ``rows[:, None] * row_length + arange(row_length)``, built a few
    rows at a time (the whole index would be 8 bytes a value), as an int32 tensor."""
    rows_np = rows.to(torch.int64).numpy()
    out = np.empty((rows_np.size, row_length), dtype=np.uint32)
    offsets = np.arange(row_length, dtype=np.int64)
    per = max(1, _CHUNK // max(row_length, 1))
    for start in range(0, rows_np.size, per):
        index = rows_np[start:start + per, None] * row_length + offsets
        out[start:start + per] = _cpu_words(key, index, normal)
    return torch.from_numpy(out.view(np.int32))  # every word is below 2**24


def _uniform_of_words(words: torch.Tensor) -> torch.Tensor:
    return words.to(torch.float32) * (2.0**-24)


def _normal_of_words(total: torch.Tensor) -> torch.Tensor:
    # Each uniform is (k + 0.5) / 2**16; the sum is exact in float32.
    return ((total.to(torch.float32) + 2.0) * (2.0**-16) - 2.0) * _SQRT3


def uniform(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in ``[0, 1)`` with 24 random bits."""
    if index.device.type == "cpu":
        words = _cpu_words(stream_key(seed, stream), index.to(torch.int64).numpy(), False)
        return _uniform_of_words(torch.from_numpy(words.view(np.int32)))
    first, _ = hash64(seed, stream, index)
    return _uniform_of_words(first >> 8)


def normal(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Approximately standard-normal float32 values: Irwin-Hall of four 16-bit uniforms."""
    if index.device.type == "cpu":
        words = _cpu_words(stream_key(seed, stream), index.to(torch.int64).numpy(), True)
        return _normal_of_words(torch.from_numpy(words.view(np.int32)))
    first, second = hash64(seed, stream, index)
    return _normal_of_words((first & 0xFFFF) + (first >> 16) + (second & 0xFFFF)
                            + (second >> 16))


def uniform_rows(seed: int, stream: int, rows: torch.Tensor, row_length: int) -> torch.Tensor:
    """``uniform`` of ``rows[:, None] * row_length + arange(row_length)``, ``[len(rows), L]``."""
    if rows.device.type == "cpu":
        return _uniform_of_words(_cpu_row_words(stream_key(seed, stream), rows, row_length,
                                                False))
    index = rows.view(-1, 1) * row_length + torch.arange(row_length, device=rows.device)
    return uniform(seed, stream, index)


def normal_rows(seed: int, stream: int, rows: torch.Tensor, row_length: int) -> torch.Tensor:
    """``normal`` of ``rows[:, None] * row_length + arange(row_length)``, ``[len(rows), L]``.

    Fused in one Triton kernel on GPUs; the same bits from numpy on the CPU.
    """
    if rows.device.type == "cuda":
        from difftest.primitives._counter_rng_triton import normal_rows_triton

        return normal_rows_triton(stream_key(seed, stream), rows, row_length)
    if rows.device.type == "cpu":
        return _normal_of_words(_cpu_row_words(stream_key(seed, stream), rows, row_length,
                                               True))
    index = rows.view(-1, 1) * row_length + torch.arange(row_length, device=rows.device)
    return normal(seed, stream, index)
