"""A foreign project's pytest run in difftest's environment is untouched by the plugin.

The ``pytest11`` entry point loads :mod:`difftest.pytest_plugin` into every pytest run of the
venv (vLLM's and AITER's suites on a shared runner image). Unless difftest is in use, it must
import nothing heavy and leave Hypothesis's settings as Hypothesis chose them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FOREIGN_TEST = '''
import json
import sys

from hypothesis import given, settings, strategies as st
from hypothesis.errors import InvalidArgument


@given(st.integers())
def test_hypothesis_runs_with_its_own_defaults(n):
    assert isinstance(n, int)


def test_record_what_the_run_looks_like():
    profiles = {}
    for name in ("difftest-ci", "difftest-dev", "difftest-nightly"):
        try:
            settings.get_profile(name)
            profiles[name] = True
        except InvalidArgument:
            profiles[name] = False
    with open("seen.json", "w") as fh:
        json.dump({"modules": sorted(sys.modules), "profile": settings.get_current_profile_name(),
                   "max_examples": settings.default.max_examples,
                   "deadline": str(settings.default.deadline),
                   "derandomize": settings.default.derandomize,
                   "difftest_profiles": profiles}, fh)
'''

HEAVY = ("torch", "triton", "vllm", "numpy", "difftest.run.runner", "difftest.run.session",
         "difftest.results.artifacts", "difftest.frontends.pytest_run", "difftest.machine.devices",
         "difftest.contract.registry")


def _foreign_env() -> dict[str, str]:
    """This environment without CI markers, pytest/xdist variables or difftest's profile."""
    drop = ("CI", "HYPOTHESIS_PROFILE", "PYTEST_ADDOPTS", "GITHUB_ACTIONS")
    return {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith("PYTEST_XDIST")}


def _run_foreign(directory: Path, *args: str, passed: int = 2) -> dict:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           *args], cwd=directory, env=_foreign_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{passed} passed" in done.stdout, done.stdout
    return json.loads((directory / "seen.json").read_text())


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """A project of its own: its pytest.ini, one Hypothesis test, one recording test."""
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = .\n")
    (tmp_path / "test_foreign.py").write_text(FOREIGN_TEST)
    return tmp_path


def test_a_foreign_pytest_run_imports_nothing_heavy_and_keeps_hypothesis_defaults(
        foreign: Path) -> None:
    seen = _run_foreign(foreign)
    assert "difftest.pytest_plugin" in seen["modules"]  # loaded, as every pytest11 plugin is
    assert [m for m in HEAVY if m in seen["modules"]] == []
    assert [m for m in seen["modules"] if m.startswith("difftest.")] == [
        "difftest.pytest_plugin"]
    assert seen["profile"] == "default"
    assert seen["max_examples"] == 100 and seen["deadline"] != "None"
    assert seen["derandomize"] is False
    assert seen["difftest_profiles"] == dict.fromkeys(
        ("difftest-ci", "difftest-dev", "difftest-nightly"), False)


def test_under_xdist_too(foreign: Path) -> None:
    seen = _run_foreign(foreign, "-n", "1")
    assert [m for m in HEAVY if m in seen["modules"]] == []
    assert seen["profile"] == "default" and seen["max_examples"] == 100


def test_the_ini_switch_activates_difftest(foreign: Path) -> None:
    """The same project with ``difftest = true``: the plugin is active, with its profile."""
    (foreign / "pytest.ini").write_text("[pytest]\ntestpaths = .\ndifftest = true\n")
    seen = _run_foreign(foreign)
    assert "difftest.frontends.pytest_run" in seen["modules"]
    assert seen["profile"] == "difftest-dev" and seen["max_examples"] == 50


FIXTURE_TEST = '''
import json

from hypothesis import settings


def test_asks_for_the_session(difftest_session):
    with open("session.json", "w") as fh:
        json.dump({"reference": difftest_session.reference.name,
                   "profile": settings.get_current_profile_name()}, fh)
'''


def test_asking_for_a_fixture_activates_difftest_without_touching_hypothesis(
        foreign: Path) -> None:
    (foreign / "test_fixture.py").write_text(FIXTURE_TEST)
    seen = _run_foreign(foreign, "-p", "no:randomly", passed=3)
    assert json.loads((foreign / "session.json").read_text()) == {
        "reference": "torch-ref", "profile": "default"}
    # test_fixture.py ran first: the project's later tests still had Hypothesis's defaults.
    assert seen["profile"] == "default" and seen["max_examples"] == 100

