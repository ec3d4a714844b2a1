"""scripts/setup.sh offline: with every need present it installs nothing and says so in one line.

pip is cut off from every index (PIP_NO_INDEX, no config file, no find-links), so a run that
tried to install anything would fail; the resolver's "requires ..., which is not installed"
report for the --no-deps vLLM must not appear.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"
RESOLVER_NOISE = re.compile(r"requires .*which is not installed|^ERROR", re.M)


def offline_env(**extra: str) -> dict[str, str]:
    """The environment with pip unable to reach any index or wheel folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, **extra)
    return env


def run_setup(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """scripts/setup.sh offline, on the venv running these tests unless ``extra`` names one."""
    extra.setdefault("DIFFTEST_VENV", sys.prefix)
    return subprocess.run(["bash", str(SETUP), *args], env=offline_env(**extra),
                          capture_output=True, text=True, timeout=300, check=False)


def summary_of(result: subprocess.CompletedProcess[str]) -> str:
    """The one summary line, after checking nothing else was printed."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert not RESOLVER_NOISE.search(output), output
    lines = output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup ("), output
    return lines[0]


def in_venv() -> bool:
    """Whether these tests run in a venv that scripts/setup.sh made (``.venv`` or the
    ``DIFFTEST_VENV`` of a runner image's CI leg)."""
    return sys.prefix != sys.base_prefix and (Path(sys.prefix) / "difftest-setup.stamp").is_file()


@pytest.mark.skipif(not in_venv(), reason="needs a venv made by scripts/setup.sh")
def test_offline_rerun_with_the_test_tools_reuses_everything() -> None:
    line = summary_of(run_setup("--test"))
    assert "installed nothing" in line
    assert "difftest editable (unchanged)" in line
    for name in ("torch", "triton", "vllm", "hypothesis", "pytest"):
        assert re.search(rf"reused .*\b{re.escape(name)} \S", line), (name, line)
    for name in ("pytest-xdist", "ruff"):  # optional offline: reused, or named as skipped
        assert re.search(rf"reused .*\b{re.escape(name)} \S|not installed \(offline.*"
                         rf"\b{re.escape(name)}>=", line), (name, line)


@pytest.mark.skipif(not in_venv(), reason="needs a venv made by scripts/setup.sh")
def test_runtime_setup_leaves_the_test_tools_out() -> None:
    line = summary_of(run_setup())
    assert line.startswith("setup (runtime): ")
    assert "torch" in line and "vllm" in line
    assert "pytest" not in line and "ruff" not in line and "matplotlib" not in line


def test_unknown_argument_is_an_error_naming_it() -> None:
    result = run_setup("--tests")
    assert result.returncode == 2
    assert "unknown argument '--tests'" in result.stderr and "--test" in result.stderr


@pytest.mark.skipif(not in_venv(), reason="needs a venv made by scripts/setup.sh")
def test_offline_setup_over_a_preinstalled_image(tmp_path: Path) -> None:
    """A new venv made from a python whose venv holds the needs (a runner image) works offline.

    The new venv sees that venv's packages and nothing more: its site directories, in their
    order, are its own then exactly those of the python it was made from (torch is the very
    torch this process imports, wherever it sits: in the venv or in the image beneath it; the
    base interpreter's packages stay out unless that venv sees them). pip installs nothing
    from any index, and only the project itself is installed (editable, no download needed).
    """
    venv = tmp_path / "venv"
    line = summary_of(run_setup("--test", PYTHON=sys.executable, DIFFTEST_VENV=str(venv)))
    assert f"new {venv} over the packages of {sys.executable}" in line
    assert "installed nothing" in line and "difftest editable (installed)" in line
    probe = ("import importlib.util as u, json, os, sys;"
             " import difftest.backends, difftest.generation;"
             " print(json.dumps([sys.prefix, u.find_spec('torch').origin, [p for p in sys.path"
             " if os.path.basename(p) in ('site-packages', 'dist-packages')]]))")
    prefix, torch_origin, sites = json.loads(subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path).stdout)
    _, _, parent_sites = json.loads(subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path).stdout)
    assert Path(prefix) == venv
    assert Path(torch_origin) == Path(importlib.util.find_spec("torch").origin)
    assert Path(sites[0]).is_relative_to(venv) and sites[1:] == parent_sites, (sites, parent_sites)
