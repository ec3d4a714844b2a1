"""The pytest plugin: options, Hypothesis profiles, the differential fixture, the summary.

Loaded through the ``pytest11`` entry point. ``check_case(case)`` runs a case on the
configured backends and fails with every disagreement's message and the command that
replays it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from difftest import devices
from difftest.artifacts import DEFAULT_ROOT, repro_command
from difftest.case import Case
from difftest.runner import CaseResult
from difftest.session import DEFAULT_REFERENCE, Session

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, database=None, print_blob=True,
    suppress_health_check=_SLOW)
settings.register_profile(
    "dev", max_examples=50, deadline=None, print_blob=True, suppress_health_check=_SLOW,
    database=DirectoryBasedExampleDatabase(".hypothesis/examples"))
settings.register_profile(
    "nightly", max_examples=2000, deadline=None, print_blob=True, suppress_health_check=_SLOW,
    phases=list(Phase), database=DirectoryBasedExampleDatabase(".hypothesis/examples"))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else
                                     "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--difftest-*`` options."""
    group = parser.getgroup("difftest", "differential testing of attention kernels")
    group.addoption("--difftest-backends", default=None,
                    help="comma-separated backends to compare (default: all discovered)")
    group.addoption("--difftest-device", default="auto", choices=devices.DEVICE_CHOICES,
                    help="device the kernels run on")
    group.addoption("--difftest-plugin", action="append", default=[],
                    help="extra backends: module:attr or path.py (repeatable)")
    group.addoption("--difftest-reference", default=DEFAULT_REFERENCE,
                    help="reference backend")
    group.addoption("--difftest-artifacts", default=DEFAULT_ROOT,
                    help="directory for pending cases and failure artifacts")


def pytest_configure(config: pytest.Config) -> None:
    """Prepare the CPU runtime before any test module can import vLLM."""
    if devices.resolve(config.getoption("--difftest-device")) == "cpu":
        devices.prepare_runtime("cpu")


@pytest.fixture(scope="session")
def difftest_session(pytestconfig: pytest.Config) -> Session:
    """The configured :class:`~difftest.session.Session` of this process."""
    names = pytestconfig.getoption("--difftest-backends")
    return Session.create(
        backend_names=None if names is None else [n for n in names.split(",") if n],
        plugins=pytestconfig.getoption("--difftest-plugin"),
        device=pytestconfig.getoption("--difftest-device"),
        artifacts=pytestconfig.getoption("--difftest-artifacts"),
        reference=pytestconfig.getoption("--difftest-reference"),
    )


def failure_text(result: CaseResult) -> str:
    """Every failing backend's message, then how to replay the case."""
    text = "\n\n".join(result.failure_messages())
    if result.artifact:
        text += f"\n\nreplay: {repro_command(Path(result.artifact))}"
    return text


@pytest.fixture(scope="session")
def check_case(difftest_session: Session) -> Callable[[Case], CaseResult]:
    """``check_case(case)``: run it on every configured backend; fail on any disagreement."""

    def check(case: Case) -> CaseResult:
        result = difftest_session.run(case)
        if result.failed:
            pytest.fail(failure_text(result), pytrace=False)
        return result

    return check
