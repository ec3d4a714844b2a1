"""Crashes under ``pytest -n``, failure artifacts, and bit-identical replay in a fresh process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from difftest.case.spec import Case
from difftest.machine import devices

BACKENDS_FILE = (Path(__file__).parent / "fake_backends.py").read_text()

TESTS = '''
import pytest
from difftest.case.spec import Case

def tiny(seed):
    return Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),),
                seed=seed)

@pytest.mark.parametrize("seed", range(4))
def test_tiny(seed, check_case):
    check_case(tiny(seed))
'''

HYPOTHESIS_TEST = '''
from hypothesis import given, settings, strategies as st, target
from test_tiny import tiny

@settings(max_examples=5)
@given(seed=st.integers(1, 10**6))
def test_generated(seed, check_case):
    target(float(seed), label="as tests/test_differential.py targets error/tolerance")
    check_case(tiny(seed))
'''

REPLAY_STABLE_FIELDS = ("backend", "status", "detail", "versions", "comparison",
                        "output_sha256")


def tiny(seed: int) -> Case:
    """The case the subprocess tests run for ``seed``."""
    return Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),),
                seed=seed)


def clean_env() -> dict[str, str]:
    """This environment without GPU masks or xdist worker variables, Hypothesis profile ci."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k not in (
               "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
               "DIFFTEST_FAKE_GPUS")}
    return env | {"HYPOTHESIS_PROFILE": "ci"}


def run(directory: Path, *command: str) -> subprocess.CompletedProcess:
    """A fresh Python process running ``-m pytest ...`` or ``-m difftest.cli ...``."""
    return subprocess.run([sys.executable, "-m", *command], cwd=directory, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def pytest_run(directory: Path, *args: str) -> subprocess.CompletedProcess:
    """``pytest ARGS`` with the test plug-in backends."""
    return run(directory, "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
               "--difftest-plugin", "fakes.py", *args)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory with the plug-in backends and the tiny test file."""
    (tmp_path / "fakes.py").write_text(BACKENDS_FILE)
    (tmp_path / "test_tiny.py").write_text(TESTS)
    return tmp_path


def test_crashing_worker_leaves_a_replayable_crash_artifact(project: Path) -> None:
    done = pytest_run(project, "-n", "2", "--difftest-backends", "crasher,rounded",
                      "--difftest-report", "report.json")
    assert done.returncode == 1, done.stdout + done.stderr
    crashed = {tiny(s).case_id for s in (0, 3)}
    failures = project / "difftest-artifacts" / "failures"
    for case_id in crashed:
        directory = failures / case_id
        assert (f"CRASH case {case_id}: replay with difftest repro "
                f"difftest-artifacts/failures/{case_id}") in done.stdout
        assert sorted(p.name for p in directory.iterdir()) == [
            "case.json", "fingerprint.json", "repro.txt", "results.json"]
        assert Case.from_json((directory / "case.json").read_text()).case_id == case_id
        recorded = json.loads((directory / "results.json").read_text())
        assert [(r["backend"], r["status"]) for r in recorded["results"]] == [
            ("crasher", "crash")]
        assert "died while crasher ran" in recorded["results"][0]["detail"]
        assert recorded["unjudged"] == ["rounded"]
        assert json.loads((directory / "fingerprint.json").read_text())["versions"]["torch"]
        assert (directory / "repro.txt").read_text().startswith(
            f"difftest repro {directory.relative_to(project)}")
    assert not list((project / "difftest-artifacts" / "pending").iterdir())
    report = json.loads((project / "report.json").read_text())
    statuses = {c["case_id"]: sorted((r["backend"], r["status"]) for r in c["results"])
                for c in report["cases"]}
    assert statuses == {tiny(s).case_id: (
        [("crasher", "crash")] if s % 3 == 0 else
        [("crasher", "agree"), ("rounded", "agree")]) for s in range(4)}

    # Replayed in a fresh process without the crashing backend: the case runs and agrees.
    case_id = tiny(3).case_id
    artifact = f"difftest-artifacts/failures/{case_id}"
    replay = run(project, "difftest.cli", "repro", artifact, "--plugin", "fakes.py",
                 "--backends", "rounded")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert replay.stdout.startswith(f"case {case_id}")
    assert "rounded                  agree" in replay.stdout
    assert "crasher                  not run" in replay.stdout
    # With the crashing backend the replay dies again, and the next command reports it.
    again = run(project, "difftest.cli", "repro", artifact, "--plugin", "fakes.py",
                "--backends", "crasher")
    assert again.returncode == 77
    later = run(project, "difftest.cli", "repro", artifact, "--backends", "triton-unified",
                "--device", "cpu")
    assert (f"CRASH case {case_id} (an earlier run died in it): replay with difftest repro "
            f"difftest-artifacts/replays/failures/{case_id}") in later.stderr


def test_failure_under_pytest_n4_replays_bit_identically(project: Path) -> None:
    done = pytest_run(project, "-n", "4", "--difftest-backends", "perturbed,triton-unified",
                      "--difftest-report", "report.json", "--junitxml", "junit.xml")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((project / "report.json").read_text())
    if devices.physical_gpu_count() == 0:  # CPU only: nothing to pin, every worker on the CPU
        assert len(report["workers"]) == 4
        assert all(w["gpu_env"] == {} and w["device"] == "cpu"
                   for w in report["workers"].values())

    case_id = tiny(1).case_id
    artifact = f"difftest-artifacts/failures/{case_id}"
    assert f"replay: difftest repro {artifact}" in done.stdout
    recorded = json.loads((project / artifact / "results.json").read_text())
    replay = run(project, "difftest.cli", "repro", artifact, "--plugin", "fakes.py",
                 "--backends", "perturbed,triton-unified", "--report", "replay.json")
    assert replay.returncode == 1, replay.stdout + replay.stderr
    replayed = json.loads((project / "replay.json").read_text())["cases"][0]
    assert replayed["case_id"] == case_id

    def stable(entry: dict) -> list[dict]:
        return [{k: r[k] for k in REPLAY_STABLE_FIELDS} for r in entry["results"]]

    assert stable(replayed) == stable(recorded)
    assert all(r["output_sha256"] for r in recorded["results"])
    assert [r["status"] for r in recorded["results"]] == ["disagree", "agree"]
    assert replay.stdout.count("bit-identical") == 2 and "differs" not in replay.stdout
    assert "request 0, query token 0 (row 0), head 0, dim 0" in replay.stdout
    assert "on pages 0..7, 16" in replay.stdout

    # With no --backends, from a shell that has not set up Triton's interpreter: the
    # installed backends load after the CPU runtime is prepared, or vLLM's Triton is a
    # placeholder and every vLLM kernel errors.
    env = {k: v for k, v in clean_env().items() if k != "TRITON_INTERPRET"}
    every = subprocess.run([sys.executable, "-m", "difftest.cli", "repro", artifact, "--plugin",
                            "fakes.py", "--device", "cpu"], cwd=project, env=env,
                           capture_output=True, text=True, timeout=300)
    assert every.returncode == 1, every.stdout + every.stderr
    rows = {line.split()[0]: line.split()[1] for line in every.stdout.splitlines()
            if line.startswith("  ") and len(line.split()) > 1}
    assert rows["perturbed"] == "disagree" and rows["triton-unified"] == "agree", every.stdout
    assert "error" not in rows.values(), every.stdout

    # JUnit carries one property per case with every backend's status.
    properties = {p.get("name"): p.get("value")
                  for p in ET.parse(project / "junit.xml").iter("property")}
    assert properties[f"difftest:{case_id}"].startswith("perturbed=disagree(")
    assert ";triton-unified=agree(" in properties[f"difftest:{case_id}"]


def test_hypothesis_failure_keeps_its_blob_and_drops_its_shrink_steps(project: Path) -> None:
    (project / "test_generated.py").write_text(HYPOTHESIS_TEST)
    done = pytest_run(project, "test_generated.py", "--difftest-backends", "perturbed",
                      "--difftest-report", "report.json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "@reproduce_failure(" in done.stdout
    # Hypothesis's wording changed between releases; runner images pin their own.
    assert re.search(r"Falsifying example|Failing test case", done.stdout), done.stdout
    assert re.search(r"-{5,} Hypothesis -{5,}", done.stdout), done.stdout
    cases = json.loads((project / "report.json").read_text())["cases"]
    # The first failing example and the minimal one (Hypothesis shrinks the seed to 1).
    assert 1 <= len(cases) <= 2 and tiny(1).case_id in {c["case_id"] for c in cases}
    failures = project / "difftest-artifacts" / "failures"
    assert sorted(p.name for p in failures.iterdir()) == sorted(c["case_id"] for c in cases)
    hint = (failures / tiny(1).case_id / "pytest.txt").read_text()
    assert hint.startswith("pytest test: test_generated.py::test_generated")
    assert "@reproduce_failure(" in hint
    assert f"replay: difftest repro difftest-artifacts/failures/{tiny(1).case_id}" in done.stdout
