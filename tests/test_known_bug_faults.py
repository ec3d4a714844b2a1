"""A new bug inside a known bug's condition fails the run, and every reader of the report sees
the same known/new split as ``difftest run`` printed.

The attack of the known-bug excuse: ``tests/known_bug_faults.py`` wraps ``vllm-paged-decode``
(known bug F28) and ``aiter-unified`` (F22, F24) with a finite fault, +1.0 on every element of
cases with a window and NaN canaries (inside those bugs' conditions). On a case whose row 1
reads NaN before its window and row 0 does not, the bugs' models explain row 1 only: the
unchanged backends are known bugs, the wrapped ones new failures with the known part named.
One run writes the report that ``gate``, ``merge``, ``repro``, ``plot`` and ``audit`` read.
"""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path
from typing import Any

import pytest

from difftest import cli
from difftest.case.spec import Case
from difftest.contract import registry
from difftest.primitives.jsonfile import read_json, write_json
from difftest.reporting.plot import verdict_matrix
from difftest.reporting.report import case_records
from tests.test_expectations import recorded

PLUGIN = f"{Path(__file__).parent / 'known_bug_faults.py'}:PLUS_ONE"
KNOWN = ("vllm-paged-decode", "aiter-unified")
FAULTY = tuple(f"{name}[fault=plus-one]" for name in KNOWN)
CASE = Case(num_blocks=8, seq_lens=(16, 250), block_tables=((0,), (1, 2)),
            selections=((0, -1), (0, 1)), sliding_window=16, canary=True, seed=3,
            num_q_heads=2)
VERDICT = ("FAILED: 2 new failure(s) (2 disagree) in 1 cases; 2 known bug result(s) "
           "(F22, F24, F28); 0 unsupported; report ")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, device_name: str) -> dict[str, Any]:
    """One ``difftest run`` of the case on the two kernels and their faulty wrappers."""
    known = registry.discover()
    for name in KNOWN:
        if not known[name].availability().available:
            pytest.skip(f"{name}: {known[name].availability().reason}")
    tmp = tmp_path_factory.mktemp("faults")
    report = tmp / "r.json"
    argv = ["run", "--cases-from", str(recorded(tmp, CASE)), "--device", device_name,
            "--plugin", PLUGIN, "--backends", ",".join(KNOWN + FAULTY),
            "--artifacts", str(tmp / "art"), "--report", str(report)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return {"code": code, "out": out.getvalue().splitlines(), "err": err.getvalue(),
            "report": report, "tmp": tmp, "device": device_name}


def _results(report: dict[str, Any]) -> dict[str, Any]:
    [case] = case_records(report)
    return {r.backend: r for r in case.results}


def test_a_finite_fault_inside_a_known_bugs_condition_fails_the_run(run) -> None:
    assert run["code"] == 1, "\n".join(run["out"])
    assert run["out"][-1] == VERDICT + str(run["report"])
    assert f"{FAULTY[0]} disagrees with torch-ref" in run["err"]  # printed in full
    assert "new failure beyond known bug F28 (rows 1): rows 0 wrong outside its model" \
        in run["err"]
    lines = run["out"]
    assert any(line.startswith("KNOWN BUG F28: 1 failure(s) on vllm-paged-decode ")
               for line in lines)
    assert any(line.startswith(f"NEW FAILURE BEYOND KNOWN BUG F28: 1 result(s) on {FAULTY[0]}")
               for line in lines)


def test_the_report_records_the_finding_and_the_rows_it_explains(run) -> None:
    results = _results(read_json(run["report"]))
    assert results["vllm-paged-decode"].known_bug.to_dict() == {
        "findings": [{"finding": "F28", "rows": [[1, 1]]}], "new_failure": False,
        "unexplained_rows": []}
    assert results["aiter-unified"].known_bug.names == ["F22", "F24"]
    assert results["aiter-unified"].is_known_bug
    for name in FAULTY:
        faulty = results[name]
        assert faulty.is_new_failure and faulty.known_bug.new_failure
        assert faulty.known_bug.unexplained_rows == [[0, 0]]


def _gate(tmp: Path, base: dict[str, Any], cand: dict[str, Any],
          capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    paths = [str(write_json(tmp / name, r)) for name, r in (("b.json", base), ("c.json", cand))]
    code = cli.main(["gate", *paths])
    return code, capsys.readouterr().out


def test_the_gate_keeps_known_bugs_and_fails_the_fault_a_bump_brings(run, capsys) -> None:
    report = read_json(run["report"])
    code, out = _gate(run["tmp"], report, copy.deepcopy(report), capsys)
    assert code == 0, out
    assert "still known bug F28" in out and "still known bug F22, F24" in out
    # the candidate's kernels are the faulty ones, under their plain names
    bumped = copy.deepcopy(report)
    results = bumped["cases"][0]["results"]
    faulty = {r["backend"]: r for r in results}
    bumped["cases"][0]["results"] = [
        faulty[f"{r['backend']}[fault=plus-one]"] | {"backend": r["backend"]}
        for r in results if r["backend"] in KNOWN]
    report["cases"][0]["results"] = [r for r in report["cases"][0]["results"]
                                     if r["backend"] in KNOWN]
    for side in (report, bumped):
        side["backends"] = {k: v for k, v in side["backends"].items() if k not in FAULTY}
    code, out = _gate(run["tmp"], report, bumped, capsys)
    assert code == 1, out
    assert "FAIL new disagree beyond known bug F28" in out
    assert "disagree [F28]" in out and "disagree [beyond F28]" in out
    code, out = _gate(run["tmp"], bumped, report, capsys)  # the fault fixed
    assert code == 0 and "now known bug F28 (was a new disagree)" in out, out


def test_merge_prints_the_runs_verdict(run, capsys) -> None:
    merged = run["tmp"] / "merged.json"
    assert cli.main(["merge", str(run["report"]), "-o", str(merged)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == VERDICT + str(merged)
    assert read_json(merged)["schema"] == "difftest.report/2"


def test_plot_and_audit_show_the_same_split(run, capsys) -> None:
    matrix = verdict_matrix(case_records(read_json(run["report"])))
    for name in KNOWN:
        assert matrix[name]["known bug"] == 1 and matrix[name]["disagree"] == 0
    for name in FAULTY:
        assert matrix[name]["known bug"] == 0 and matrix[name]["disagree"] == 1
    assert cli.main(["audit", str(run["report"])]) == 0
    out = capsys.readouterr().out
    assert "known bugs explain 1 F28" in out and "KNOWN BUG F28: 1 failure(s)" in out
    pytest.importorskip("matplotlib")
    assert cli.main(["plot", str(run["report"]), "-o", str(run["tmp"] / "r.png")]) == 0


def test_repro_names_the_finding_and_exits_as_run(run, capsys) -> None:
    [case] = case_records(read_json(run["report"]))
    options = ["--device", run["device"], "--artifacts", str(run["tmp"] / "art")]
    assert cli.main(["repro", case.artifact, "--backends", KNOWN[0], *options]) == 0
    out = capsys.readouterr().out
    assert "vllm-paged-decode: known bug F28 (rows 1) (docs/findings.md F28; not a new " \
           "failure)" in out
    assert "(recorded as known bug F28 (rows 1))" in out
    assert cli.main(["repro", case.artifact, "--plugin", PLUGIN, "--backends", FAULTY[0],
                     *options]) == 1
    out = capsys.readouterr().out
    assert "new failure beyond known bug F28 (rows 1): rows 0 wrong outside its model " \
           "(a new failure)" in out
