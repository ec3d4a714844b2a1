"""The reference's float32 magnitudes against its float64 formulation: within the derived bound.

``float64_reference`` is ``TorchReference.reference`` of commit b6ecf3a, verbatim but for its
name and the chunk size read at call time: everything in float64. The current reference must
give the same ``output`` bit for bit (the logits, softmax and ``P V`` are unchanged) and
``abs_output`` and ``logit_magnitude`` within the bound derived in
``difftest/backends/torch_ref.py``, so that every tolerance moves by at most the relative
amount derived there.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings

from difftest.backends import torch_ref
from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import MODE_DEFAULTS, SERVING_TERM_FIELDS, Case
from difftest.contract.backend import Precision, RunInputs
from difftest.contract.tolerance import LOGIT_SIGMAS, Reference, Tolerance
from difftest.generation.corpus import load_corpus
from difftest.generation.strategies import cases
from difftest.primitives.dtypes import QUERY_DTYPES, unit_roundoff

U32, U64 = 2.0**-24, 2.0**-53
CPU = torch.device("cpu")


def float64_reference(inputs: RunInputs) -> Reference:
    """The reference as computed before the float32 magnitudes (everything in float64)."""
    case, data, device = inputs.case, inputs.data, inputs.device
    seg = data.segments
    f64 = torch.float64
    shape = (case.total_q, case.num_q_heads, case.head_dim)
    out = torch.zeros(shape, dtype=f64, device=device)
    abs_out = torch.zeros(shape, dtype=f64, device=device)
    magnitude = torch.zeros(shape[:2], dtype=f64, device=device)
    length = seg.width * case.block_size
    if length == 0:
        return Reference(out, abs_out, magnitude, seg.context_lens)
    k_stored, v_stored = data.k_stored[:, :, 0], data.v_stored[:, :, 0]  # [blocks, 128, D]
    query = data.query.to(f64)
    token = torch.arange(case.block_size, device=device)
    rows_per_chunk = max(1, torch_ref.ELEMENTS_PER_CHUNK // (length * case.head_dim))
    for start in range(0, case.total_q, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, case.total_q))
        slots = seg.slots[rows]
        n = slots.shape[0]
        # [R, width, 128]: each segment's attended tokens (the window applied)
        mask = (token >= seg.first[rows, :, None]) & (token < seg.tokens[rows, :, None])
        mask = mask.view(n, 1, length)
        k = k_stored[slots].to(f64).view(n, length, -1)  # [R, L, D] stored values
        q = query[rows]  # [R, H, D]
        scores = torch.einsum("rhd,rld->rhl", q, k) * (case.softmax_scale * case.k_scale)
        if case.softcap:
            scores = case.softcap * torch.tanh(scores / case.softcap)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        prod = torch.einsum("rhd,rld->rhl", q * q, k.square_()).sqrt()
        prod = prod * (case.softmax_scale * case.k_scale) + case.softcap
        magnitude[rows] = prod.masked_fill(~mask, 0).amax(dim=-1)
        v = v_stored[slots].to(f64).view(n, length, -1)
        out[rows] = torch.einsum("rhl,rld->rhd", probs, v) * case.v_scale
        abs_out[rows] = torch.einsum("rhl,rld->rhd", probs, v.abs_()) * case.v_scale
    return Reference(out, abs_out, magnitude, seg.context_lens)


def gamma(n: int, u: float) -> float:
    """Higham's ``n u / (1 - n u)``."""
    return n * u / (1 - n * u)


def relative_bounds(case: Case, length: int) -> tuple[float, float]:
    """``rho_A`` and ``rho_M`` of the module docstring, for sums over ``length`` tokens."""
    d = case.head_dim
    return (gamma(case.block_size + 1, U32) + 2 * gamma(length + 2, U64),
            gamma(d + 3, U32) + gamma(d + 6, U64))


def tolerance_moves_within(case: Case, new: Reference, old: Reference, rho_a: float,
                           rho_m: float, eta: float) -> None:
    """Every tolerance of the declarable precisions moves by at most the derived amount."""
    for name in ("float32", "float16", "bfloat16"):
        tolerance = Tolerance.of(Precision(name, name, name), case)
        before, after = tolerance.bound(old), tolerance.bound(new)
        rounded = int(tolerance.rounds_query) + int(tolerance.rounds_kv)
        x = (2 * rounded * unit_roundoff(name) * LOGIT_SIGMAS
             * torch.maximum(old.logit_magnitude, new.logit_magnitude))[..., None]
        relative = (1 + rho_a) * torch.exp((1 + x) * rho_m * (1 + 1e-3)) - 1
        weight = (unit_roundoff(name) * (1 + tolerance.rounds_kv) + torch.expm1(
            2 * rounded * unit_roundoff(name) * LOGIT_SIGMAS * new.logit_magnitude))[..., None]
        allowed = relative * before + tolerance.factor * weight * eta
        moved = (after - before).abs()
        assert bool((moved <= allowed).all()), (name, float((moved / before).max()))


def check(case: Case) -> None:
    """Output bit-identical, magnitudes and tolerances within the derived bounds."""
    inputs = RunInputs(case, CPU)
    new, old = TorchReference().reference(inputs), float64_reference(inputs)
    assert torch.equal(new.output, old.output)
    assert torch.equal(new.context_lens, old.context_lens)
    for name in ("output", "abs_output", "logit_magnitude"):
        assert getattr(new, name).dtype == torch.float64, name
    length = inputs.data.segments.width * case.block_size
    rho_a, rho_m = relative_bounds(case, length)
    v_max = float(inputs.data.v_stored.float().abs().max()) if inputs.data.v_stored.numel() else 0.0
    eta = length * 2.0**-126 * max(1.0, v_max) * case.v_scale
    error_a = (new.abs_output - old.abs_output).abs()
    assert bool((error_a <= rho_a * old.abs_output + eta).all()), float(
        (error_a / old.abs_output.clamp(min=1e-300)).max())
    error_m = (new.logit_magnitude - old.logit_magnitude).abs()
    assert bool((error_m <= rho_m * old.logit_magnitude).all()), float(
        (error_m / old.logit_magnitude.clamp(min=1e-300)).max())
    tolerance_moves_within(case, new, old, rho_a, rho_m, eta)


MODES = ({}, {"softcap": 30.0}, {"sliding_window": 200}, {"sliding_window": 1},
         {"canary": True, "sliding_window": 77, "softcap": 5.0})


@pytest.mark.parametrize("modes", MODES, ids=lambda m: ",".join(m) or "plain")
@pytest.mark.parametrize("case", load_corpus(), ids=lambda c: c.name)
def test_corpus_magnitudes_within_bound(case: Case, modes: dict[str, object]) -> None:
    check(case.replace(**modes))


def seeded_cases(count: int, seed: int = 11) -> list[Case]:
    """Corpus cases with the query dtype, fp8 scales (1e-3..1e2), fp8 queries and kernel
    modes drawn from a seeded generator (the corpus has empty rows and padded requests)."""
    rng = random.Random(seed)
    corpus, found = load_corpus(), []
    for n in range(count):
        base = corpus[n % len(corpus)]
        changes: dict[str, object] = {"seed": rng.randrange(1 << 20),
                                      "query_dtype": rng.choice(QUERY_DTYPES)}
        if base.kv_dtype.startswith("float8"):
            changes["k_scale"] = 10.0 ** rng.uniform(-3, 2)
            changes["v_scale"] = 10.0 ** rng.uniform(-3, 2)
            if rng.random() < 0.3:
                changes["q_scale"] = 10.0 ** rng.uniform(-3, 0)
        if rng.random() < 0.5:
            changes["softcap"] = rng.choice((5.0, 30.0, 50.0))
        if rng.random() < 0.5:
            changes["sliding_window"] = rng.choice((1, 77, 200, 1000))
        found.append(base.replace(**changes))
    return found


@pytest.mark.parametrize("case", seeded_cases(24), ids=lambda c: f"{c.name}-{c.seed}")
def test_seeded_magnitudes_within_bound(case: Case) -> None:
    check(case)


def without_serving_terms(case: Case) -> Case:
    """``case`` with the serving terms off: this module's oracle formulation predates them;
    tests/test_serving_terms.py checks them against a token-by-token computation."""
    return case.replace(**{name: MODE_DEFAULTS[name] for name in SERVING_TERM_FIELDS})


@settings(max_examples=max(10, min(200, settings().max_examples // 2)))
@given(cases().map(without_serving_terms))
def test_generated_magnitudes_within_bound(case: Case) -> None:
    check(case)


def test_chunked_rows_give_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row per chunk: the output is still the float64 formulation's at that chunking."""
    monkeypatch.setattr(torch_ref, "ELEMENTS_PER_CHUNK", 1)
    check(next(c for c in load_corpus() if c.total_q > 4))


def test_float32_products_ignore_reduced_precision_settings() -> None:
    """TF32 (CUDA) or bf16 (oneDNN) float32 matmuls switched on by an imported library do not
    reach the magnitudes, and the settings are restored."""
    case = load_corpus()[0]
    inputs = RunInputs(case, CPU)
    plain = TorchReference().reference(inputs)
    knobs = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [k.fp32_precision for k in knobs]
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        reduced = TorchReference().reference(inputs)
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    finally:
        for knob, value in zip(knobs, saved, strict=True):
            knob.fp32_precision = value
    for name in ("output", "abs_output", "logit_magnitude"):
        assert torch.equal(getattr(reduced, name), getattr(plain, name)), name


def test_the_bound_catches_a_coarser_magnitude() -> None:
    """``abs_output`` rounded to bfloat16 is outside the bound: the check can fail."""
    case = load_corpus()[0]
    inputs = RunInputs(case, CPU)
    old = float64_reference(inputs)
    rho_a, _ = relative_bounds(case, inputs.data.segments.width * case.block_size)
    coarse = old.abs_output.bfloat16().double()
    assert bool(((coarse - old.abs_output).abs() > rho_a * old.abs_output).any())


def test_production_bound_is_small() -> None:
    """At production shape (2048 tokens, D = 128) the worst-case relative errors are about
    7.7e-6 (``sum p|v|``, blocks of 128 tokens) and 7.8e-6 (logit magnitude)."""
    case = load_corpus()[0]
    rho_a, rho_m = relative_bounds(case, 2048)
    assert math.isclose(rho_a, 7.7e-6, rel_tol=0.01) and rho_m < 8e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("case", load_corpus(), ids=lambda c: c.name)
def test_gpu_magnitudes_within_bound(case: Case) -> None:
    """On the GPU, with TF32 switched on around the call as vLLM may leave it: the output is
    the float64 formulation's up to the order of its float64 sums, the magnitudes within the
    bound."""
    inputs = RunInputs(case, torch.device("cuda"))
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        new = TorchReference().reference(inputs)
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    old = float64_reference(inputs)
    length = inputs.data.segments.width * case.block_size
    # the GPU's kernels add each 128-token segment, then the segments: another order of the
    # same float64 sum, within length * u of sum p|v| (u = 2^-53)
    assert bool(((new.output - old.output).abs()
                 <= length * 2.0**-53 * old.abs_output + 1e-300).all())
    rho_a, rho_m = relative_bounds(case, length)
    assert bool(((new.abs_output - old.abs_output).abs()
                 <= rho_a * old.abs_output + 1e-30).all())
    assert bool(((new.logit_magnitude - old.logit_magnitude).abs()
                 <= rho_m * old.logit_magnitude).all())
