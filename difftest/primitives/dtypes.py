"""Names of the dtypes a case may use, their torch types, unit roundoff and underflow."""

from __future__ import annotations

import torch

QUERY_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
KV_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz")
FP8_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float8_e4m3fnuz")

# Unit roundoff u = 2^-p, p = significand bits including the implicit bit
# (Higham 2002, sec. 2.2; OCP OFP8 1.1 for e4m3: p = 4).  "tfloat32" is the
# matrix units' float32 mode (10 explicit mantissa bits).
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tfloat32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e4m3fnuz": 2.0**-4,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (one of the names above)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The inverse of :func:`torch_dtype`: ``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def is_fp8(name: str) -> bool:
    """Whether ``name`` is one of the fp8 KV dtypes."""
    return name in FP8_DTYPES


def finite_max(name: str) -> float:
    """The largest finite value of the dtype called ``name``."""
    return float(torch.finfo(torch_dtype(name)).max)


def unit_roundoff(name: str) -> float:
    """Unit roundoff of the dtype called ``name``."""
    return UNIT_ROUNDOFF[name]


def underflow_unit(name: str) -> float:
    """Half the smallest subnormal of the dtype called ``name``: the absolute error of
    rounding a value below its normal range (Higham 2002, thm. 2.3, ``fl(x) = x(1+d) + e``,
    ``|e| <= this``). ``tfloat32`` has float32's exponent range."""
    info = torch.finfo(torch_dtype("float32" if name == "tfloat32" else name))
    return float(info.smallest_normal * info.eps) / 2


def smallest_normal(name: str) -> float:
    """The smallest positive normal value of the dtype called ``name`` (``tfloat32``:
    float32's): what a flush-to-zero stage may turn into 0."""
    return float(torch.finfo(torch_dtype("float32" if name == "tfloat32" else name)).tiny)
