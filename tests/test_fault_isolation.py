"""A broken backend never aborts a run: each stage's fault is injected and reported.

Discovery (an entry point whose module fails to import, or whose factory raises),
availability and ``versions()`` faults make the backend ``unavailable`` with the exception;
prepare (the support check, its cache), run and compare faults are that backend's ``error`` on
each case. The run goes on with the other backends and writes its report, under the CLI and
under pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftest import cli

FAKES = Path(__file__).parent / "fake_backends.py"
FAULTY = "FAULTY_BACKENDS"

# backend -> (status, text its detail or reason must hold)
EXPECTED = {
    "rounded": ("agree", ""),
    "probe-raises": ("unavailable",
                     "its availability probe raised RuntimeError: driver query failed"),
    "versions-raise": ("unavailable", "its versions() raised ModuleNotFoundError: No module "
                                      "named 'vllm._C_stable_libtorch'"),
    "support-raises": ("error", "deciding whether it supports the case failed:\nKeyError: "
                                "'capability table has no entry for this head count'"),
    "cache-fails": ("error", "building its cache failed:"),
    "run-raises": ("error", "RuntimeError: HIP error: invalid device function"),
    "precision-raises": ("error", "its output could not be compared:\nValueError: no "
                                  "precision declared for this dtype"),
    "not-a-tensor": ("error", "its output could not be compared:"),
    "broken-import": ("unavailable", "entry point broken-import = no_such_module_for_difftest:"
                                     "Backend failed to load: ModuleNotFoundError: No module "
                                     "named 'no_such_module_for_difftest'"),
    "broken-factory": ("unavailable", "entry point broken-factory = difftest_faulty_factory:"
                                      "backends failed to load: RegistryError: entry point "
                                      "broken-factory: calling 'backends' raised OSError: "
                                      "device table missing"),
}


@pytest.fixture
def broken_entry_points(tmp_path: Path) -> Path:
    """A directory holding an installed distribution with two broken ``difftest.backends``
    entry points (put it on ``sys.path`` / ``PYTHONPATH``)."""
    site = tmp_path / "site"
    info = site / "difftest_broken_plugins-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: difftest-broken-plugins\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[difftest.backends]\n"
        "broken-import = no_such_module_for_difftest:Backend\n"
        "broken-factory = difftest_faulty_factory:backends\n")
    (site / "difftest_faulty_factory.py").write_text(
        "def backends():\n    raise OSError('device table missing')\n")
    return site


def _statuses(report: dict) -> dict[str, tuple[str, str]]:
    [case] = report["cases"]
    return {r["backend"]: (r["status"], r["detail"]) for r in case["results"]}


def _check(statuses: dict[str, tuple[str, str]], backends: dict) -> None:
    assert sorted(statuses) == sorted(EXPECTED)
    for name, (status, text) in EXPECTED.items():
        assert statuses[name][0] == status, (name, statuses[name])
        assert text in statuses[name][1], (name, statuses[name][1])
        if status == "unavailable":
            assert backends[name]["available"] is False
            assert text in backends[name]["reason"]
    assert backends["rounded"]["available"] is True


def test_the_cli_run_reports_every_fault_and_runs_the_rest(
        tmp_path: Path, broken_entry_points: Path, monkeypatch: pytest.MonkeyPatch, capsys,
        device_name: str) -> None:
    monkeypatch.syspath_prepend(str(broken_entry_points))
    report = tmp_path / "report.json"
    code = cli.main(["run", "--no-corpus", "--examples", "1", "--device", device_name,
                     "--plugin", f"{FAKES}:{FAULTY}", "--backends", ",".join(EXPECTED),
                     "--artifacts", str(tmp_path / "art"), "--report", str(report)])
    assert code == 1  # errors fail the run; it still ran every backend and wrote the report
    written = json.loads(report.read_text())
    _check(_statuses(written), written["backends"])
    assert "Traceback" not in capsys.readouterr().out


def test_difftest_backends_lists_broken_backends_as_unavailable(
        broken_entry_points: Path, monkeypatch: pytest.MonkeyPatch, capsys,
        device_name: str) -> None:
    monkeypatch.syspath_prepend(str(broken_entry_points))
    assert cli.main(["backends", "--device", device_name,
                     "--plugin", f"{FAKES}:{FAULTY}"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    for name, (status, text) in EXPECTED.items():
        if status == "unavailable":
            assert f"{name} " in lines[name] and " unavailable " in lines[name]
            assert text.splitlines()[0] in lines[name]
    assert " available " in lines["rounded"] and " available " in lines["run-raises"]
    assert " available " in lines["torch-ref"]


TESTS = '''
from difftest.case.spec import Case

def test_tiny(check_case):
    check_case(Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                    selections=((0, 1),), seed=1))
'''


def test_under_pytest_every_fault_is_reported_and_the_report_written(
        tmp_path: Path, broken_entry_points: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "fakes.py").write_text(FAKES.read_text())
    (project / "test_tiny.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(broken_entry_points),
                                                      env.get("PYTHONPATH")]))
    env["HYPOTHESIS_PROFILE"] = "ci"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
         "--difftest-plugin", f"fakes.py:{FAULTY}", "--difftest-backends", ",".join(EXPECTED),
         "--difftest-device", "cpu", "--difftest-report", "report.json"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr  # the test failed on the errors
    assert "1 failed" in done.stdout, done.stdout
    assert "run-raises error on case" in done.stdout
    written = json.loads((project / "report.json").read_text())
    _check(_statuses(written), written["backends"])


def test_a_backend_that_writes_into_its_inputs_is_an_error_and_the_rest_read_intact_ones(
        tmp_path: Path, device_name: str) -> None:
    """A backend that returned the right answer and then zeroed the cache it was given
    agreed, and the backend after it disagreed; one that scaled the query, the same. Each
    writer now gets ``error: wrote into its inputs`` naming what changed, and the backends
    after it run on inputs built afresh (``reads-cache`` returns NaN on a zeroed cache)."""
    from difftest.case.spec import Case
    from difftest.run.session import Session

    case = Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),),
                seed=4)
    session = Session.create(["writes-cache", "reads-cache", "writes-query", "rounded"],
                             [f"{FAKES}:WRITING_BACKENDS"], device_name, str(tmp_path / "art"))
    session.run(case)
    results = {r.backend: r for r in session.records[-1].results}
    assert {name: r.status.value for name, r in results.items()} == {
        "writes-cache": "error", "reads-cache": "agree", "writes-query": "error",
        "rounded": "agree"}
    assert results["writes-cache"].detail.startswith(
        "wrote into its inputs: the plain cache changed while it ran")
    assert results["writes-query"].detail.startswith(
        "wrote into its inputs: the query changed while it ran")
    assert results["writes-cache"].known_bug is None
