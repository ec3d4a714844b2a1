"""The copyable CI examples (examples/ci/): each validates against the published schema of its
CI system (check-jsonschema's vendored GitHub workflow and Buildkite schemas, offline; .ci/run
installs it in a venv of its own and puts it on the PATH), both run the same difftest
commands, and those commands run on the CPU as written, with a tiny case set: the baseline,
the candidate on the baseline's cases, and a gate that passes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from difftest.run.jobs import auto_jobs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "ci"
GITHUB = EXAMPLES / "github-actions-bump-gate.yml"
BUILDKITE = EXAMPLES / "buildkite-bump-gate.yml"
CHECKER = shutil.which("check-jsonschema")
needs_checker = pytest.mark.skipif(
    CHECKER is None, reason="check-jsonschema is not on the PATH (.ci/run installs it in a "
    "venv of its own: pip install check-jsonschema; an offline CI cannot)")


def check(path: Path, schema: str) -> subprocess.CompletedProcess[str]:
    """check-jsonschema against one of its vendored schemas (no network)."""
    assert CHECKER is not None
    return subprocess.run([CHECKER, "--builtin-schema", schema, str(path)],
                          capture_output=True, text=True, timeout=120, check=False)


@needs_checker
@pytest.mark.parametrize(("path", "schema", "typo"), [
    (GITHUB, "vendor.github-workflows", ("    runs-on: ", "    runs_on: ")),
    (BUILDKITE, "vendor.buildkite", ("    timeout_in_minutes: 120", "    timeout_in_minutes: x")),
], ids=["github-actions", "buildkite"])
def test_each_example_validates_against_its_published_schema(path: Path, schema: str,
                                                             typo: tuple[str, str],
                                                             tmp_path: Path) -> None:
    done = check(path, schema)
    assert done.returncode == 0 and "ok -- validation done" in done.stdout, done.stdout
    broken = tmp_path / path.name  # the check is not blind: one wrong key or value fails it
    assert typo[0] in path.read_text()
    broken.write_text(path.read_text().replace(*typo, 1))
    assert check(broken, schema).returncode == 1


def difftest_commands(path: Path) -> list[str]:
    """The difftest command lines of an example, in file order, which is the order its jobs
    or steps run them (Buildkite's ``$$``, a variable left to the step's shell, read as
    ``$``)."""
    lines = [line.strip().removeprefix("run: ").removeprefix("command: ").replace("$$", "$")
             for line in path.read_text().splitlines()]
    return [line for line in lines if line.startswith("difftest ")]


def test_both_examples_gate_with_the_same_commands() -> None:
    commands = difftest_commands(GITHUB)
    assert commands == difftest_commands(BUILDKITE)
    assert any("--cases-from baseline.json" in c and "--jobs auto" in c for c in commands)
    assert commands[-1] == "difftest gate baseline.json candidate.json"
    assert sum("--junit" in c for c in commands) == 2 and len(commands) == 5


def test_the_commands_run_on_the_cpu_and_the_gate_passes(tmp_path: Path) -> None:
    """The examples' own command lines (their variables set small: one generated example,
    one backend that runs here), in a bare directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(EXAMPLES="1", BACKENDS="vllm-paged-decode",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    outputs = []
    for command in difftest_commands(GITHUB):
        done = subprocess.run(["bash", "-e", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
        outputs.append(done.stdout)
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    candidate = json.loads((tmp_path / "candidate.json").read_text())
    assert baseline["config"]["jobs"] == candidate["config"]["jobs"] == auto_jobs()
    ids = [c["case_id"] for c in baseline["cases"]]
    assert ids and ids == [c["case_id"] for c in candidate["cases"]]
    for name in ("baseline.xml", "candidate.xml"):
        suites = {s.get("name"): s for s in ET.parse(tmp_path / name).getroot()}
        assert int(suites["vllm-paged-decode"].get("tests")) == len(ids)
    assert "environment: identical versions" in outputs[-1]
    assert "GATE PASSED: no regression" in outputs[-1]
