"""The comparison's CUDA graphs (difftest.primitives.cuda_graphs) give the eager comparison's
results."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.contract import compare as compare_module
from difftest.contract.backend import EmptyRowOutput, Precision, RunInputs
from difftest.contract.compare import Comparison, compare
from difftest.contract.tolerance import Tolerance
from difftest.generation.corpus import load_corpus
from difftest.primitives.cuda_graphs import GraphCache

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="CUDA graphs need a CUDA device; this machine has none")


def _doubled(x: torch.Tensor, params: float) -> tuple[torch.Tensor, ...]:
    return (x * params + 1,)


def _synchronising(x: torch.Tensor, params: float) -> tuple[torch.Tensor, ...]:
    return (x * float(x.sum().item()) * params,)  # a host read: cannot be captured


def test_cpu_calls_run_as_they_are() -> None:
    calls = []

    def fn(x: torch.Tensor, params: float) -> tuple[torch.Tensor, ...]:
        calls.append(params)
        return (x * params,)

    cache = GraphCache()
    x = torch.arange(4.0)
    for _ in range(3):
        (out,) = cache(fn, (x,), 2.0)
        assert torch.equal(out, x * 2)
    assert calls == [2.0, 2.0, 2.0] and len(cache) == 0


@CUDA
def test_a_repeated_signature_is_replayed_with_new_values() -> None:
    cache = GraphCache(capacity=2)
    for step in range(4):
        x = torch.full((5,), float(step), device="cuda")
        (out,) = cache(_doubled, (x,), 3.0)
        assert torch.equal(out, x * 3.0 + 1)
    assert len(cache) == 1
    for shape in ((2,), (3,), (4,)):  # capacity 2: the oldest graph goes
        for _ in range(2):
            cache(_doubled, (torch.ones(shape, device="cuda"),), 3.0)
    assert len(cache) == 2


@CUDA
def test_an_uncapturable_function_runs_eagerly() -> None:
    cache = GraphCache()
    for step in range(3):
        x = torch.full((4,), float(step + 1), device="cuda")
        (out,) = cache(_synchronising, (x,), 1.0)
        assert torch.equal(out, x * float(x.sum()))
    assert len(cache) == 0


@CUDA
@pytest.mark.parametrize("case", load_corpus()[:4], ids=lambda c: c.name or c.case_id)
def test_graphed_comparison_equals_the_eager_one(case: Case) -> None:
    inputs = RunInputs(case, torch.device("cuda"))
    truth = TorchReference().reference(inputs)
    q = case.query_dtype
    tolerance = Tolerance(Precision(q, q, q))
    good = truth.output.to(torch.float32)
    bad = good.clone()
    bad[0, 0, :3] += 1.0  # a few mismatching elements, so the worst locations are read
    outputs = (good, bad)

    def eager(out: torch.Tensor) -> Comparison:
        compare_module._GRAPHS.clear()  # a first sight runs eagerly
        return compare("k", out, truth, tolerance, EmptyRowOutput.ZERO, case, inputs.rows)

    expected = [dataclasses.asdict(eager(out)) for out in outputs]
    compare_module._GRAPHS.clear()
    for _ in range(3):  # seen, then captured, then replayed
        for out, want in zip(outputs, expected, strict=True):
            got = compare("k", out, truth, tolerance, EmptyRowOutput.ZERO, case, inputs.rows)
            assert dataclasses.asdict(got) == want
    assert len(compare_module._GRAPHS) == 1  # both outputs share one signature
    assert not expected[1]["agrees"] and expected[1]["worst"]


@CUDA
def test_copied_outputs_outlive_the_next_replay() -> None:
    cache = GraphCache(copy_outputs=True)
    kept = []
    for step in range(4):
        x = torch.full((5,), float(step), device="cuda")
        kept.append(cache(_doubled, (x,), 3.0)[0])
    assert len(cache) == 1  # replayed from the second call on
    for step, out in enumerate(kept):
        assert torch.equal(out, torch.full((5,), step * 3.0 + 1, device="cuda"))


@CUDA
@pytest.mark.parametrize("case", load_corpus()[:4], ids=lambda c: c.name or c.case_id)
def test_graphed_reference_equals_the_eager_one(case: Case) -> None:
    from difftest.backends import torch_ref

    def reference(seed: int) -> tuple[torch.Tensor, ...]:
        inputs = RunInputs(dataclasses.replace(case, seed=seed), torch.device("cuda"))
        truth = TorchReference().reference(inputs)
        return truth.output, truth.abs_output, truth.logit_magnitude

    torch_ref._GRAPHS.clear()
    eager = [reference(seed) for seed in (1, 2)]  # the first is a first sight, the second
    torch_ref._GRAPHS.clear()                     # (after the clear) too
    graphed = [reference(seed) for seed in (3, 1, 2)]  # seen, then captured and replayed
    assert len(torch_ref._GRAPHS) == 1
    for want, got in zip(eager, graphed[1:], strict=True):
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
