"""What ``difftest run`` prints: a new failure's message, its diagnosis and its replay command
on the first screen, the verdict line last, within a line budget; a known bug is named in the
closing summary, not printed in full as it happens."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.specifiers import SpecifierSet

from difftest import cli
from difftest.judgement import bug_rows, expectations
from difftest.judgement.expectations import Expectation
from difftest.results.records import Status

LINE_BUDGET = 80  # a run's default output
FIRST_SCREEN = 50  # where a failure, its diagnosis and its replay command must show
MUTANT = "triton-unified!page-stride-8"
# two generated cases: the first (one LBHNC block) is killed, the second (LHBNC) agrees
RUN = ["run", "--plugin", "mutants.catalog", "--backends", MUTANT, "--no-corpus",
       "--examples", "2"]


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], device: str) -> tuple[int, list[str]]:
    code = cli.main([*RUN, "--device", device, "--artifacts", str(tmp_path / "art"),
                     "--report", str(tmp_path / "r.json")])
    captured = capsys.readouterr()  # progress and failures on stderr, before the closing
    return code, (captured.err + captured.out).splitlines()


def _index(lines: list[str], start: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(start))


def test_a_failing_run_shows_its_failure_diagnosis_and_replay_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], device_name: str) -> None:
    code, lines = _run(tmp_path, capsys, device_name)
    assert code == 1
    assert len(lines) <= LINE_BUDGET, "\n".join(lines)
    failure = _index(lines, f"{MUTANT} disagrees with torch-ref on case ")
    diagnosis = _index(lines, "  Diagnosis (what the worst rows read instead):")
    replay = _index(lines, "  replay: difftest repro ")
    assert failure < diagnosis < replay < FIRST_SCREEN, "\n".join(lines)
    assert lines[diagnosis + 1].startswith("    explained by: page-stride-8 ("), lines
    assert "--plugin mutants.catalog" in lines[replay]
    assert lines[-1].startswith("FAILED: 1 new failure(s) (1 disagree) in 2 cases; ")
    assert lines[-1].endswith(f"report {tmp_path / 'r.json'}")


def test_a_known_bug_is_named_in_the_summary_not_printed_in_full(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], device_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bug_rows.MODELS, "every_row", lambda inputs: torch.ones(
        (inputs.case.total_q, inputs.case.num_q_heads), dtype=torch.bool))
    known = Expectation("F0", "page ids at stride 8", (MUTANT,), "triton", SpecifierSet(">=0"),
                        {}, model="every_row")
    monkeypatch.setattr(expectations, "load", lambda path=None: [known])
    code, lines = _run(tmp_path, capsys, device_name)
    assert code == 0, "\n".join(lines)
    assert not any("disagrees with" in line or "Diagnosis" in line or line.startswith(
        "FAILED case") for line in lines), lines
    assert any("F0" in line for line in lines[:-1]), lines
    assert lines[-1].startswith("PASSED: "), lines
    assert len(lines) <= LINE_BUDGET


def test_examples_no_variant_fits_are_counted_per_backend(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Generation's reasons for examples it could not fit (one line per reason, some 300
    characters) are one line per backend, pointing at the audit that lists them."""
    reason = "reported unsupported: head_dim 96: " + "x" * 200
    report = {"config": {"generation": [
        f"could not fit for a@emulated: 1 example(s) {reason}",
        f"could not fit for a@emulated: 2 example(s) {reason}",
        f"could not fit for b: 4 example(s) {reason}",
        "redrawn 1 example(s) b runs in no variant: sliding_window"]},
        "backends": {}, "cases": []}
    cli._print_closing(report, "r.json", full_audit=False)
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "could not fit" in line] == [
        "generation: could not fit for a@emulated: 3 example(s) reported unsupported (each "
        "reason: difftest audit r.json)",
        "generation: could not fit for b: 4 example(s) reported unsupported (each reason: "
        "difftest audit r.json)"]
    assert "generation: redrawn 1 example(s) b runs in no variant: sliding_window" in lines


def test_the_jobs_of_a_run_print_about_ten_progress_lines_together(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each job counts its own cases against the run's total: two jobs sharing 189 cases
    print a line every 19 of their own, about ten lines in all (not ten each)."""
    case = SimpleNamespace(case_id="c", name="")
    result = SimpleNamespace(case=case, results=[SimpleNamespace(
        status=Status.AGREE, backend="b")])
    for share in (95, 94):
        progress = cli.Progress(189)
        for _ in range(share):
            progress.step(result)  # type: ignore[arg-type]
    lines = capsys.readouterr().err.splitlines()
    assert 8 <= len(lines) <= 10 and lines[0].startswith("19/189 "), lines
