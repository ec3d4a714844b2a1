"""Known bugs: a failure is a known bug only where the bug's model predicts every wrong
element; anything more is a new failure with the known part named; an expected bug that no
longer shows fails the run (difftest/judgement/expectations.py, difftest/judgement/bug_rows.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.case.selection import kernel_sequences
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.contract.compare import WrongElements
from difftest.judgement import bug_rows, expectations
from difftest.results.records import CaseRecord, FindingRows, KnownBug, ResultRecord, Status

# one request per row: row 0 (16 tokens, a window of 16) reads all it attends; row 1 (250
# tokens) reads its last 16: its earlier tokens are unread, so NaN under the canaries
CASE = Case(num_blocks=8, seq_lens=(16, 250), block_tables=((0,), (1, 2)),
            selections=((0, -1), (0, 1)), sliding_window=16, canary=True, seed=3,
            num_q_heads=2)
INPUTS = RunInputs(CASE, torch.device("cpu"))
ENTRY = {"finding": "F99", "summary": "NaN before the window", "backends": ["kern"],
         "releases": "vllm >=0.33.0", "when": {"sliding_window": {"min": 1}},
         "nonfinite": True, "model": "nan_before_window", "strict": False}


def write(tmp_path: Path, *entries: dict) -> Path:
    path = tmp_path / "expectations.json"
    path.write_text(json.dumps({"expectations": list(entries)}))
    return path


def wrong(rows: dict[int, str], violations: tuple[int, ...] = ()) -> WrongElements:
    """Wrong elements of :data:`CASE`'s two rows: ``rows`` maps a row to ``nan`` (every
    element non-finite) or ``finite`` (finite elements off)."""
    shape = (CASE.total_q, CASE.num_q_heads)
    bad, finite = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    for row, kind in rows.items():
        bad[row] = True
        finite[row] = kind == "finite"
    empty = torch.zeros(CASE.total_q, dtype=torch.bool)
    empty[list(violations)] = True
    return WrongElements(bad, finite, empty)


def result(status: Status = Status.DISAGREE, version: str = "0.33.0", backend: str = "kern",
           detail: str = "") -> ResultRecord:
    return ResultRecord(backend, status, detail=detail, versions={"vllm": version})


def test_the_models_predict_the_rows_each_mechanism_reaches() -> None:
    """Row 1 has unread NaN slots before its window (F28), in the 16-token tile holding the
    window's first token (F22) and past its context in its last page (F24); row 0 reads all
    it attends, its page is full, and has none of them."""
    canary_models = ("nan_before_window", "nan_in_tile_before_window", "nan_past_context_in_page")
    for name in canary_models:
        assert bug_rows.MODELS[name](INPUTS).tolist() == [[False, False], [True, True]], name
    no_canary = RunInputs(CASE.replace(canary=False), torch.device("cpu"))
    assert not any(bug_rows.MODELS[name](no_canary).any() for name in canary_models)
    aligned = RunInputs(CASE.replace(seq_lens=(16, 256)), torch.device("cpu"))
    assert not bug_rows.nan_in_tile_before_window(aligned).any()  # the window starts a tile
    assert not bug_rows.nan_past_context_in_page(aligned).any()  # the last page is full
    assert bug_rows.nan_before_window(aligned)[1].all()


def test_the_softcap_model_predicts_rows_and_heads_past_88() -> None:
    inputs = RunInputs(CASE.replace(canary=False, sliding_window=0), torch.device("cpu"))
    logits = bug_rows.largest_logits(inputs)
    assert logits.shape == (2, 2) and bool((logits > 0).all())
    cap = float(logits.min() + logits.max()) / 2 / bug_rows.SOFTCAP_OVERFLOW
    capped = RunInputs(inputs.case.replace(softcap=cap), torch.device("cpu"))
    predicted = bug_rows.softcap_overflow(capped)
    assert predicted.tolist() == (logits >= bug_rows.SOFTCAP_OVERFLOW * cap).tolist()
    assert predicted.any() and not predicted.all()


def test_wrong_rows_inside_the_prediction_are_the_known_bug(tmp_path: Path) -> None:
    known = expectations.load(write(tmp_path, ENTRY))
    verdict = expectations.explain(known, INPUTS, result(), wrong({1: "nan"}))
    assert verdict == KnownBug((FindingRows("F99", [[1, 1]]),), False, [])
    assert verdict.describe() == "known bug F99 (rows 1)"


@pytest.mark.parametrize(("rows", "violations", "left"), [
    ({0: "finite", 1: "nan"}, (), [[0, 0]]),  # a finite fault on the row the bug spares
    ({1: "finite"}, (), [[1, 1]]),  # finite errors where the bug writes NaN
    ({1: "nan"}, (0,), [[0, 0]]),  # an empty row's violation
], ids=["outside", "finite", "violation"])
def test_anything_more_is_a_new_failure_with_the_known_part_named(
        tmp_path: Path, rows: dict[int, str], violations: tuple[int, ...],
        left: list[list[int]]) -> None:
    known = expectations.load(write(tmp_path, ENTRY))
    verdict = expectations.explain(known, INPUTS, result(), wrong(rows, violations))
    if rows.get(1) == "finite":  # nothing of it is the bug's
        assert verdict is None
        return
    assert verdict is not None and verdict.new_failure and verdict.unexplained_rows == left
    assert verdict.names == ["F99"]
    assert verdict.describe().startswith("new failure beyond known bug F99 (rows 1): rows ")


@pytest.mark.parametrize("other", [
    result(version="0.32.0"),  # a release not listed
    result(backend="other"),  # another backend
    result(Status.CRASH),  # a crash is never a known bug
], ids=["release", "backend", "crash"])
def test_another_release_backend_or_status_is_no_known_bug(tmp_path: Path,
                                                           other: ResultRecord) -> None:
    known = expectations.load(write(tmp_path, ENTRY))
    assert expectations.explain(known, INPUTS, other, wrong({1: "nan"})) is None
    outside = RunInputs(CASE.replace(sliding_window=0), torch.device("cpu"))
    assert expectations.explain(known, outside, result(), wrong({1: "nan"})) is None


def test_an_error_entry_explains_only_its_error(tmp_path: Path) -> None:
    entry = ENTRY | {"finding": "F98", "error": "kv_cache_dtype only supports"}
    del entry["model"]
    known = expectations.load(write(tmp_path, entry))
    raised = result(Status.ERROR, detail="AssertionError: kv_cache_dtype only supports BF16")
    assert expectations.explain(known, INPUTS, raised, None) == KnownBug(
        (FindingRows("F98", None),), False, [])
    other = result(Status.ERROR, detail="IndexError: out of range")
    assert expectations.explain(known, INPUTS, other, None) is None


def _record(known: KnownBug | None, status: Status = Status.DISAGREE) -> CaseRecord:
    return CaseRecord(case_id=CASE.case_id, name="", case=CASE.to_dict(), features={},
                      reference="torch-ref",
                      results=[ResultRecord("kern", status, versions={"vllm": "0.33.0"},
                                            known_bug=known)])


def test_the_judgement_sorts_by_the_recorded_verdicts(tmp_path: Path) -> None:
    whole = KnownBug((FindingRows("F99", [[1, 1]]),), False, [])
    partly = KnownBug((FindingRows("F99", [[1, 1]]),), True, [[0, 0]])
    cases = [_record(whole), _record(partly), _record(None)]
    judgement = expectations.judge(cases, expectations.load(write(tmp_path, ENTRY)))
    assert [c for c, _ in judgement.known["F99"]] == [cases[0]]
    assert [c for c, _ in judgement.partly["F99"]] == [cases[1]]
    assert [c for c, _ in judgement.new] == cases[1:] and judgement.failed
    lines = judgement.lines()
    assert lines[0].startswith("KNOWN BUG F99: 1 failure(s) on kern ")
    assert lines[1].startswith("NEW FAILURE BEYOND KNOWN BUG F99: 1 result(s) on kern ")


def test_an_expected_bug_that_no_longer_shows_fails_the_run(tmp_path: Path) -> None:
    strict = expectations.load(write(tmp_path, ENTRY | {"strict": True}))
    judgement = expectations.judge([_record(None, Status.AGREE)], strict)
    assert judgement.failed and judgement.unseen == {"F99": 1}
    assert "EXPECTED BUG NOT SEEN F99: 1 result(s)" in judgement.lines()[0]
    loose = expectations.judge([_record(None, Status.AGREE)],
                               expectations.load(write(tmp_path, ENTRY)))
    assert not loose.failed and "not a failure" in loose.lines()[0]


def test_a_malformed_entry_names_its_field(tmp_path: Path) -> None:
    with pytest.raises(expectations.ExpectationError, match=r"expectations\[0\]: missing "
                       r"field 'releases'"):
        expectations.load(write(tmp_path, {k: v for k, v in ENTRY.items() if k != "releases"}))
    with pytest.raises(expectations.ExpectationError, match=r"expectations\[0\]\.when\.softcap"):
        expectations.load(write(tmp_path, ENTRY | {"when": {"softcap": {"above": 1}}}))
    with pytest.raises(expectations.ExpectationError,
                       match=r"expectations\[0\]\.model: 'any-nan' is not a bug model"):
        expectations.load(write(tmp_path, ENTRY | {"model": "any-nan"}))
    with pytest.raises(expectations.ExpectationError, match=r"expectations\[0\]\.nonfinite: "):
        expectations.load(write(tmp_path, ENTRY | {"nonfinite": "yes"}))


def test_the_checkouts_file_reads_with_a_model_an_error_or_a_crash_per_entry() -> None:
    known = expectations.load(expectations.DEFAULT_FILE)
    assert {e.finding for e in known} >= {"F21", "F22", "F24", "F28", "F36"}
    for expectation in known:
        assert expectation.backends and str(expectation.releases)
        kinds = [bool(expectation.error), bool(expectation.model), expectation.crash]
        assert kinds.count(True) == 1, expectation.finding


def test_a_crash_entry_explains_a_crash_and_nothing_else(tmp_path: Path) -> None:
    entry = {k: v for k, v in ENTRY.items() if k not in ("model", "nonfinite")}
    known = expectations.load(write(tmp_path, entry | {"crash": True}))
    assert expectations.explain(known, INPUTS, result(Status.CRASH), None) == KnownBug(
        (FindingRows("F99", None),), False)
    assert expectations.explain(known, INPUTS, result(), wrong({1: "nan"})) is None
    assert expectations.explain(known, INPUTS, result(Status.ERROR, detail="x"), None) is None


def test_conditions_read_the_derived_context_length(tmp_path: Path) -> None:
    entry = ENTRY | {"when": {"max_seqlen_k": {"min": 513}}}
    known = expectations.load(write(tmp_path, entry))[0]
    assert known.triggered_by({"selections": [[0, 1, 2, 3, 4]], "block_size": 128})
    assert not known.triggered_by({"selections": [[0, 1, 2, 3]], "block_size": 128})


KNOWN_NAN = {"finding": "F97", "summary": "nan-out writes NaN", "backends": ["nan-out"],
             "releases": "torch >=0", "when": {}, "nonfinite": True,
             "model": "nan_before_window"}
# one row of 130 tokens reading its last 2: the 128 before are unread, so NaN
WINDOWED = Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),),
                sliding_window=2, canary=True)
TINY_TEST = '''
from difftest.case.spec import Case


def test_tiny(check_case):
    check_case(Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                    selections=((0, 1),), sliding_window=2, canary=True))
'''


def test_a_known_bug_fails_no_pytest_test(tmp_path: Path) -> None:
    """Under pytest a disagreement an expectation explains is logged, not a test failure."""
    shutil.copy(Path(__file__).parent / "fake_backends.py", tmp_path / "fakes.py")
    (tmp_path / "test_tiny.py").write_text(TINY_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--difftest-plugin", "fakes.py:NAN_BACKENDS", "--difftest-backends", "nan-out",
               "--junitxml", "junit.xml", "test_tiny.py"]
    known = write(tmp_path, KNOWN_NAN)
    passed = subprocess.run(command, cwd=tmp_path, env=env | {"DIFFTEST_EXPECTATIONS": str(known)},
                            capture_output=True, text=True, timeout=300, check=False)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "nan-out=disagree(inf)[known F97]" in (tmp_path / "junit.xml").read_text()
    failed = subprocess.run(command, cwd=tmp_path,
                            env=env | {"DIFFTEST_EXPECTATIONS": str(tmp_path / "none.json")},
                            capture_output=True, text=True, timeout=300, check=False)
    assert failed.returncode == 1 and "nan-out" in failed.stdout, failed.stdout


def recorded(tmp_path: Path, *cases: Case) -> Path:
    """A report holding ``cases`` (no results), for ``difftest run --cases-from``."""
    from difftest.reporting.report import build_report, write_report
    from difftest.results.features import case_features

    records = [CaseRecord(case_id=c.case_id, name=c.name, case=c.to_dict(),
                          features=case_features(c), reference="torch-ref", results=[])
               for c in cases]
    path = tmp_path / "cases.json"
    write_report(path, build_report(records, {}, {}, {}))
    return path


def test_a_known_bug_is_one_closing_line_not_a_message_in_full(tmp_path: Path, capsys,
                                                                monkeypatch) -> None:
    """``difftest run`` printed each known bug's disagreement in full as it happened (15
    lines a case), burying the new failures; now only the closing KNOWN BUG line names it."""
    from difftest import cli

    options = ["run", "--cases-from", str(recorded(tmp_path, WINDOWED)), "--device", "cpu",
               "--plugin", f"{Path(__file__).parent / 'fake_backends.py'}:NAN_BACKENDS",
               "--backends", "nan-out", "--artifacts", str(tmp_path / "art")]
    monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(write(tmp_path, KNOWN_NAN)))
    assert cli.main(options) == 0
    known = capsys.readouterr()
    assert "disagrees with torch-ref" not in known.err
    assert "KNOWN BUG F97" in known.out
    assert "1 known bug result(s) (F97)" in known.out.splitlines()[-1]
    monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(tmp_path / "none.json"))
    assert cli.main(options) == 1
    assert "nan-out disagrees with torch-ref" in capsys.readouterr().err


def test_a_known_bug_is_not_diagnosed(tmp_path: Path, monkeypatch) -> None:
    """The diagnosis reruns a kernel whose rows are NaN: for a disagreement a known bug
    explains, that cost bought nothing the finding does not say."""
    from difftest.run.session import Session

    plugin = f"{Path(__file__).parent / 'fake_backends.py'}:NAN_BACKENDS"
    diagnoses = []
    for known in ([KNOWN_NAN], []):
        monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(write(tmp_path, *known)))
        session = Session.create(["nan-out"], [plugin], "cpu", str(tmp_path / "art"))
        [outcome] = session.run(WINDOWED).results
        assert outcome.status is Status.DISAGREE
        assert (outcome.known_bug is not None) == bool(known)
        diagnoses.append(outcome.comparison.diagnosis)
    assert not diagnoses[0] and diagnoses[1]


def test_the_every_row_model_predicts_every_row_that_attends_a_token() -> None:
    """F34's lanes and F37's misread layout reach every row with a context, none without."""
    empty = RunInputs(CASE.replace(selections=((0, -1), (-1, -1))), torch.device("cpu"))
    assert bug_rows.every_attending_row(INPUTS).all()
    assert bug_rows.every_attending_row(empty).tolist() == [[True, True], [False, False]]


def test_the_alibi_model_predicts_every_prefill_row_past_a_sequences_first() -> None:
    """F39: with sinks and ALiBi, a sequence's rows past its first weight the sink wrongly;
    a decode row (a sequence of one) and a case without either term are spared."""
    prefill = Case(num_blocks=8, seq_lens=(300, 40), block_tables=((5, 2, 7), (1,)),
                   selections=((0, 1, 2),) * 3 + ((0, -1, -1),), query_lens=(3, 1),
                   num_q_heads=2, sinks=True, alibi=True)
    sequences = kernel_sequences(prefill)
    assert sequences == [(0, 3), (3, 1)]
    predicted = bug_rows.alibi_offset_beside_sinks(RunInputs(prefill, torch.device("cpu")))
    assert predicted.tolist() == [[False, False], [True, True], [True, True], [False, False]]
    for off in ({"sinks": False}, {"alibi": False}):
        spared = RunInputs(prefill.replace(**off), torch.device("cpu"))
        assert not bug_rows.alibi_offset_beside_sinks(spared).any()
