"""The tolerance model: relative rounding per stage, plus the output dtype's underflow."""

from __future__ import annotations

import torch

from difftest.backend import Precision
from difftest.dtypes import underflow_unit
from difftest.tolerance import FACTOR, Reference, Tolerance


def _reference(value: float) -> Reference:
    out = torch.full((1, 1, 1), value, dtype=torch.float64)
    return Reference(out, out.abs(), torch.zeros(1, 1, dtype=torch.float64),
                     torch.ones(1, dtype=torch.int32))


def test_an_output_below_fp16s_range_may_round_to_zero() -> None:
    """-1.09e-10 stored as float16 is -0 (seen from vllm-triton-sparse): within tolerance."""
    tolerance = Tolerance(Precision("float16", "float16", "float16"))
    bound = float(tolerance.bound(_reference(-1.08541e-10)))
    assert bound >= 1.08541e-10
    assert underflow_unit("float16") == 2.0**-25
    assert bound < FACTOR * (2.0**-25 + 1e-12)  # the floor is fp16's underflow, no more


def test_normal_range_outputs_keep_a_relative_bound() -> None:
    tolerance = Tolerance(Precision("float16", "float16", "float16"))
    bound = float(tolerance.bound(_reference(1.0)))
    assert abs(bound - FACTOR * (3 * 2.0**-11 + 2.0**-25)) < 1e-15
