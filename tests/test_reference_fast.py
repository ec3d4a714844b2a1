"""The batched reference against the per-chunk one it replaced: within the derived bound.

``chunked_reference`` is the reference of commit 5191a76, verbatim but for its name: 64 rows
per chunk, a per-token index built row by row. Both compute the same float64 formulas with
sums in different orders, so they differ by rounding alone; ``difference_bound`` is the
first-order bound on that difference derived in docs/performance.md ("The reference's error
bound"), with a factor 2 for second-order terms. The bound is then shown to be far below
the tightest tolerance any backend can declare (float32 throughout). Since 7b7e2f0 the two
magnitudes (``abs_output``, ``logit_magnitude``) are float32 sums: their bounds here add the
float32 relative bounds of ``tests/test_reference_magnitudes.py``; the output keeps the float64
bound alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from difftest.backends import torch_ref
from difftest.backends.torch_ref import TorchReference
from difftest.case.selection import window_start
from difftest.case.spec import MODE_DEFAULTS, SERVING_TERM_FIELDS, Case
from difftest.contract.backend import Precision, RunInputs
from difftest.contract.tolerance import Reference, Tolerance
from difftest.generation.corpus import load_corpus
from difftest.generation.strategies import cases
from difftest.machine import devices
from tests.test_geometry import dense
from tests.test_reference_magnitudes import MODES, relative_bounds

U64 = 2.0**-53
CPU = torch.device("cpu")
# B/T: the bound over the float32 tolerance, at most (7.3e-12 + 1.3e-12 M) / (3.6e-7 + 2.1e-6 M)
# for contexts up to 8192 tokens (docs/performance.md)
FAR_BELOW = 1e-4


def chunked_reference(inputs: RunInputs) -> Reference:
    """The float64 reference as computed before issue 11 (64 rows per chunk)."""
    case, data = inputs.case, inputs.data
    device = inputs.device
    f64 = torch.float64
    keys = data.k_stored.to(f64).flatten(0, 1)[:, 0] * case.k_scale
    values = data.v_stored.to(f64).flatten(0, 1)[:, 0] * case.v_scale
    query = data.query.to(f64)
    ctx = torch.tensor([r.context_len for r in inputs.rows], dtype=torch.int64)
    shape = (case.total_q, case.num_q_heads, case.head_dim)
    out = torch.zeros(shape, dtype=f64, device=device)
    abs_out = torch.zeros(shape, dtype=f64, device=device)
    magnitude = torch.zeros(shape[:2], dtype=f64, device=device)
    index_all = _token_index(inputs, ctx)
    for start in range(0, case.total_q, 64):
        stop = min(start + 64, case.total_q)
        length = int(ctx[start:stop].max())
        if length == 0:
            continue
        index = index_all[start:stop, :length].to(device)
        ordinal = torch.arange(length)[None]
        mask = ordinal < ctx[start:stop, None]
        if case.sliding_window:
            mask &= ordinal >= window_start(ctx[start:stop, None], case.sliding_window)
        mask = mask.to(device)
        k = keys[index]
        v = values[index]
        q = query[start:stop]
        scores = torch.einsum("rhd,rld->rhl", q, k) * case.softmax_scale
        if case.softcap:
            scores = case.softcap * torch.tanh(scores / case.softcap)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[start:stop] = torch.einsum("rhl,rld->rhd", probs, v)
        abs_out[start:stop] = torch.einsum("rhl,rld->rhd", probs, v.abs())
        prod = torch.einsum("rhd,rld->rhl", q * q, k * k).sqrt() * case.softmax_scale
        prod = prod + case.softcap
        magnitude[start:stop] = prod.masked_fill(~mask[:, None, :], 0).amax(dim=-1)
    return Reference(out, abs_out, magnitude, ctx.to(device))


def _token_index(inputs: RunInputs, ctx: torch.Tensor) -> torch.Tensor:
    case, data = inputs.case, inputs.data
    width = max((len(r.segments) for r in inputs.rows), default=0)
    length = int(ctx.max()) if ctx.numel() else 0
    if width == 0 or length == 0:
        return torch.zeros((case.total_q, max(length, 1)), dtype=torch.int64)
    slots = torch.zeros((case.total_q, width), dtype=torch.int64)
    ends = torch.full((case.total_q, width), length + 1, dtype=torch.int64)
    for n, row in enumerate(inputs.rows):
        if row.segments:
            slots[n, : len(row.segments)] = torch.tensor(
                [data.slot_of[s.physical_block] for s in row.segments])
            ends[n, : len(row.segments)] = torch.tensor([s.tokens for s in row.segments]).cumsum(0)
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
    pos = torch.arange(length).expand(case.total_q, length).contiguous()
    seg = torch.searchsorted(ends, pos, right=True).clamp(max=width - 1)
    index = slots.gather(1, seg) * case.block_size + pos - starts.gather(1, seg)
    return torch.where(pos < ctx[:, None], index, 0)


def difference_bound(case: Case, ref: Reference, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on ``|new - old|`` of the output (and of ``abs_output``) and of the logit
    magnitude, for sums over at most ``length`` tokens (docs/performance.md)."""
    d = case.head_dim
    mag = ref.logit_magnitude[..., None]
    out = 2 * U64 * ref.abs_output * (4 * length + 10 + (4 * (d + 4) * math.sqrt(d) + 32) * mag)
    return out, 2 * U64 * 2 * (d + 6) * ref.logit_magnitude


def magnitude_slack(inputs: RunInputs, old: Reference, length: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the float32 magnitudes (7b7e2f0) may add to the bounds of ``abs_output`` and
    ``logit_magnitude``: their relative bounds (``difftest/backends/torch_ref.py``'s docstring,
    ``tests/test_reference_magnitudes.py``) and the flushed-subnormal term of ``abs_output``."""
    case, v = inputs.case, inputs.data.v_stored
    rho_a, rho_m = relative_bounds(case, length)
    v_max = float(v.float().abs().max()) if v.numel() else 0.0
    eta = length * 2.0**-126 * max(1.0, v_max) * case.v_scale
    return rho_a * old.abs_output + eta, rho_m * old.logit_magnitude


def check_within_bound(case: Case) -> None:
    """New and old references of ``case`` differ within the bound, itself far below the
    float32 tolerance."""
    inputs = RunInputs(case, CPU)
    new, old = TorchReference().reference(inputs), chunked_reference(inputs)
    assert torch.equal(new.context_lens, old.context_lens)
    length = inputs.data.segments.width * case.block_size
    bound, mag_bound = difference_bound(case, old, length)
    abs_slack, mag_slack = magnitude_slack(inputs, old, length)
    for name, allowed in (("output", bound), ("abs_output", bound + abs_slack)):
        error = (getattr(new, name) - getattr(old, name)).abs()
        assert bool((error <= allowed).all()), (name, float((error - allowed).max()))
    assert bool(((new.logit_magnitude - old.logit_magnitude).abs()
                 <= mag_bound + mag_slack).all())
    tightest = Tolerance(Precision("float32", "float32", "float32")).bound(old)
    assert bool((bound <= FAR_BELOW * tightest).all())


@pytest.mark.parametrize("modes", MODES, ids=lambda m: ",".join(m) or "plain")
@pytest.mark.parametrize("case", load_corpus(), ids=lambda c: c.name)
def test_corpus_references_agree_within_bound(case: Case, modes: dict[str, object]) -> None:
    check_within_bound(case.replace(**modes))


def without_serving_terms(case: Case) -> Case:
    """``case`` with the serving terms off: this module's oracle formulation predates them;
    tests/test_serving_terms.py checks them against a token-by-token computation."""
    return case.replace(**{name: MODE_DEFAULTS[name] for name in SERVING_TERM_FIELDS})


# two references per example: half the profile's examples (12 in CI), at most 200 (nightly)
@settings(max_examples=max(10, min(200, settings().max_examples // 2)))
@given(cases().map(without_serving_terms))
def test_generated_references_agree_within_bound(case: Case) -> None:
    check_within_bound(case)


def test_chunked_rows_give_the_same_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cases too large for one gather run in row chunks (here one row each), same values."""
    case = next(c for c in load_corpus() if c.total_q > 4)
    whole = TorchReference().reference(RunInputs(case, CPU))
    monkeypatch.setattr(torch_ref, "ELEMENTS_PER_CHUNK", 1)
    inputs = RunInputs(case, CPU)
    rows = TorchReference().reference(inputs)
    length = inputs.data.segments.width * case.block_size
    bounds = difference_bound(case, whole, length)
    slack = magnitude_slack(inputs, whole, length)
    for name, bound in zip(("output", "abs_output", "logit_magnitude"),
                           (bounds[0], bounds[0] + slack[0], bounds[1] + slack[1]),
                           strict=True):
        assert bool(((getattr(rows, name) - getattr(whole, name)).abs() <= bound).all()), name
    check_within_bound(case)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("modes", MODES, ids=lambda m: ",".join(m) or "plain")
@pytest.mark.parametrize("case", load_corpus(), ids=lambda c: c.name)
def test_gpu_reference_agrees_with_the_old_one_within_bound(case: Case,
                                                            modes: dict[str, object]) -> None:
    """On the GPU too: other GEMM kernels, and for the KV dtypes it reads the fused kernels of
    difftest/backends/_reference_triton.py (other summation orders; softcap and window handled
    apart)."""
    case = case.replace(**modes)
    inputs = RunInputs(case, torch.device("cuda"))
    new, old = TorchReference().reference(inputs), chunked_reference(inputs)
    length = inputs.data.segments.width * case.block_size
    bound, mag_bound = difference_bound(case, old, length)
    abs_slack, mag_slack = magnitude_slack(inputs, old, length)
    assert torch.equal(new.context_lens, old.context_lens)
    assert bool(((new.output - old.output).abs() <= bound).all())
    assert bool(((new.abs_output - old.abs_output).abs() <= bound + abs_slack).all())
    assert bool(((new.logit_magnitude - old.logit_magnitude).abs()
                 <= mag_bound + mag_slack).all())


def test_the_bound_catches_a_wrong_reference() -> None:
    """A reference off by one float32 rounding is outside the bound: the check can fail."""
    case = load_corpus()[0]
    inputs = RunInputs(case, CPU)
    old = chunked_reference(inputs)
    bound, _ = difference_bound(case, old, inputs.data.segments.width * case.block_size)
    wrong = old.output.float().double()
    assert bool(((wrong - old.output).abs() > bound).any())


@pytest.mark.parametrize("modes", MODES[:3], ids=lambda m: ",".join(m) or "plain")
def test_the_gpu_kernels_agree_within_bound_in_the_interpreter(
        monkeypatch: pytest.MonkeyPatch, modes: dict[str, object]) -> None:
    """The fused kernels the reference runs on GPUs (difftest/backends/_reference_triton.py), run by
    Triton's interpreter here, against the per-chunk reference: within the same bounds."""
    if not devices.interpreted():
        pytest.skip("Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    case = next(c for c in load_corpus() if c.name == "mtp4-straddles-block-boundary")
    monkeypatch.setattr(torch_ref, "_triton_reads", lambda k_stored: True)
    check_within_bound(case.replace(**modes))



@pytest.mark.parametrize(("block", "kv_heads"), [(16, 1), (16, 2), (32, 2), (64, 1)])
def test_the_gpu_kernels_read_blocks_shorter_than_their_token_chunk(
        monkeypatch: pytest.MonkeyPatch, block: int, kv_heads: int) -> None:
    """The values kernel summed a block's tokens in chunks of 32: a 16-token block's chunk
    read the next block's tokens and the next segment's probabilities (on an H100 the dense
    family's 16-token blocks disagreed on three kernels at once, error/tolerance 339). The
    kernels, run by the interpreter here, against the torch formulation on the same case."""
    if not devices.interpreted():
        pytest.skip("Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    case = dense(block=block, head_dim=64, kv_heads=kv_heads, group=2, seed=5)
    torch_sums = TorchReference().reference(RunInputs(case, CPU))
    monkeypatch.setattr(torch_ref, "_triton_reads", lambda k_stored: True)
    kernel_sums = TorchReference().reference(RunInputs(case, CPU))
    # the output's sums are float64; sum p|v| and the magnitudes float32, in another order
    for name, relative in (("output", 1e-12), ("abs_output", 1e-5), ("logit_magnitude", 1e-5)):
        ours, theirs = getattr(kernel_sums, name), getattr(torch_sums, name)
        assert bool(((ours - theirs).abs() <= relative * (1 + theirs.abs())).all()), name
