"""The tolerance model: relative rounding per stage, plus the output dtype's underflow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftest.backend import Precision
from difftest.backends.torch_ref import TorchReference
from difftest.casefile import read_case
from difftest.dtypes import underflow_unit
from difftest.registry import discover
from difftest.runner import Status, run_case
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


def test_logits_moved_far_move_weights_exponentially_and_the_bound_follows() -> None:
    """F15: a row dominated by one token whose value is 0; every logit moved by ``delta``
    (the bound's logit error) multiplies the other weights by up to ``exp(2 delta)``. The
    exact change stays inside the bound, which a linear ``2 delta`` term would not cover."""
    logits = torch.tensor([0.0, -25.0, -27.0], dtype=torch.float64)
    values = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    p = torch.softmax(logits, 0)
    precision = Precision("float16", "float16", "float32")
    delta = 2 * 2.0**-11 * 3.0 * 900.0  # the tolerance's logit error for magnitude 900: 2.64
    moved = torch.softmax(logits + torch.tensor([-delta, delta, delta], dtype=torch.float64), 0)
    error = float((moved - p) @ values)
    out = (p @ values).reshape(1, 1, 1)
    reference = Reference(out, (p @ values.abs()).reshape(1, 1, 1),
                          torch.full((1, 1), 900.0, dtype=torch.float64),
                          torch.ones(1, dtype=torch.int32))
    bound = float(Tolerance(precision).bound(reference))
    linear = FACTOR * 2 * delta * float(reference.abs_output)
    assert linear < abs(error) <= bound


def test_the_emulated_aiter_paths_agree_on_the_f15_case() -> None:
    """The stretch's case (docs/data/fp-emulator-fp8-probability-underflow.json): the
    kernel's fp8 rounding of q moves logits of magnitude 147 by up to 4.9 and multiplies the
    non-dominant weights by 5000; within the corrected bound."""
    case = read_case(Path(__file__).parents[1] / "docs/data"
                     / "fp-emulator-fp8-probability-underflow.json")
    backend = discover()["aiter-gluon@emulated"]
    result = run_case(case, TorchReference(), [backend], torch.device("cpu"))
    assert result.results[0].status is Status.AGREE, result.results[0].detail


def test_inputs_already_of_the_operand_dtype_are_not_charged_a_rounding() -> None:
    """An fp8 cache read by fp8 operands is exact; a bf16 query cast to fp8 is rounded; fp8
    queries (``q_scale``) are charged both sides. The charged logit error follows."""
    case = read_case(Path(__file__).parents[1] / "docs/data"
                     / "fp-emulator-fp8-probability-underflow.json")
    fp8 = Precision(case.kv_dtype, case.kv_dtype, "bfloat16")
    cast = Tolerance.of(fp8, case)
    assert (cast.rounds_query, cast.rounds_kv) == (True, False)
    quantized = Tolerance.of(fp8, case.replace(q_scale=2.0))
    assert quantized.rounds_query and quantized.rounds_kv
    assert Tolerance.of(Precision("float16", "float16", "float16"),
                        case.replace(query_dtype="float16")).rounds_kv  # fp8 -> fp16 dequantised
    reference = Reference(torch.zeros(1, 1, 1, dtype=torch.float64),
                          torch.ones(1, 1, 1, dtype=torch.float64),
                          torch.full((1, 1), 2.0, dtype=torch.float64),
                          torch.ones(1, dtype=torch.int32))
    exact = Tolerance(fp8, rounds_query=False, rounds_kv=False)
    charged = [float(t.bound(reference)) for t in (quantized, Tolerance.of(fp8, case), exact)]
    assert charged[0] > charged[1] > charged[2]
    assert abs(charged[2] - FACTOR * (2.0**-4 + underflow_unit("bfloat16"))) < 1e-12


@pytest.mark.parametrize("backend", ["triton-unified", "vllm-triton-sparse"])
def test_float32_operands_are_charged_both_sides(backend: str) -> None:
    """The CPU stretch's two disagreements when exact float32 queries were charged no
    rounding (error/tolerance 1.11 and 1.02: float32 accumulation, not a bug): both agree."""
    case = read_case(Path(__file__).parents[1] / f"docs/data/fp-fp32-operands-{backend}.json")
    precision = Precision("float32", "float32", "float32")
    assert Tolerance.of(precision, case) == Tolerance(precision)
    result = run_case(case, TorchReference(), [discover()[backend]], torch.device("cpu"))
    assert result.results[0].status is Status.AGREE, result.results[0].detail
