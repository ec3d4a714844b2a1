"""The wheel holds one top-level package, difftest (every layer package included), no
benchmarks/ or mutants/, the case corpus included, every entry point resolvable in it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator
from configparser import ConfigParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "difftest", "mutants", "benchmarks")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    """The wheel pip builds from a copy of the checkout (offline, no build isolation)."""
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(path, source / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "-w", str(tmp),
                    str(source)], env=env, check=True, timeout=300)
    (built,) = tmp.glob("difftest-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def test_the_only_top_level_package_is_difftest(wheel: zipfile.ZipFile) -> None:
    top = {name.split("/", 1)[0] for name in wheel.namelist()}
    dist_info = {name for name in top if name.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("difftest-")
    assert top - dist_info == {"difftest"}


def test_every_layer_package_lives_in_the_namespace(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    packages = [p.parent for p in (ROOT / "difftest").glob("*/__init__.py")]
    assert {"backends", "generation", "run"} <= {p.name for p in packages}
    for package in packages:
        modules = {p.name for p in package.glob("*.py")}
        prefix = package.relative_to(ROOT).as_posix()
        assert modules and {f"{prefix}/{m}" for m in modules} <= names
    assert not any("/mutants/" in n or "/benchmarks/" in n or n.startswith(("mutants/",
                   "benchmarks/")) for n in names)


def test_the_case_corpus_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    corpus = {p.name for p in (ROOT / "difftest" / "generation" / "corpus").glob("*.json")}
    packed = {n.rsplit("/", 1)[1] for n in wheel.namelist()
              if n.startswith("difftest/generation/corpus/") and n.endswith(".json")}
    assert corpus and packed == corpus


def test_the_known_bugs_file_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    """An installed difftest reports known bugs as a checkout does."""
    packed = wheel.read("difftest/judgement/expectations.json")
    assert packed == (ROOT / "difftest" / "judgement" / "expectations.json").read_bytes()


def test_the_json_schemas_are_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    """An installed difftest ships the case and report schemas its docs point at."""
    for path in ("difftest/case/case.schema.json", "difftest/reporting/report.schema.json"):
        assert wheel.read(path) == (ROOT / path).read_bytes()


def test_every_entry_point_names_a_module_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = (n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    parser = ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    names = set(wheel.namelist())
    targets = [value for section in parser.sections() for value in parser[section].values()]
    assert any(t.startswith("difftest.backends.") for t in targets)
    for target in targets:
        module = target.split(":", 1)[0].strip()
        path = module.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, target


def test_the_installed_suite_runs_from_the_wheel_without_a_checkout(
        wheel: zipfile.ZipFile, tmp_path: Path) -> None:
    """A venv over this environment's packages (their ``.pth`` files unread, so the
    checkout's editable difftest is not among them) with the wheel installed: `pytest -n 2
    --pyargs difftest.kernel_tests` from a directory without the checkout runs the corpus and
    a generated search on vllm-paged-decode (CPU, interpreted), each test passing or skipped
    with its reason."""
    pytest.importorskip("xdist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True, timeout=60).stdout.strip()
    parents = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    Path(purelib, "_parent_packages.pth").write_text("\n".join(parents) + "\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTEST_", "HYPOTHESIS_"))}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, CI="true")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", str(wheel.filename)], env=env, check=True,
                   timeout=300)
    elsewhere = tmp_path / "runner"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import difftest; print(difftest.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
                           timeout=60).stdout
    assert where.startswith(purelib), where  # the wheel's copy, not the checkout
    done = subprocess.run([str(python), "-m", "pytest", "-n", "2", "-rs", "-p",
                           "no:cacheprovider", "--pyargs", "difftest.kernel_tests",
                           "--difftest-backends", "vllm-paged-decode,aiter-gluon",
                           "--difftest-optional", "aiter-gluon", "--difftest-device", "cpu",
                           "--difftest-search-budget", "2", "--junitxml", "suite.xml",
                           "--difftest-report", "report.json"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not (elsewhere / "tests").exists() and "tests/" not in output.split("==")[0]
    suite = ET.parse(elsewhere / "suite.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    names = {c.get("name") for c in cases}
    assert {"test_generated[vllm-paged-decode]", "test_generated[aiter-gluon]"} <= names
    skipped = [c.find("skipped") for c in cases if c.find("skipped") is not None]
    assert skipped and all(s.get("message", "").startswith(("unavailable: ", "unsupported: "))
                           for s in skipped), [s.get("message") for s in skipped]
    assert int(suite.get("failures")) == int(suite.get("errors")) == 0
    assert len(cases) - len(skipped) >= 2  # passed: vllm-paged-decode ran
    assert "PASSED:" in output  # difftest's verdict line: the suite ran as difftest
    # each xdist worker was activated when it started (pinned; none started it late)
    report = json.loads((elsewhere / "report.json").read_text())
    assert sorted(report["workers"]) == ["gw0", "gw1"]
    assert all(w["device"] == "cpu" for w in report["workers"].values())
