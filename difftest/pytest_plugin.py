"""The pytest plugin's entry point: options, and nothing else until difftest is in use.

Loaded through the ``pytest11`` entry point into every pytest run of the environment,
including foreign projects' (vLLM's or AITER's suites on a shared runner image). At import it
needs only the standard library and pytest; it changes no Hypothesis setting and imports no
torch. difftest becomes active in a run (:mod:`difftest.frontends.pytest_run`: GPU pinning,
Hypothesis profiles, the run log, crash recovery, the report) when

* any ``--difftest-*`` option is given, or
* the project's pytest configuration sets ``difftest = true`` (this repository does, in
  ``pyproject.toml``), or
* the run collects the installed differential suite (``pytest --pyargs
  difftest.kernel_tests``: a ROCm runner without a checkout), or
* a test requests the ``check_case``, ``check_example`` or ``difftest_session`` fixture;
  activated this late, the process neither pins GPUs nor loads a Hypothesis profile, so
  projects that use the fixtures under ``pytest -n`` set ``difftest = true``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from difftest.case.spec import Case
    from difftest.frontends.pytest_run import DifftestRun
    from difftest.run.runner import CaseResult
    from difftest.run.session import Session

INI_NAME = "difftest"
OPTIONS: tuple[str, ...] = (
    "--difftest-backends", "--difftest-optional", "--difftest-device", "--difftest-plugin",
    "--difftest-reference", "--difftest-artifacts", "--difftest-report", "--difftest-shard",
    "--difftest-search-budget")


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--difftest-*`` options and the ``difftest`` ini switch."""
    parser.addini(INI_NAME, type="bool", default=False,
                  help="activate difftest in every run of this project (pinning, profiles, "
                       "reports) even without a --difftest-* option")
    group = parser.getgroup("difftest", "differential testing of attention kernels")
    group.addoption("--difftest-backends", default=None,
                    help="comma-separated backends to compare (default: all discovered)")
    group.addoption("--difftest-optional", default=None, metavar="NAMES",
                    help="backends of --difftest-backends that may be unavailable without "
                         "failing the session")
    group.addoption("--difftest-device", default=None,
                    help="device the kernels run on: auto (default), cpu or cuda "
                         "(under xdist: one GPU per worker)")
    group.addoption("--difftest-plugin", action="append", default=None,
                    help="extra backends: module:attr or path.py (repeatable)")
    group.addoption("--difftest-reference", default=None,
                    help="reference backend (default: torch-ref)")
    group.addoption("--difftest-artifacts", default=None,
                    help="directory for pending cases and failure artifacts "
                         "(default: difftest-artifacts)")
    group.addoption("--difftest-report", default=None, metavar="PATH",
                    help="write the JSON report of this run (schema: docs/report-schema.md)")
    group.addoption("--difftest-shard", default=None, metavar="K/N",
                    help="run only shard K of N (1-based) of the cases, split by case id")
    group.addoption("--difftest-search-budget", default=None, metavar="SECONDS",
                    help="seconds a generated test may search before it stops with the "
                         "examples it ran (default: 240 in the dev profile, none in ci and "
                         "nightly; 0: none)")


SUITE = "difftest.kernel_tests"  # the installed differential suite (a package of tests)


def runs_the_suite(config: pytest.Config) -> bool:
    """Whether the command line names the installed suite (``--pyargs difftest.kernel_tests``,
    or one of its modules or tests)."""
    return bool(config.getoption("pyargs", False)) and any(
        str(arg).split("::")[0] == SUITE or str(arg).startswith(f"{SUITE}.")
        for arg in config.args)


def in_use(config: pytest.Config) -> bool:
    """Whether this run enabled difftest: a ``--difftest-*`` option, ``difftest = true``, or
    the installed suite named on the command line."""
    return bool(config.getini(INI_NAME)) or runs_the_suite(config) or any(
        config.getoption(name) is not None for name in OPTIONS)


def pytest_configure(config: pytest.Config) -> None:
    """Activate difftest (pinning a worker's GPU first) when this run enabled it."""
    if in_use(config):
        from difftest.frontends import pytest_run

        pytest_run.activate(config)


def _active(config: pytest.Config) -> DifftestRun:
    """The active difftest of this process, started now if a fixture is its first use."""
    from difftest.frontends import pytest_run

    return pytest_run.current(config) or pytest_run.activate_late(config)


@pytest.fixture(scope="session")
def difftest_session(pytestconfig: pytest.Config) -> Session:
    """The configured :class:`~difftest.run.session.Session` of this process."""
    return _active(pytestconfig).session()


@pytest.fixture(scope="session")
def difftest_case_strategy(pytestconfig: pytest.Config) -> SearchStrategy[Case]:
    """Generated cases every configured backend runs (draw it with ``st.data()``)."""
    return _active(pytestconfig).case_strategy()


@pytest.fixture(scope="session")
def check_case(pytestconfig: pytest.Config) -> Callable[[Case], CaseResult]:
    """``check_case(case)``: run it on every configured backend; fail on any disagreement."""
    return _active(pytestconfig).check


@pytest.fixture(scope="session")
def check_example(pytestconfig: pytest.Config) -> Callable[[Case], list[CaseResult]]:
    """``check_example(case)``, for a case drawn from ``difftest_case_strategy``: every
    configured backend runs it or the variant of it fitted to the backend; fail on any
    disagreement. Returns one result per run."""
    return _active(pytestconfig).check_example
