"""The corpus and generated cases on each backend of this machine, a test per pair.

``test_corpus`` is one test per (corpus case, backend): a backend unavailable here, or a case
it does not run, is a pytest skip with the reason; a failure a known kernel bug explains
(docs/findings.md) is an expected failure naming the finding; any other failure fails with
its message and the command that replays it. ``test_generated`` is one Hypothesis search per
backend over the cases that backend runs (skipped with the reason where it runs none), within
the profile's search budget (``--difftest-search-budget``); known bugs it meets are logged in
the report, not failed on.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, target
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from difftest.case.spec import Case
from difftest.contract.backend import Backend
from difftest.frontends import pytest_run
from difftest.generation.capabilities import Capabilities
from difftest.generation.corpus import load_corpus
from difftest.judgement.expectations import judge
from difftest.results.records import NOT_RUN
from difftest.run.runner import CaseResult

CORPUS = load_corpus()
_strategies: dict[str, SearchStrategy[Case]] = {}


def _run(config: pytest.Config) -> pytest_run.DifftestRun:
    return pytest_run.current(config) or pytest_run.activate_late(config)


def _backends(config: pytest.Config) -> dict[str, Backend]:
    return {b.name: b for b in _run(config).session().backends}


def _why_not_generated(run: pytest_run.DifftestRun, backend: Backend) -> str | None:
    """Why ``backend`` gets no generated search here (``None``: it gets one)."""
    available = backend.availability()
    if not available.available:
        return f"unavailable: {available.reason}"
    capabilities = Capabilities.probe([backend], run.session().device)
    if not capabilities.combos:
        reasons = sorted({reason for _, _, reason in capabilities.refused}
                         | {reason for _, reason in capabilities.skipped})
        return f"unsupported: {backend.name} runs no dtype combination here ({'; '.join(reasons)})"
    # each example, or the nearest variant of it this backend runs (as `difftest run` fits)
    _strategies[backend.name] = capabilities.fitted_strategy()
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``backend``: every backend under test, an unavailable one (or, for the generated
    search, one that runs nothing here) marked skipped with the reason."""
    if "backend" not in metafunc.fixturenames:
        return
    run = _run(metafunc.config)
    params = []
    for name, backend in _backends(metafunc.config).items():
        if metafunc.function.__name__ == "test_generated":
            reason = _why_not_generated(run, backend)
        else:
            available = backend.availability()
            reason = None if available.available else f"unavailable: {available.reason}"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    metafunc.parametrize("backend", params)


def _judged(run: pytest_run.DifftestRun, result: CaseResult) -> None:
    """A known bug's failure is an expected failure naming it; a result that did not run is
    a skip with its reason (a new failure has failed the test already)."""
    if result.failed:
        findings = sorted(judge([run.session().records[-1]], run.expectations()).known)
        pytest.xfail(f"known bug {', '.join(findings)} (docs/findings.md): "
                     + result.failure_messages()[0].splitlines()[0])
    (outcome,) = result.results
    if outcome.status in NOT_RUN:
        pytest.skip(f"{outcome.status.value}: {outcome.detail}")


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_corpus(case: Case, backend: str, pytestconfig: pytest.Config) -> None:
    run = _run(pytestconfig)
    refused = _backends(pytestconfig)[backend].unsupported_reason(case, run.session().device)
    if refused:
        pytest.skip(f"unsupported: {refused}")
    _judged(run, run.check(case, (backend,)))


@given(data=st.data())
def test_generated(backend: str, data: st.DataObject, pytestconfig: pytest.Config) -> None:
    run = _run(pytestconfig)
    case = data.draw(_strategies[backend], label="case")
    largest = None  # over the variants fitted to the backend's releases: target() once
    for result in run.check_example(case, (backend,)):
        (outcome,) = result.results
        # a known bug's result may be non-finite (a NaN row), which target() refuses
        if outcome.comparison is not None and math.isfinite(outcome.comparison.max_ratio):
            largest = max(largest or 0.0, outcome.comparison.max_ratio)
    if largest is not None:
        target(largest, label=f"error/tolerance {backend}")
