"""A generated test's search budget: past it the search stops with what it ran, a pass when it
found nothing, the failure it found otherwise; both say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_crash_and_repro import BACKENDS_FILE, pytest_run

SEARCH = '''
from hypothesis import given, settings, strategies as st
from test_tiny import tiny

@settings(max_examples=40, database=None)
@given(seed=st.integers(1, 10**6))
def test_generated(seed, check_example):
    check_example(tiny(seed))
'''
TINY = '''
from difftest.case.spec import Case

def tiny(seed):
    return Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),),
                seed=seed)
'''


@pytest.fixture
def search(tmp_path: Path) -> Path:
    """A project whose one test searches 40 generated examples."""
    (tmp_path / "fakes.py").write_text(BACKENDS_FILE)
    (tmp_path / "test_tiny.py").write_text(TINY)
    (tmp_path / "test_generated.py").write_text(SEARCH)
    return tmp_path


def test_a_search_past_its_budget_stops_and_passes_with_what_it_ran(search: Path) -> None:
    done = pytest_run(search, "test_generated.py", "--difftest-backends", "rounded",
                      "--difftest-search-budget", "0.000001", "--difftest-report", "r.json")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert ("SEARCH STOPPED: test_generated.py::test_generated: search stopped after 1 "
            "example(s) at its 1e-06 s budget (--difftest-search-budget SECONDS, 0: none)"
            ) in out, out
    assert len(json.loads((search / "r.json").read_text())["cases"]) == 1
    assert "1 passed" in out, out


def test_without_a_budget_the_search_runs_every_example(search: Path) -> None:
    done = pytest_run(search, "test_generated.py", "--difftest-backends", "rounded",
                      "--difftest-search-budget", "0", "--difftest-report", "r.json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SEARCH STOPPED" not in done.stdout
    assert len(json.loads((search / "r.json").read_text())["cases"]) == 40


def test_a_failure_found_before_the_budget_ran_out_fails_the_test(search: Path) -> None:
    """The budget runs out while Hypothesis shrinks: the test fails with the failure found,
    its replay command, and why the shrink stopped."""
    done = pytest_run(search, "test_generated.py", "--difftest-backends", "perturbed",
                      "--difftest-search-budget", "0.000001")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "search stopped after 1 example(s) at its 1e-06 s budget" in out, out
    assert "perturbed" in out and "replay: difftest repro difftest-artifacts/failures/" in out
    assert "SEARCH STOPPED: test_generated.py::test_generated" in out, out


def test_the_line_reaches_the_controller_under_xdist(search: Path) -> None:
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (offline setup)")
    done = pytest_run(search, "-n", "2", "test_generated.py", "test_tiny.py",
                      "--difftest-backends", "rounded", "--difftest-search-budget", "0.000001")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "SEARCH STOPPED: test_generated.py::test_generated: search stopped after 1" in out


def test_a_bad_budget_is_refused_naming_the_option(search: Path) -> None:
    for bad in ("soon", "-1"):
        done = pytest_run(search, "test_tiny.py", "--difftest-search-budget", bad)
        assert done.returncode == 4, done.stdout + done.stderr
        assert (f"--difftest-search-budget={bad!r} is not a number of seconds (allowed: >= 0;"
                in done.stderr), done.stderr

