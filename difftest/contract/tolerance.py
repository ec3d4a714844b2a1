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
  deviations), plus ``sqrt(D) u_32`` for the dot's float32 sum of D products (negligible
  beside a 16-bit rounding; for float32 operands the larger term). Logits moved by at most
  ``delta`` move each probability by a factor within ``exp(+-2 delta)``, so its relative
  error is at most ``expm1(2 delta)``: not ``2 delta``, which only holds while ``delta`` is
  small. On a row dominated by one token whose logits
  reach a hundred (fp8 operands, large scales), the kernel's rounding of q legitimately
  multiplies the other weights by thousands (docs/findings.md F15); such a row is only
  checked loosely, as its conditioning demands;
* the float32 sums of ``n`` terms (the numerator and ``L``) err by about ``sqrt(n) u_32`` of
  their terms' magnitudes (Higham & Mary's probabilistic bound): ``sqrt(n) u_32 (A + |o|)``,
  negligible beside a 16-bit stage, the largest term of a float32 row past a few tokens;
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
not have a term for. Float32 operands are charged both sides too: their float32 products and
exponentials err by about as much as the rounding, so the rounding terms stand in for them
(on the CPU, charging neither gave 2 disagreements, error/tolerance 1.02 and 1.11, in 2000
correct examples); their sums have terms of their own (above). A bare
``Tolerance(precision)`` charges both.

Below float32's normal range a rounding is absolute, not relative (``fl(x) = x(1+d) + e``,
``|e| <= eta``, Higham thm. 2.3), so an output made of subnormal terms needs the stages that
can produce subnormals charged by count: each float32 product ``p_i v_i``, each rescaling
(online softmax, split-K segments) and the normalisation, ``3 n + 1`` for ``n`` attended
tokens, in the units of the accumulator (times ``v_scale`` where a kernel applies it after);
and each weight rounded below the normal range of a probability format with float32's
exponent range, ``eta_p n V`` (``V``: :data:`VALUE_BOUND`); float16 weights, whose normal
range ends at 6.1e-5, by their random-sign sum, ``eta_p sqrt(n) V``. The derivation and what
it does not charge: docs/tolerance.md.

The tolerance of element ``e`` is ``FACTOR`` times that sum. Its relative part never depends
on sequence length (the accumulation is fp32 and the data is zero-mean); its absolute floor
is the underflow above. The reference dequantises the very values the kernel reads, so fp8
storage error cancels and is not in the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from difftest.case.spec import Case
from difftest.contract.backend import Precision, Reference
from difftest.primitives.dtypes import is_fp8, underflow_unit, unit_roundoff

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

    @classmethod
    def of(cls, precision: Precision, case: Case) -> Tolerance:
        """The tolerance of ``precision`` on ``case``: q and K/V already of the operand dtype
        are not charged a rounding (q is, where the softmax scale is applied before its
        rounding); rounded products are (one rounding each, the same error
        term as a rounded operand: docs/tolerance.md); an fp8 cache's ``v_scale`` may scale
        the accumulator."""
        scale = max(1.0, case.v_scale) if is_fp8(case.kv_dtype) else 1.0
        if case.q_scale or unit_roundoff(precision.operands) <= unit_roundoff("float32"):
            # fp8 x fp8 dots on GPUs; float32 accumulation error
            return cls(precision, accumulator_scale=scale)
        return cls(precision, rounds_query=(case.query_dtype != precision.operands
                                            or precision.scaled_query_rounded),
                   rounds_kv=case.kv_dtype != precision.operands,
                   rounds_products=precision.rounded_products, accumulator_scale=scale)

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
        weight_err = (u_p + self.rounds_kv * u_op
                      + torch.expm1(2 * logit_err[..., None]))
        # the float32 sums of the numerator and of L over n terms (docs/tolerance.md)
        sums = u_32 * reference.context_lens.to(torch.float64).sqrt()
        budget = (weight_err * reference.abs_output + u_out * reference.output.abs()
                  + sums[:, None, None] * (reference.abs_output + reference.output.abs())
                  + self.underflow(reference.context_lens)[:, None, None])
        return self.factor * budget

    def underflow(self, context_lens: torch.Tensor) -> torch.Tensor:
        """The absolute budget of the roundings below the normal range, per row of
        ``context_lens`` attended tokens, float64 (docs/tolerance.md)."""
        n = context_lens.to(torch.float64)
        stages = underflow_unit("float32") * self.accumulator_scale * (3 * n + 1)
        p = self.precision.probabilities
        if p in _FLOAT32_RANGE:
            weights = underflow_unit(p) * VALUE_BOUND * n
        elif p == "float16":  # errors of random sign: their sum grows as sqrt(n)
            weights = underflow_unit(p) * VALUE_BOUND * n.sqrt()
        else:
            weights = torch.zeros_like(n)
        return stages + weights + underflow_unit(self.precision.output)

    def describe(self) -> str:
        """One line naming the stages and their unit roundoffs."""
        p = self.precision
        return (f"tolerance = {self.factor:g} x rounding budget of operands {p.operands} "
                f"(u={unit_roundoff(p.operands):.2e}), probabilities {p.probabilities} "
                f"(u={unit_roundoff(p.probabilities):.2e}), output {p.output} "
                f"(u={unit_roundoff(p.output):.2e})")
