"""Per-element tolerances derived from a backend's declared rounding stages.

A correct kernel's output differs from the float64 reference only by its rounding stages
(the operands, the probabilities, the float32 sums, the stored output, and the absolute
errors below the normal range); :class:`Tolerance` bounds that difference per element,
``FACTOR`` times the budget of the stages the backend's :class:`Precision` declares and the
case makes it take (:meth:`Tolerance.of`). The error model, its derivation and what it does
not charge: docs/tolerance.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from difftest.case.spec import Case
from difftest.contract.backend import Precision, Reference
from difftest.primitives.dtypes import (
    finite_max,
    is_fp8,
    smallest_normal,
    underflow_unit,
    unit_roundoff,
)

FACTOR = 3.0
LOGIT_SIGMAS = 3.0
# |v| of every value a case attends, in real units: the generator's largest draw (an
# outlier, 8 x the Irwin-Hall bound 2 sqrt(3); difftest.primitives.counter_rng,
# difftest.inputs.case_data) after storage rounding (fp8: 2^-4, then times the scale in float32:
# 2^-24; bf16/fp16 less)
VALUE_BOUND = 8 * 2 * math.sqrt(3) * (1 + 2.0**-4) * (1 + 2.0**-23)
# formats whose subnormals start where float32's do (their weights underflow at 2^-126)
_FLOAT32_RANGE = ("float32", "tfloat32", "bfloat16")


@dataclass(frozen=True)
class Tolerance:
    """The budget of one backend's precision; :meth:`bound` gives it per element."""

    precision: Precision
    factor: float = FACTOR
    rounds_query: bool = True  # q is rounded to ``precision.operands``
    rounds_kv: bool = True  # the stored K/V are rounded to ``precision.operands``
    rounds_products: bool = False  # each q_i k_i is rounded to ``precision.operands``
    accumulator_scale: float = 1.0  # a scale a kernel may apply after accumulating (v_scale)
    # serving terms (docs/tolerance.md#serving-terms)
    output_scale: float = 1.0  # an fp8 output's real units per stored unit
    alibi: bool = False  # ALiBi's offsets: float32 logits of magnitude slope * distance
    value_bound: float = VALUE_BOUND  # |v| a rounded weight multiplies

    @classmethod
    def of(cls, precision: Precision, case: Case) -> Tolerance:
        """The tolerance of ``precision`` on ``case``: q and K/V already of the operand dtype
        are not charged a rounding (q is, where the softmax scale is applied before its
        rounding); rounded products are (one rounding each, the same error
        term as a rounded operand: docs/tolerance.md); an fp8 cache's ``v_scale`` may scale
        the accumulator."""
        scale = max(1.0, case.v_scale) if is_fp8(case.kv_dtype) else 1.0
        # per-token-head scales multiply the weights, which are rounded against the stored V
        terms = {"output_scale": case.output_scale or 1.0, "alibi": case.alibi,
                 "value_bound": (finite_max(case.kv_dtype) if case.kv_quant == "per_token_head"
                                 else VALUE_BOUND)}
        if case.q_scale or unit_roundoff(precision.operands) <= unit_roundoff("float32"):
            # fp8 x fp8 dots on GPUs; float32 accumulation error
            return cls(precision, accumulator_scale=scale, **terms)
        return cls(precision, rounds_query=(case.query_dtype != precision.operands
                                            or precision.scaled_query_rounded),
                   rounds_kv=case.kv_dtype != precision.operands,
                   rounds_products=precision.rounded_products, accumulator_scale=scale,
                   **terms)

    def bound(self, reference: Reference) -> torch.Tensor:
        """Allowed ``|actual - expected|`` for every element, float64."""
        u_op = unit_roundoff(self.precision.operands)
        u_p = unit_roundoff(self.precision.probabilities)
        u_out = unit_roundoff(self.precision.output)
        rounded = int(self.rounds_query) + int(self.rounds_kv) + int(self.rounds_products)
        u_32 = unit_roundoff("float32")
        # the operands' roundings, and the float32 sum of the dot's D products
        dot = math.sqrt(reference.output.shape[-1]) * u_32
        logit_err = (rounded * u_op + dot) * LOGIT_SIGMAS * reference.logit_magnitude
        if reference.bias_magnitude is not None:  # sinks, ALiBi: float32 additions
            logit_err = logit_err + 4 * u_32 * reference.bias_magnitude
        weight_err = (u_p + self.rounds_kv * u_op
                      + torch.expm1(2 * logit_err[..., None]))
        # the float32 sums of the numerator and of L over n terms (docs/tolerance.md)
        sums = u_32 * reference.context_lens.to(torch.float64).sqrt()
        budget = (weight_err * reference.abs_output + u_out * reference.output.abs()
                  + sums[:, None, None] * (reference.abs_output + reference.output.abs())
                  + self.underflow(reference.context_lens)[:, None, None])
        if self.alibi:  # the weights of far tokens, whose float32 logits carry large offsets
            n = reference.context_lens.to(torch.float64)
            far = (2 * reference.logit_magnitude + torch.log1p(n)[:, None])[..., None]
            budget = budget + 2 * u_32 * self.value_bound * far
        return self.factor * budget

    def underflow(self, context_lens: torch.Tensor) -> torch.Tensor:
        """The absolute budget of the roundings below the normal range, per row of
        ``context_lens`` attended tokens, float64 (docs/tolerance.md)."""
        n = context_lens.to(torch.float64)
        stages = underflow_unit("float32") * self.accumulator_scale * (3 * n + 1)
        p = self.precision.probabilities
        if p in _FLOAT32_RANGE:
            weights = underflow_unit(p) * self.value_bound * n
        elif p == "float16":  # errors of random sign: their sum grows as sqrt(n)
            weights = underflow_unit(p) * self.value_bound * n.sqrt()
        else:
            weights = torch.zeros_like(n)
        return stages + weights + self.output_floor() * self.output_scale

    def output_floor(self) -> float:
        """The absolute error of storing an output: half the output dtype's smallest
        subnormal, or, where the backend flushes subnormal outputs, its smallest normal."""
        output = self.precision.output
        if self.precision.flushes_subnormal_outputs:
            return smallest_normal(output)
        return underflow_unit(output)

    def describe(self) -> str:
        """One line naming the stages and their unit roundoffs."""
        p = self.precision
        flush = ", subnormal outputs flushed to zero" if p.flushes_subnormal_outputs else ""
        return (f"tolerance = {self.factor:g} x rounding budget of operands {p.operands} "
                f"(u={unit_roundoff(p.operands):.2e}), probabilities {p.probabilities} "
                f"(u={unit_roundoff(p.probabilities):.2e}), output {p.output} "
                f"(u={unit_roundoff(p.output):.2e}){flush}")
