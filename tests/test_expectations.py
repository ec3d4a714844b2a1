"""Known bugs: a disagreement an expectation explains is reported apart from new failures,
and an expected bug that no longer shows fails the run (difftest/judgement/expectations.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.contract.compare import Comparison
from difftest.judgement import expectations
from difftest.results.records import CaseRecord, ResultRecord, Status

ENTRY = {"finding": "F99", "summary": "NaN with a small softcap", "backends": ["kern"],
         "releases": "amd-aiter <=0.1.20.post1",
         "when": {"softcap": {"min": 1e-30, "max": 0.01}}, "nonfinite": True}


def write(tmp_path: Path, *entries: dict) -> Path:
    path = tmp_path / "expectations.json"
    path.write_text(json.dumps({"expectations": list(entries)}))
    return path


def comparison(nonfinite: int) -> Comparison:
    return Comparison(backend="kern", agrees=False, checked=8, mismatched=8,
                      nonfinite=nonfinite, max_abs_error=1.0, max_ratio=9.0, empty_rows=0,
                      empty_row_policy="zero", empty_row_violations=0, tolerance="t",
                      worst=())


def record(softcap: float, status: Status, version: str = "0.1.16", nonfinite: int = 8,
           backend: str = "kern") -> CaseRecord:
    result = ResultRecord(backend, status, versions={"amd-aiter": version},
                          comparison=comparison(nonfinite) if status is Status.DISAGREE
                          else None)
    return CaseRecord(case_id=f"{softcap}-{status.value}-{version}", name="", case={
        "softcap": softcap}, features={}, reference="torch-ref", results=[result])


def test_a_matching_disagreement_is_a_known_bug_not_a_new_failure(tmp_path: Path) -> None:
    known = expectations.load(write(tmp_path, ENTRY))
    judgement = expectations.judge([record(0.01, Status.DISAGREE),
                                    record(0.005, Status.DISAGREE, backend="kern[aiter=x]"),
                                    record(30.0, Status.AGREE)], known)
    assert not judgement.failed and not judgement.new
    assert len(judgement.known["F99"]) == 2
    assert judgement.lines()[0].startswith("KNOWN BUG F99: 2 failure(s) on kern, kern[")


@pytest.mark.parametrize("case", [
    record(0.5, Status.DISAGREE),                  # outside the condition
    record(0.01, Status.DISAGREE, version="0.1.21"),  # a release not listed
    record(0.01, Status.DISAGREE, nonfinite=0),    # another symptom
    record(0.01, Status.ERROR),                    # an error is never a known bug
    record(0.01, Status.DISAGREE, backend="other"),
], ids=["condition", "release", "symptom", "error", "backend"])
def test_anything_else_stays_a_new_failure(tmp_path: Path, case: CaseRecord) -> None:
    judgement = expectations.judge([case], expectations.load(write(tmp_path, ENTRY)))
    assert judgement.failed and judgement.new == [(case, case.results[0])]


def test_an_expected_bug_that_no_longer_shows_fails_the_run(tmp_path: Path) -> None:
    judgement = expectations.judge([record(0.01, Status.AGREE)],
                                   expectations.load(write(tmp_path, ENTRY)))
    assert judgement.failed and judgement.unseen == {"F99": 1}
    assert "EXPECTED BUG NOT SEEN F99: 1 result(s)" in judgement.lines()[0]
    loose = expectations.judge([record(0.01, Status.AGREE)],
                               expectations.load(write(tmp_path, ENTRY | {"strict": False})))
    assert not loose.failed and "not a failure" in loose.lines()[0]
    assert loose.strict_unseen == [] and judgement.strict_unseen == ["F99"]
    untouched = expectations.judge([record(30.0, Status.AGREE)],
                                   expectations.load(write(tmp_path, ENTRY)))
    assert not untouched.failed  # no case met the condition: nothing to say


def test_a_malformed_entry_names_its_field(tmp_path: Path) -> None:
    with pytest.raises(expectations.ExpectationError, match=r"expectations\[0\]: missing "
                       r"field 'releases'"):
        expectations.load(write(tmp_path, {k: v for k, v in ENTRY.items() if k != "releases"}))
    with pytest.raises(expectations.ExpectationError, match=r"expectations\[0\]\.when\.softcap"):
        expectations.load(write(tmp_path, ENTRY | {"when": {"softcap": {"above": 1}}}))


def test_the_checkouts_file_reads() -> None:
    known = expectations.load(expectations.DEFAULT_FILE)
    assert {e.finding for e in known} >= {"F21", "F22"}
    for expectation in known:
        assert expectation.backends and str(expectation.releases)


def test_an_error_entry_explains_only_that_error(tmp_path: Path) -> None:
    entry = ENTRY | {"finding": "F98", "when": {}, "nonfinite": False,
                     "error": "kv_cache_dtype only supports"}
    known = expectations.load(write(tmp_path, entry))
    raised = record(0.0, Status.ERROR)
    raised.results[0].detail = "AssertionError: kv_cache_dtype only supports BF16"
    other = record(0.0, Status.ERROR)
    other.results[0].detail = "IndexError: out of range"
    judgement = expectations.judge([raised, other], known)
    assert [c for c, _ in judgement.known["F98"]] == [raised]
    assert judgement.new == [(other, other.results[0])]


def test_conditions_read_the_derived_context_length(tmp_path: Path) -> None:
    entry = ENTRY | {"when": {"max_seqlen_k": {"min": 513}}, "nonfinite": False}
    known = expectations.load(write(tmp_path, entry))[0]
    assert known.triggered_by({"selections": [[0, 1, 2, 3, 4]], "block_size": 128})
    assert not known.triggered_by({"selections": [[0, 1, 2, 3]], "block_size": 128})


KNOWN_NAN = {"finding": "F97", "summary": "nan-out writes NaN", "backends": ["nan-out"],
             "releases": "torch >=0", "when": {}, "nonfinite": True}
TINY_TEST = '''
from difftest.case.spec import Case


def test_tiny(check_case):
    check_case(Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                    selections=((0, 1),)))
'''


def test_a_known_bug_fails_no_pytest_test(tmp_path: Path) -> None:
    """Under pytest a disagreement an expectation explains is logged, not a test failure."""
    shutil.copy(Path(__file__).parent / "fake_backends.py", tmp_path / "fakes.py")
    (tmp_path / "test_tiny.py").write_text(TINY_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--difftest-plugin", "fakes.py:NAN_BACKENDS", "--difftest-backends", "nan-out",
               "test_tiny.py"]
    known = write(tmp_path, KNOWN_NAN)
    passed = subprocess.run(command, cwd=tmp_path, env=env | {"DIFFTEST_EXPECTATIONS": str(known)},
                            capture_output=True, text=True, timeout=300, check=False)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    failed = subprocess.run(command, cwd=tmp_path,
                            env=env | {"DIFFTEST_EXPECTATIONS": str(tmp_path / "none.json")},
                            capture_output=True, text=True, timeout=300, check=False)
    assert failed.returncode == 1 and "nan-out" in failed.stdout, failed.stdout


def test_a_known_bug_is_one_closing_line_not_a_message_in_full(tmp_path: Path, capsys,
                                                                monkeypatch) -> None:
    """``difftest run`` printed each known bug's disagreement in full as it happened (15
    lines a case), burying the new failures; now only the closing KNOWN BUG line names it."""
    from difftest import cli

    options = ["run", "--no-corpus", "--examples", "1", "--device", "cpu", "--plugin",
               f"{Path(__file__).parent / 'fake_backends.py'}:NAN_BACKENDS", "--backends",
               "nan-out", "--artifacts", str(tmp_path / "art")]
    monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(write(tmp_path, KNOWN_NAN)))
    assert cli.main(options) == 0
    known = capsys.readouterr()
    assert "disagrees with torch-ref" not in known.err
    assert "KNOWN BUG F97" in known.out
    monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(tmp_path / "none.json"))
    assert cli.main(options) == 1
    assert "nan-out disagrees with torch-ref" in capsys.readouterr().err


def test_a_known_bug_is_not_diagnosed(tmp_path: Path, monkeypatch) -> None:
    """The diagnosis reruns a kernel whose rows are NaN: for a disagreement a known bug
    explains, that cost bought nothing the finding does not say."""
    from difftest.case.spec import Case
    from difftest.run.session import Session

    case = Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),))
    plugin = f"{Path(__file__).parent / 'fake_backends.py'}:NAN_BACKENDS"
    diagnoses = []
    for known in ([KNOWN_NAN], []):
        monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(write(tmp_path, *known)))
        session = Session.create(["nan-out"], [plugin], "cpu", str(tmp_path / "art"))
        [result] = session.run(case).results
        assert result.status is Status.DISAGREE
        diagnoses.append(result.comparison.diagnosis)
    assert not diagnoses[0] and diagnoses[1]
