"""A seed's case set does not depend on the AITER or vLLM release any backend loaded.

Generation asks each backend what it refuses in every release
(:func:`difftest.contract.backend.refusal_in_every_release`), so the same seed draws the same
cases, fitted variants and their backends included, under the PyPI wheel and AITER
v0.1.20.post1 and under vLLM 0.33.0 and 0.34.0; what one release lacks is ``unsupported`` on
that side (the gate's "no longer supported" / "newly supported"). The releases come from
``$DIFFTEST_AITER_REPO`` and ``scripts/fetch_vllm.sh``; the test skips naming what is missing.
"""

from __future__ import annotations

import pytest
import torch

from difftest.backends.vllm_release import ReleaseError
from difftest.backends.vllm_release import resolve as resolve_vllm
from difftest.contract.backend import Backend, refusal_in_every_release
from difftest.contract.registry import discover, select
from difftest.generation.capabilities import Capabilities
from difftest.run.plan import RunPlan
from tests.aiter_trees import aiter_tree, wheel_tree

AITER = ["aiter-unified", "aiter-unified@shuffled", "aiter-pa-decode"]
VLLM = ["triton-unified", "vllm-triton-sparse", "vllm-aiter@emulated", "vllm-paged-decode",
        "vllm-decode-attention"]
CPU = torch.device("cpu")


def vllm_release(version: str) -> str:
    try:
        return str(resolve_vllm(version).package)
    except ReleaseError as exc:
        pytest.skip(str(exc))


def plan_under(monkeypatch: pytest.MonkeyPatch, aiter: str, vllm: str
               ) -> tuple[RunPlan, list[Backend]]:
    """What ``difftest run --no-corpus --examples 12 --seed 3`` plans with those releases
    chosen by the environment, and its backends."""
    monkeypatch.setenv("DIFFTEST_AITER", aiter)
    monkeypatch.setenv("DIFFTEST_VLLM", vllm)
    backends = select(discover(), AITER + VLLM)
    assert all(b.availability().available for b in backends), [
        (b.name, b.availability().reason) for b in backends if not b.availability().available]
    return RunPlan.drawn(Capabilities.probe(backends, CPU), [], 12, seed=3), backends


def runs(plan: RunPlan) -> list[tuple[str, tuple[str, ...] | None, str]]:
    return [(r.case.case_id, r.backends, r.origin) for r in plan.runs]


def test_one_seed_draws_the_same_cases_under_two_aiters_and_two_vllms(monkeypatch) -> None:
    wheel = str(wheel_tree().package)
    newest = str(aiter_tree("v0.1.20.post1").package)
    old_vllm, new_vllm = vllm_release("0.33.0"), vllm_release("0.34.0")
    before, old = plan_under(monkeypatch, wheel, old_vllm)
    after, new = plan_under(monkeypatch, newest, new_vllm)
    assert runs(before) == runs(after)
    assert {origin for _, _, origin in runs(before)} == {"generated", "fitted"}
    # the releases do differ on these very cases: each difference is a refusal of one side
    # at run time, never a different draw
    differ = [(run.case, ours, theirs) for run in after.runs
              for ours, theirs in zip(old, new, strict=True)
              if run.backends is None or theirs.name in run.backends
              if (ours.unsupported_reason(run.case, CPU) is None)
              != (theirs.unsupported_reason(run.case, CPU) is None)]
    assert {theirs.name for _, _, theirs in differ} >= {"aiter-unified@shuffled"}, differ
    for case, ours, theirs in differ:  # no refusal of generation, on either side
        assert refusal_in_every_release(ours, case, CPU) is None
        assert refusal_in_every_release(theirs, case, CPU) is None
