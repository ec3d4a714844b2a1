"""Per-element tolerances derived from a backend's declared rounding stages.

Error model (after vLLM's ``rocm_aiter_tolerances.py``): the output is a convex combination
``o = sum_i p_i v_i``, computed with fp32 accumulation, so a correct kernel's residual
against the float64 reference comes from its rounding stages, each bounded by that dtype's
unit roundoff ``u``:

* rounding the probabilities to ``probabilities`` and V to ``operands`` perturbs each term
  by a relative ``u``: ``|err| <= (u_p + u_op) * sum_i p_i |v_i|``;
* rounding q and K to ``operands`` perturbs each logit by at most about
  ``delta = 2 u_op * ||q o k_i||_2 * softmax_scale`` (``u_op`` once per rounded side; the
  probabilistic bound of Higham & Mary for a length-D product, at ``LOGIT_SIGMAS`` standard
  deviations). Logits moved by at most ``delta`` move each probability by a factor within
  ``exp(+-2 delta)``, so its relative error is at most ``expm1(2 delta)``: not ``2 delta``,
  which only holds while ``delta`` is small. On a row dominated by one token whose logits
  reach a hundred (fp8 operands, large scales), the kernel's rounding of q legitimately
  multiplies the other weights by thousands (docs/findings.md F15); such a row is only
  checked loosely, as its conditioning demands;
* storing the output rounds it by ``u_out * |o| + eta_out``, where ``eta_out`` is half the
  output dtype's smallest subnormal: an output below the normal range (fp16 below 6.1e-5)
  keeps only an absolute accuracy, and one below ``eta_out`` rounds to zero.

A q or K/V that is already of the ``operands`` dtype reaches the products unrounded (a scale
is then applied outside them: to the logits or to the output), so its terms drop out:
:meth:`Tolerance.of` sees which from the case (an fp8 cache read by an fp8 kernel is exact);
fp8 queries (``q_scale``) are still charged both sides: the adapter hands the kernel the
exact fp8 query, yet on the H200 charging neither gave 7 disagreements (error/tolerance up to
5.3) in 2000 correct examples, all fp8-query cases of ``triton-unified``; fp8 tensor-core
dots on Hopper accumulate with reduced precision (DeepSeek-V3's report), which the model does
not have a term for. Float32 operands are charged both sides too: their float32 products,
sums and exponentials err by about as much as the rounding, so the rounding terms stand in for
them (on the CPU, charging neither gave 2 disagreements, error/tolerance 1.02 and 1.11, in 2000
correct examples). A bare ``Tolerance(precision)`` charges both.

The tolerance of element ``e`` is ``FACTOR`` times that sum. It never depends on sequence
length (the accumulation is fp32 and the data is zero-mean), and it needs no atol floor
beyond ``eta_out`` because ``sum_i p_i |v_i| > 0`` on every attended row. The reference
dequantises the very values the kernel reads, so fp8 storage error cancels and is not in
the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftest.backend import Precision, Reference
from difftest.case import Case
from difftest.dtypes import underflow_unit, unit_roundoff

FACTOR = 3.0
LOGIT_SIGMAS = 3.0


@dataclass(frozen=True)
class Tolerance:
    """The budget of one backend's precision; :meth:`bound` gives it per element."""

    precision: Precision
    factor: float = FACTOR
    rounds_query: bool = True  # q is rounded to ``precision.operands``
    rounds_kv: bool = True  # the stored K/V are rounded to ``precision.operands``

    @classmethod
    def of(cls, precision: Precision, case: Case) -> Tolerance:
        """The tolerance of ``precision`` on ``case``: q and K/V already of the operand dtype
        are not charged a rounding."""
        if case.q_scale or unit_roundoff(precision.operands) <= unit_roundoff("float32"):
            return cls(precision)  # fp8 x fp8 dots on GPUs; float32 accumulation error
        return cls(precision, rounds_query=case.query_dtype != precision.operands,
                   rounds_kv=case.kv_dtype != precision.operands)

    def bound(self, reference: Reference) -> torch.Tensor:
        """Allowed ``|actual - expected|`` for every element, float64."""
        u_op = unit_roundoff(self.precision.operands)
        u_p = unit_roundoff(self.precision.probabilities)
        u_out = unit_roundoff(self.precision.output)
        rounded = int(self.rounds_query) + int(self.rounds_kv)
        logit_err = rounded * u_op * LOGIT_SIGMAS * reference.logit_magnitude
        weight_err = (u_p + self.rounds_kv * u_op
                      + torch.expm1(2 * logit_err[..., None]))
        budget = (weight_err * reference.abs_output + u_out * reference.output.abs()
                  + underflow_unit(self.precision.output))
        return self.factor * budget

    def describe(self) -> str:
        """One line naming the stages and their unit roundoffs."""
        p = self.precision
        return (f"tolerance = {self.factor:g} x rounding budget of operands {p.operands} "
                f"(u={unit_roundoff(p.operands):.2e}), probabilities {p.probabilities} "
                f"(u={unit_roundoff(p.probabilities):.2e}), output {p.output} "
                f"(u={unit_roundoff(p.output):.2e})")
