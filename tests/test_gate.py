"""``difftest gate``: a candidate report against a baseline over the same case set."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from difftest import cli
from difftest.case.spec import Case
from difftest.primitives.jsonfile import write_json
from difftest.reporting.gate import gate
from difftest.reporting.report import build_report
from difftest.results.artifacts import repro_command
from difftest.results.records import CaseRecord, ResultRecord, Status
from difftest.run.session import Session

BACKEND = "triton-unified"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, device_name: str) -> dict[str, Any]:
    """The report of a real run: two small cases on the interpreted Triton backend."""
    session = Session.create([BACKEND], device=device_name,
                             artifacts=str(tmp_path_factory.mktemp("artifacts")))
    for seed in (1, 2):
        session.run(Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                         selections=((0, 1),), seed=seed))
    report = build_report(session.records, session.backend_entries(),
                          session.config() | {"runner": "test"}, session.environment)
    assert [r["status"] for c in report["cases"] for r in c["results"]] == ["agree", "agree"]
    return report


def _gate(tmp_path: Path, capsys: pytest.CaptureFixture[str], base: dict[str, Any],
          cand: dict[str, Any], *options: str) -> tuple[int, str]:
    paths = []
    for name, report in (("baseline.json", base), ("candidate.json", cand)):
        paths.append(str(write_json(tmp_path / name, report)))
    code = cli.main(["gate", *paths, *options])
    return code, capsys.readouterr().out


def _result(report: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return report["cases"][index]["results"][0]


def test_identical_reports_pass(tmp_path, capsys, baseline) -> None:
    code, out = _gate(tmp_path, capsys, baseline, copy.deepcopy(baseline))
    assert code == 0
    assert "environment: identical versions" in out
    assert out.rstrip().endswith("GATE PASSED: no regression; 2 baseline cases, 2 (case, "
                                 "backend) pairs, 2 unchanged")


def test_error_growth_past_the_threshold_fails_with_a_table(tmp_path, capsys, baseline) -> None:
    candidate = copy.deepcopy(baseline)
    before = _result(baseline)["comparison"]["max_ratio"]
    _result(candidate)["comparison"]["max_ratio"] = 0.9
    candidate["fingerprint"]["versions"]["amd-aiter"] = "0.1.7"
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1
    case_id = baseline["cases"][0]["case_id"]
    header, row = out.splitlines()[3:5]
    assert header.split() == ["case", "id", "name", "backend", "baseline", "err/tol",
                              "candidate", "err/tol", "verdict"]
    assert row.split()[:7] == [case_id, "-", BACKEND, "agree", f"{before:.3g}", "agree", "0.9"]
    assert f"FAIL error/tolerance grew {0.9 / before:.3g}x" in row
    assert "  amd-aiter: None -> 0.1.7" in out
    assert "GATE FAILED: 1 regression(s)" in out


def test_small_growth_below_the_floor_passes(tmp_path, capsys, baseline) -> None:
    candidate = copy.deepcopy(baseline)
    ratio = _result(baseline)["comparison"]["max_ratio"]
    _result(candidate)["comparison"]["max_ratio"] = min(ratio * 10, 0.45)
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 0, out
    code, _ = _gate(tmp_path, capsys, baseline, candidate, "--ratio-floor", "0.01",
                    "--max-ratio-growth", "1.5")
    assert code == 1


@pytest.mark.parametrize("status", ["disagree", "error", "crash"])
def test_a_case_that_starts_failing_fails(tmp_path, capsys, baseline, status) -> None:
    candidate = copy.deepcopy(baseline)
    _result(candidate, 1)["status"] = status
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1
    assert f"FAIL new {status}" in out


def test_a_disappearing_backend_fails(tmp_path, capsys, baseline) -> None:
    candidate = copy.deepcopy(baseline)
    del candidate["backends"][BACKEND]
    for case in candidate["cases"]:
        case["results"] = []
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1
    assert f"FAIL backend {BACKEND} is missing from the candidate" in out
    assert out.count("FAIL result missing in candidate") == 2


def test_an_unavailable_backend_fails(tmp_path, capsys, baseline) -> None:
    candidate = copy.deepcopy(baseline)
    candidate["backends"][BACKEND] |= {"available": False, "reason": "vLLM is not installed"}
    for case in candidate["cases"]:
        case["results"][0] |= {"status": "unavailable", "comparison": None}
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1
    assert f"FAIL backend {BACKEND} became unavailable: vLLM is not installed" in out
    assert out.count("FAIL became unavailable") == 2


def test_a_case_that_became_unsupported_fails(tmp_path, capsys, baseline) -> None:
    candidate = copy.deepcopy(baseline)
    _result(candidate).update(status="unsupported", comparison=None)
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1 and "FAIL no longer supported" in out


def test_a_shrunk_case_set_fails(tmp_path, capsys, baseline) -> None:
    candidate = copy.deepcopy(baseline)
    dropped = candidate["cases"].pop(0)
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1
    assert f"{dropped['case_id']}  -     *" in out
    assert "FAIL case missing in candidate (case set shrank)" in out


def test_fixed_and_new_cases_pass(tmp_path, capsys, baseline) -> None:
    failing = copy.deepcopy(baseline)
    _result(failing)["status"] = "disagree"
    grown = copy.deepcopy(baseline)
    extra = copy.deepcopy(grown["cases"][0]) | {"case_id": "f" * 16}
    extra["case"]["id"] = "f" * 16
    grown["cases"].append(extra)
    code, out = _gate(tmp_path, capsys, failing, grown)
    assert code == 0, out
    assert "fixed" in out and "new case in candidate" in out


def test_a_known_failure_that_persists_passes(baseline) -> None:
    failing = copy.deepcopy(baseline)
    _result(failing)["status"] = "disagree"
    result = gate(failing, copy.deepcopy(failing))
    assert not result.failed
    assert [r.verdict for r in result.rows] == ["still disagree", "same"]


def test_unreadable_input_exits_2(tmp_path, capsys, baseline) -> None:
    write_json(tmp_path / "baseline.json", baseline)
    (tmp_path / "broken.json").write_text("{")
    assert cli.main(["gate", str(tmp_path / "baseline.json"), str(tmp_path / "broken.json")]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert cli.main(["gate", str(tmp_path / "baseline.json"), str(tmp_path / "none.json")]) == 2


def test_a_wrong_field_is_an_error_naming_the_file_and_the_field(tmp_path, capsys,
                                                                  baseline) -> None:
    candidate = copy.deepcopy(baseline)
    _result(candidate, 1)["status"] = "pass"
    paths = [str(write_json(tmp_path / name, report)) for name, report in
             (("baseline.json", baseline), ("candidate.json", candidate))]
    assert cli.main(["gate", *paths]) == 2
    assert (f"difftest gate: {tmp_path / 'candidate.json'}: cases[1].results[0].status: "
            "'pass' is not a status (allowed: agree, disagree, error, crash, unsupported, "
            "unavailable)") in capsys.readouterr().err


def test_a_crash_left_by_an_earlier_candidate_process_fails(tmp_path, capsys, baseline) -> None:
    """The replay command is the store's own, so it keeps the crashed process's plug-ins."""
    case = CaseRecord.from_dict(baseline["cases"][0], "cases[0]")
    artifact = f"difftest-artifacts/failures/{case.case_id}"
    plugins = ["tests/fake_backends.py", "mutants.catalog"]
    crash = dataclasses.replace(
        case, results=[ResultRecord(BACKEND, Status.CRASH, detail="the process died")],
        timings={}, artifact=artifact, unjudged=[], plugins=plugins)
    candidate = copy.deepcopy(baseline) | {"earlier_crashes": [crash.to_dict()]}
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1
    assert repro_command(artifact, plugins) == (
        f"difftest repro {artifact} --plugin tests/fake_backends.py --plugin mutants.catalog")
    assert (f"FAIL case {case.case_id} crashed a process before the candidate's run (replay "
            f"with {repro_command(artifact, plugins)})") in out


def test_a_vllm_release_change_is_named_with_its_regressions(tmp_path, capsys, baseline) -> None:
    """Two runs of the same cases under two vLLM releases (``$DIFFTEST_VLLM``): the gate
    names the release each backend loaded and the case that regressed."""
    candidate = copy.deepcopy(baseline)
    before = baseline["backends"][BACKEND]["versions"]["vllm"]
    candidate["backends"][BACKEND]["versions"]["vllm"] = "0.30.0"
    _result(candidate, 1)["status"] = "disagree"
    code, out = _gate(tmp_path, capsys, baseline, candidate)
    assert code == 1
    assert f"  backend {BACKEND}: vllm: {before} -> 0.30.0" in out
    assert "environment: identical versions" not in out
    assert "FAIL new disagree" in out


def _unavailable(report: dict[str, Any], reason: str) -> dict[str, Any]:
    report = copy.deepcopy(report)
    report["backends"][BACKEND] |= {"available": False, "reason": reason}
    for case in report["cases"]:
        case["results"][0] |= {"status": "unavailable", "comparison": None,
                               "output_sha256": None}
    return report


def test_two_runs_where_the_backend_could_not_run_fail(tmp_path, capsys, baseline) -> None:
    """``$DIFFTEST_VLLM`` naming a release that is not fetched: the backend is unavailable on
    both sides, the versions are identical, and still nothing was tested."""
    reason = "vLLM release ../../etc is not fetched"
    nothing = _unavailable(baseline, reason)
    code, out = _gate(tmp_path, capsys, nothing, copy.deepcopy(nothing))
    assert code == 1
    assert f"FAIL backend {BACKEND} is unavailable in both reports: {reason}" in out
    assert out.count("FAIL unavailable in both") == 2
    assert "GATE FAILED" in out


def test_a_baseline_where_the_backend_could_not_run_fails(tmp_path, capsys, baseline) -> None:
    code, out = _gate(tmp_path, capsys, _unavailable(baseline, "no vLLM"),
                      copy.deepcopy(baseline))
    assert code == 1
    assert (f"FAIL backend {BACKEND} was unavailable in the baseline: no vLLM (nothing to "
            "compare the candidate with)") in out
    assert out.count("FAIL unavailable in the baseline") == 2


def test_a_backend_missing_from_the_baseline_fails(tmp_path, capsys, baseline) -> None:
    base = copy.deepcopy(baseline)
    del base["backends"][BACKEND]
    for case in base["cases"]:
        case["results"] = []
    code, out = _gate(tmp_path, capsys, base, copy.deepcopy(baseline))
    assert code == 1
    assert f"FAIL backend {BACKEND} is missing from the baseline" in out
    assert out.count("FAIL result missing in baseline") == 2


@pytest.mark.parametrize("side", ["baseline", "candidate"])
def test_a_duplicated_case_id_fails(tmp_path, capsys, baseline, side) -> None:
    """A candidate listing a case as ``disagree`` and then as ``agree`` used to pass on its
    last entry."""
    doubled = copy.deepcopy(baseline)
    first = copy.deepcopy(doubled["cases"][0])
    first["results"][0]["status"] = "disagree"
    doubled["cases"].insert(0, first)
    pair = (baseline, doubled) if side == "candidate" else (doubled, baseline)
    code, out = _gate(tmp_path, capsys, *pair)
    assert code == 1
    assert (f"FAIL case {first['case_id']} is listed 2 times in the {side} (each case once; "
            "rerun or merge the shards)") in out


@pytest.mark.parametrize("side", ["baseline", "candidate"])
def test_a_partial_report_fails(tmp_path, capsys, baseline, side) -> None:
    """A run stopped by Ctrl-C writes the cases it finished, marked interrupted."""
    partial = copy.deepcopy(baseline)
    partial["config"]["interrupted"] = {"signal": "SIGINT", "in_flight": []}
    pair = (baseline, partial) if side == "candidate" else (partial, baseline)
    code, out = _gate(tmp_path, capsys, *pair)
    assert code == 1
    assert f"FAIL the {side} is a partial report: its run was interrupted by SIGINT" in out


def test_an_empty_baseline_is_no_pass(tmp_path, capsys, baseline) -> None:
    """A baseline without a case passed any candidate: nothing was compared."""
    empty = copy.deepcopy(baseline)
    empty["cases"] = []
    code, out = _gate(tmp_path, capsys, empty, baseline)
    assert code == 1, out
    assert "FAIL the baseline holds no case: nothing was compared" in out
    assert "GATE FAILED: 1 regression(s); 0 baseline cases" in out


def test_a_backend_listed_twice_in_a_case_is_refused(tmp_path, capsys, baseline) -> None:
    """A ``disagree`` copy of a backend's result before its ``agree`` one: the gate judged
    only the last (GATE PASSED) and merge kept both. Which is the verdict? Neither says."""
    doubled = copy.deepcopy(baseline)
    entry = copy.deepcopy(_result(doubled))
    entry["status"] = "disagree"
    doubled["cases"][0]["results"].insert(0, entry)
    case_id = baseline["cases"][0]["case_id"]
    for base, cand, side in ((baseline, doubled, "candidate"), (doubled, baseline, "baseline")):
        paths = [str(write_json(tmp_path / f"{n}.json", r)) for n, r in (("b", base), ("c", cand))]
        code = cli.main(["gate", *paths])
        err = capsys.readouterr().err
        assert code == 2
        assert (f"difftest gate: the {side}: case {case_id} lists backend {BACKEND} 2 times "
                "(each backend once per case)") in err, err
    path = write_json(tmp_path / "doubled.json", doubled)
    assert cli.main(["merge", str(path), "-o", str(tmp_path / "m.json")]) == 2
    assert f"difftest merge: {path}: case {case_id} lists backend {BACKEND} 2 times" in (
        capsys.readouterr().err)
    assert not (tmp_path / "m.json").exists()


def _known(result: dict[str, Any], finding: str, new: bool = False) -> dict[str, Any]:
    result["status"] = "disagree"
    result["comparison"]["max_ratio"] = float("inf")
    result["known_bug"] = {"findings": [{"finding": finding, "rows": [[0, 0]]}],
                           "new_failure": new, "unexplained_rows": [[1, 1]] if new else []}
    return result


@pytest.mark.parametrize(("before", "after", "verdict", "fails"), [
    ("F25", "F25", "still known bug F25", False),
    ("F25", "F21", "known bug F25 -> F21", False),
    ("F21", None, "fixed", False),
    (None, "F21", "known bug F21 newly shows", True),
    ("F21", "F21+new", "new disagree beyond known bug F21", True),
])
def test_known_bugs_stay_change_and_go_without_failing_the_gate(
        tmp_path, capsys, baseline, before: str | None, after: str | None, verdict: str,
        fails: bool) -> None:
    base, cand = copy.deepcopy(baseline), copy.deepcopy(baseline)
    if before:
        _known(_result(base), before)
    if after:
        _known(_result(cand), after.removesuffix("+new"), new=after.endswith("+new"))
    code, out = _gate(tmp_path, capsys, base, cand)
    assert code == int(fails), out
    assert (f"FAIL {verdict}" if fails else f"  {verdict}") in out, out


def test_a_case_the_candidates_release_newly_supports_passes_unless_it_fails(
        tmp_path, capsys, baseline) -> None:
    older = copy.deepcopy(baseline)
    _result(older).update(status="unsupported", comparison=None)
    code, out = _gate(tmp_path, capsys, older, baseline)
    assert code == 0 and "newly supported" in out, out
    failing = copy.deepcopy(baseline)
    _result(failing)["status"] = "disagree"
    code, out = _gate(tmp_path, capsys, older, failing)
    assert code == 1 and "FAIL newly supported, disagree" in out, out
