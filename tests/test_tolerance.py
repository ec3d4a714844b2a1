"""The tolerance model: relative rounding per stage, plus the underflow of the stages that
can produce subnormals."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from difftest.backends.torch_ref import TorchReference
from difftest.case.casefile import read_case
from difftest.case.selection import window_start
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.contract.registry import discover
from difftest.contract.tolerance import FACTOR, LOGIT_SIGMAS, VALUE_BOUND, Reference, Tolerance
from difftest.primitives.dtypes import underflow_unit
from difftest.run.runner import Status, run_case


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
    # the floor: fp16's underflow of the output and of the row's one weight, no more
    assert bound < FACTOR * (2.0**-25 * (1 + VALUE_BOUND) + 1e-12)


def test_normal_range_outputs_keep_a_relative_bound() -> None:
    """Three float16 roundings, the float32 sums of a one-token row (``sqrt(1) u_32`` of
    ``A + |o|``) and float16's underflow of the output and of the one weight."""
    tolerance = Tolerance(Precision("float16", "float16", "float16"))
    bound = float(tolerance.bound(_reference(1.0)))
    expected = 3 * 2.0**-11 + 2 * 2.0**-24 + 2.0**-25 * (1 + VALUE_BOUND)
    assert abs(bound - FACTOR * expected) < 1e-15


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
    # left: the fp8 weights, the dot's float32 sum (one product at LOGIT_SIGMAS of magnitude
    # 2, as expm1(2 delta)), the row's float32 sum (one token of A = 1) and bf16's underflow
    u_32 = 2.0**-24
    sums = math.expm1(2 * u_32 * LOGIT_SIGMAS * 2.0) + u_32
    assert abs(charged[2] - FACTOR * (2.0**-4 + sums + underflow_unit("bfloat16"))) < 1e-12


@pytest.mark.parametrize("backend", ["triton-unified", "vllm-triton-sparse"])
def test_float32_operands_are_charged_both_sides(backend: str) -> None:
    """The CPU stretch's two disagreements when exact float32 queries were charged no
    rounding (error/tolerance 1.11 and 1.02: float32 accumulation, not a bug): both agree."""
    case = read_case(Path(__file__).parents[1] / f"docs/data/fp-fp32-operands-{backend}.json")
    precision = Precision("float32", "float32", "float32")
    assert Tolerance.of(precision, case) == Tolerance(precision)
    result = run_case(case, TorchReference(), [discover()[backend]], torch.device("cpu"))
    assert result.results[0].status is Status.AGREE, result.results[0].detail


# ----- the bottom of float32's range (docs/tolerance.md) ---------------------------------

SUBNORMAL_CASE = "subnormal-outputs-fp32-split-k"


def test_subnormal_outputs_of_the_issue_case_agree_and_need_the_stage_count() -> None:
    """The 3-D (split-K) kernel's float32 products, rescalings and normalisation each round
    below float32's normal range: on this case (float32 queries, fp8 cache with v_scale
    31.62, outliers, window 28) element (row 10, head 47, dim 10) comes out -8.968e-44
    against -8.697e-44, two subnormal spacings off, more than the output's own underflow
    allows; the stage count covers it."""
    from difftest.contract.backend import RunInputs
    from difftest.generation.corpus import load_corpus

    case = next(c for c in load_corpus() if c.name == SUBNORMAL_CASE)
    backend = discover()["triton-unified"]
    inputs = RunInputs(case, torch.device("cpu"))
    truth = TorchReference().reference(inputs)
    actual = backend.run(inputs).to(torch.float64)
    tolerance = Tolerance.of(backend.precision(case, inputs.device), case)
    active = (truth.context_lens > 0)[:, None, None].expand_as(truth.output)
    error = torch.where(active, (actual - truth.output).abs(), torch.zeros_like(actual))
    tiny = truth.output.abs() < torch.finfo(torch.float32).smallest_normal
    output_floor = FACTOR * underflow_unit("float32")
    assert bool((error[tiny] > output_floor).any())  # the output's underflow alone fails
    assert bool((error <= tolerance.bound(truth)).all())
    result = run_case(case, TorchReference(), [backend], torch.device("cpu"))
    assert result.results[0].status is Status.AGREE, result.results[0].detail


class FlushingSdpa:
    """A plug-in over torch's ``scaled_dot_product_attention`` (float32, on the plain page
    views through the sparse table) that stores its output flush-to-zero, and declares it in
    its precision when ``declares``."""

    name = "sdpa"
    in_page_orders = ("plain",)

    def __init__(self, declares: bool) -> None:
        self.declares = declares

    def availability(self) -> Availability:
        return Availability(True)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        return "scaled_dot_product_attention has no softcap" if case.softcap else None

    def precision(self, case: Case, device: torch.device) -> Precision:
        return Precision("float32", "float32", "float32",
                         flushes_subnormal_outputs=self.declares)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        case, views = inputs.case, inputs.cache("plain")
        table, ctx = inputs.sparse_table
        out = torch.zeros((case.total_q, case.num_q_heads, case.head_dim), dtype=torch.float32)
        for n, length in enumerate(ctx.tolist()):
            if not length:
                continue
            pages = table[n, : -(-length // case.page_size)].long()
            first = window_start(length, case.sliding_window)
            k, v = (view[pages].flatten(0, 1)[first:length].float() * scale
                    for view, scale in ((views.k, case.k_scale), (views.v, case.v_scale)))
            q = inputs.data.query[n].float()  # [Hq, D]
            out[n] = F.scaled_dot_product_attention(
                q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                scale=case.softmax_scale, enable_gqa=True)[0, :, 0]
        return torch.where(out.abs() < torch.finfo(torch.float32).smallest_normal, 0.0, out)


def test_a_declared_flush_to_zero_of_outputs_agrees_undeclared_fails() -> None:
    """The corpus case's outputs of 8.1e-40 flushed to 0: a disagreement far past the
    tolerance (error/tolerance 230) unless the backend declares the flush."""
    from difftest.generation.corpus import load_corpus

    case = next(c for c in load_corpus() if c.name == SUBNORMAL_CASE)
    cpu = torch.device("cpu")

    def outcome(declares: bool) -> Any:
        return run_case(case, TorchReference(), [FlushingSdpa(declares)], cpu).results[0]

    undeclared = outcome(declares=False)
    assert undeclared.status is Status.DISAGREE
    assert undeclared.comparison.max_ratio > 100
    worst = undeclared.comparison.worst[0]
    assert worst.actual == 0 and 0 < abs(worst.expected) < torch.finfo(torch.float32).tiny
    declared = outcome(declares=True)
    assert declared.status is Status.AGREE, declared.detail
    assert "subnormal outputs flushed to zero" in declared.comparison.tolerance


def _flash_decode(logits: np.ndarray, values: np.ndarray, tile: int, segments: int,
                  scale: float) -> np.ndarray:
    """A float32 split-K flash decode of one row: per segment an online softmax over tiles
    (``exp``, products, rescalings in float32), then the segments rescaled to the overall
    maximum, summed, divided by the overall sum and multiplied by ``scale`` (a v_scale
    applied after accumulating)."""
    f32 = np.float32
    parts = np.array_split(np.arange(len(logits)), segments)
    accs, maxima, sums = [], [], []
    for part in (p for p in parts if len(p)):
        m, total, acc = f32(-np.inf), f32(0), np.zeros(values.shape[1], f32)
        for start in range(0, len(part), tile):
            idx = part[start:start + tile]
            new_m = max(m, logits[idx].max())
            alpha = np.exp(f32(m - new_m)) if np.isfinite(m) else f32(0)
            p = np.exp((logits[idx] - new_m).astype(f32))
            acc = acc * alpha + (p[:, None] * values[idx]).sum(axis=0, dtype=f32)
            total = total * alpha + p.sum(dtype=f32)
            m = new_m
        accs.append(acc)
        maxima.append(m)
        sums.append(total)
    top = max(maxima)
    factors = [np.exp(f32(m - top)) for m in maxima]
    acc = sum((a * f for a, f in zip(accs, factors, strict=True)), np.zeros_like(accs[0]))
    total = f32(sum(s * f for s, f in zip(sums, factors, strict=True)))
    return (acc / total) * f32(scale)


@settings(deadline=None)
@given(st.data())
def test_subnormal_stage_count_bounds_a_float32_flash_decode(data: st.DataObject) -> None:
    """Property: a float32 split-K flash decode whose output is made of subnormal terms (the
    dominant token's value is 0, the others' weights are below 2^-126) stays within the
    tolerance of float32 operands, for any tiling, segmenting and post-accumulation scale."""
    n = data.draw(st.integers(2, 48), label="tokens")
    tile = data.draw(st.integers(1, 16), label="tile")
    segments = data.draw(st.integers(1, min(n, 16)), label="segments")
    scale = data.draw(st.sampled_from([1.0, 31.62, 1000.0]), label="v_scale")
    gaps = data.draw(st.lists(st.floats(75.0, 110.0), min_size=n - 1, max_size=n - 1))
    raw = data.draw(st.lists(st.floats(-VALUE_BOUND, VALUE_BOUND), min_size=(n - 1) * 4,
                             max_size=(n - 1) * 4))
    logits = np.concatenate([[0.0], -np.array(gaps)]).astype(np.float32)
    stored = np.concatenate([np.zeros((1, 4)), np.array(raw).reshape(n - 1, 4)]) / scale
    values = stored.astype(np.float32)
    order = np.array(data.draw(st.permutations(range(n)), label="order"))
    logits, values = logits[order], values[order]
    actual = _flash_decode(logits, values, tile, segments, scale).astype(np.float64)
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    v = values.astype(np.float64) * scale
    expected = p @ v
    reference = Reference(torch.from_numpy(expected).reshape(1, 1, 4),
                          torch.from_numpy(p @ np.abs(v)).reshape(1, 1, 4),
                          torch.zeros(1, 1, dtype=torch.float64),
                          torch.tensor([n], dtype=torch.int32))
    precision = Precision("float32", "float32", "float32")
    bound = Tolerance(precision, accumulator_scale=scale).bound(reference).flatten().numpy()
    assert (np.abs(actual - expected) <= bound).all(), (actual, expected, bound)



@pytest.mark.parametrize(("record", "element", "below", "former", "backends"), [
    ("fp-fp16-weight-underflow-vllm-decode-attention.json", (22, 33, 27), 117, 2.1e-7,
     ("vllm-decode-attention",)),
    ("fp-fp16-weight-underflow-fp8-cache.json", (1, 60, 28), 510, 2.1e-7,
     ("triton-unified", "vllm-paged-decode")),
], ids=["float16-cache", "fp8-cache"])
def test_float16_weights_below_their_normal_range_are_charged_by_their_count(
        record: str, element: tuple[int, int, int], below: int, former: float,
        backends: tuple[str, ...]) -> None:
    """The 2000-case CPU stretch's disagreements (error/tolerance 1.70 and 1.30): float16 rows
    made of one dominant token whose value at the element is small (or 0) and weights below
    float16's normal range (6.1e-5), each rounded by up to 2^-25 absolutely. Rounding those
    weights alone moves the element past the former tolerance (the fp8-cache row's element,
    -2.77e-7, to 0, as the kernels wrote it); their random-sign sum is charged
    ``eta_p sqrt(n) V``, and the kernels agree."""
    case = read_case(Path(__file__).parents[1] / "docs/data" / record)
    inputs = RunInputs(case, torch.device("cpu"))
    data, segments = inputs.data, inputs.data.segments
    row, head, dim = element
    slots = segments.slots[row]
    k = data.k_stored[slots][:, :, 0].reshape(-1, case.head_dim).double() * case.k_scale
    v = data.v_stored[slots][:, :, 0].reshape(-1, case.head_dim).double() * case.v_scale
    token = torch.arange(case.block_size)
    attended = (token[None, :] < segments.tokens[row][:, None]).reshape(-1)
    logits = (k @ data.query[row, head].double()) * case.softmax_scale
    if case.softcap:
        logits = case.softcap * torch.tanh(logits / case.softcap)
    weights = torch.exp(logits[attended] - logits[attended].max())
    values = v[attended, dim]
    moved = float(((weights.half().double() - weights) @ values) / weights.sum())
    assert int((weights < 2.0**-14).sum()) == below
    n = torch.tensor([float(attended.sum())], dtype=torch.float64)
    precision = Precision("float16", "float16", "float16")
    assert former < abs(moved) < float(Tolerance(precision).underflow(n)[0])
    found = discover()
    result = run_case(case, TorchReference(), [found[b] for b in backends],
                      torch.device("cpu"))
    assert [r.status for r in result.results] == [Status.AGREE] * len(backends), [
        r.detail for r in result.results]
