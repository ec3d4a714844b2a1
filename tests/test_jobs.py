"""``difftest run --jobs N``: N processes, one report, the single process's results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftest import cli
from difftest.jobs import auto_jobs, claimed
from difftest.report import case_records
from difftest.shard import comparable_case

PLUGIN = Path(__file__).parent / "fake_backends.py"


def _run(tmp: Path, name: str, *options: str) -> tuple[int, dict, str]:
    report = tmp / f"{name}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "difftest.cli", "run", "--device", "cpu", "--no-corpus",
         "--plugin", str(PLUGIN), "--artifacts", str(tmp / f"{name}-artifacts"),
         "--report", str(report), *options],
        capture_output=True, text=True, env=env, timeout=600)
    written = json.loads(report.read_text()) if report.is_file() else {}
    return done.returncode, written, done.stdout + done.stderr


def test_each_run_is_claimed_by_one_job(tmp_path: Path) -> None:
    """Two jobs walking the same runs, alternately: each run goes to the first that asks."""
    first, second = claimed(range(5), tmp_path), claimed(range(5), tmp_path)
    assert [next(first), next(second), next(second), next(first)] == [0, 1, 2, 3]
    assert list(second) == [4] and list(first) == []


def test_two_jobs_write_the_report_one_process_writes(tmp_path: Path) -> None:
    """The same cases and results (to the output digests), the jobs' lines relayed."""
    options = ("--backends", "rounded,perturbed", "--examples", "4")
    one_code, one, _ = _run(tmp_path, "one", *options)
    two_code, two, text = _run(tmp_path, "two", *options, "--jobs", "2")
    assert one_code == two_code == 1  # perturbed disagrees
    assert sorted(map(comparable_case, case_records(two))) == sorted(
        map(comparable_case, case_records(one)))
    assert two["config"]["jobs"] == 2
    assert [m["report"] for m in two["merged_from"]] == ["job 1/2", "job 2/2"]
    assert two["config"]["audit"] == one["config"]["audit"]
    assert "[job 1/2] " in text and "[job 2/2] " in text
    assert "perturbed disagrees with torch-ref" in text


def test_jobs_that_die_leave_crashes_in_the_report(tmp_path: Path) -> None:
    """Both jobs die (exit 77) in their first case of a seed divisible by 3: each leaves a
    crash artifact, and the report (written though no job wrote one) lists them."""
    code, report, text = _run(tmp_path, "crash", "--backends", "crasher", "--examples", "6",
                              "--seed", "1", "--jobs", "2")
    assert code == 1
    crashed = [c["case_id"] for c in report["earlier_crashes"]]
    assert len(crashed) == 2 and text.count("died (exit status 77)") == 2
    assert all((tmp_path / "crash-artifacts" / "failures" / c).is_dir() for c in crashed)
    assert report["config"]["jobs"] == 2


def test_jobs_are_counted_per_device_and_bad_counts_named(capsys) -> None:
    assert cli._job_count(0, "cpu") == auto_jobs() >= 1
    assert cli._job_count(0, "cuda") == 1
    assert cli._job_count(3, "cpu") == 3
    with pytest.raises(cli.UsageError, match=r"--jobs 2: .*with a GPU allowed 1 or auto"):
        cli._job_count(2, "cuda")
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            cli.main(["run", "--jobs", bad])
        assert "allowed: an integer >= 1, or auto" in capsys.readouterr().err
