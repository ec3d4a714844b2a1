"""``difftest run --cases-from REPORT``: a candidate runs exactly a baseline's cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difftest import cli
from difftest.case.spec import Case
from difftest.reporting.report import ReportError, build_report, read_report, write_report
from difftest.results.features import case_features
from difftest.results.records import CaseRecord, ResultRecord, Status
from difftest.run.recorded import recorded_runs

TINY = Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),), seed=4)
BACKEND = "aiter-gluon@emulated"  # pure torch: fast on the CPU


def _pairs(path: Path) -> list[tuple[str, str]]:
    report = read_report(path)
    return sorted((entry["case_id"], r["backend"]) for entry in report["cases"]
                  for r in entry["results"])


def test_a_run_takes_exactly_the_cases_of_a_report(tmp_path: Path, capsys) -> None:
    """The baseline draws 3 cases under seed 0; the candidate, asked for 9 under seed 7 with
    ``--cases-from``, runs the baseline's cases and nothing else, and the gate passes."""
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    common = ["run", "--device", "cpu", "--backends", BACKEND, "--artifacts",
              str(tmp_path / "art")]
    assert cli.main([*common, "--no-corpus", "--examples", "3", "--report", str(base)]) == 0
    assert cli.main([*common, "--examples", "9", "--seed", "7", "--cases-from", str(base),
                     "--report", str(cand)]) == 0
    assert len(_pairs(base)) == 3 and _pairs(cand) == _pairs(base)
    config = read_report(cand)["config"]
    assert (config["cases_from"], config["examples"], config["corpus"]) == (str(base), 0, False)
    capsys.readouterr()
    assert cli.main(["gate", str(base), str(cand)]) == 0
    assert "GATE PASSED" in capsys.readouterr().out


def _report(tmp_path: Path, records: list[CaseRecord]) -> Path:
    path = tmp_path / "report.json"
    write_report(path, build_report(records, {}, {"runner": "difftest run"}, {}))
    return path


def _record(case: Case, backends: list[str]) -> CaseRecord:
    return CaseRecord(case.case_id, case.name, case.to_dict(), case_features(case), "torch-ref",
                      [ResultRecord(name, Status.AGREE) for name in backends])


def test_a_fitted_variant_runs_on_its_backends_only(tmp_path: Path) -> None:
    """A case the report ran on one backend of two stays on it; a case whose backends this run
    does not have (another release in the name) runs on every backend."""
    variant = TINY.replace(query_dtype="float32")
    path = _report(tmp_path, [_record(TINY, ["a", "b"]), _record(variant, ["b"]),
                              _record(TINY.replace(seed=5), ["a[vllm=0.33.0]"])])
    runs = recorded_runs(path, ["a", "b"])
    assert {case.case_id: names for case, names in runs} == {
        TINY.case_id: ("a", "b"), variant.case_id: ("b",), TINY.replace(seed=5).case_id: None}


def test_an_unreadable_report_is_refused_naming_the_file_and_entry(tmp_path: Path,
                                                                   capsys) -> None:
    path = _report(tmp_path, [_record(TINY, ["a"])])
    broken = json.loads(path.read_text())
    broken["cases"][0]["case"]["seq_lens"] = [999]  # 8 blocks, 2 in its table
    path.write_text(json.dumps(broken))
    with pytest.raises(ReportError, match=r"report\.json: cases\[0\]\.case: "
                       r"block_tables\[0\]: has 2 blocks for seq_len 999"):
        recorded_runs(path, ["a"])
    missing = tmp_path / "missing.json"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--device", "cpu", "--cases-from", str(missing)])
    assert exit_info.value.code == 2
    assert "missing.json" in capsys.readouterr().err


def test_case_ids_run_only_those_cases_of_the_report(tmp_path: Path, capsys) -> None:
    """What a gate prints for a ROCm runner: ``--cases-from R --case-ids A,B``."""
    other = TINY.replace(seed=5)
    path = _report(tmp_path, [_record(TINY, [BACKEND]), _record(other, [BACKEND])])
    assert [c.case_id for c, _ in recorded_runs(path, [BACKEND], [other.case_id])] == [
        other.case_id]
    out = tmp_path / "subset.json"
    common = ["run", "--device", "cpu", "--backends", BACKEND, "--artifacts",
              str(tmp_path / "art"), "--cases-from", str(path)]
    assert cli.main([*common, "--case-ids", other.case_id, "--report", str(out)]) == 0
    assert [c["case_id"] for c in read_report(out)["cases"]] == [other.case_id]
    capsys.readouterr()
    assert cli.main([*common, "--case-ids", "0123456789abcdef"]) == 2
    assert "holds no case 0123456789abcdef (--case-ids: 1 of 1 not in it)" in (
        capsys.readouterr().err)
    assert cli.main(["run", "--device", "cpu", "--case-ids", TINY.case_id]) == 2
    assert "--case-ids: allowed with --cases-from only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*common, "--case-ids", "not-an-id"])
    assert exit_info.value.code == 2
    assert "'not-an-id' is not a case id (allowed: 16 hexadecimal digits" in (
        capsys.readouterr().err)
