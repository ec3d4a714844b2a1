"""``difftest run --jobs N``: N processes, one report, the single process's results."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftest import cli
from difftest.generation.generate import generated_cases
from difftest.machine import pinning
from difftest.machine.gpus import VISIBILITY_VARS
from difftest.machine.pinning import FAKE_GPUS_ENV
from difftest.reporting.report import case_records
from difftest.run import jobs as jobs_module
from difftest.run.jobs import auto_jobs, claim_units, claimed, job_environments, kernel_class
from difftest.run.shard import comparable_case

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
    # relayed with their job's prefix; a job that claimed no case may print nothing
    assert any(line.startswith(("[job 1/2] ", "[job 2/2] ")) for line in text.splitlines())
    assert "perturbed disagrees with torch-ref" in text


def test_jobs_that_die_leave_crashes_in_the_report(tmp_path: Path) -> None:
    """Both jobs die (exit 77) in their first case of a seed divisible by 3: each leaves a
    crash artifact, and the report (written though no job wrote one) lists them as cases of
    this run, beside the cases the jobs finished before."""
    code, report, text = _run(tmp_path, "crash", "--backends", "crasher", "--examples", "6",
                              "--seed", "1", "--jobs", "2")
    assert code == 1
    assert "earlier_crashes" not in report
    crashed = [c["case_id"] for c in report["cases"]
               if c["results"] and c["results"][0]["status"] == "crash"]
    assert len(crashed) == 2 and text.count("died (exit status 77)") == 2
    assert all((tmp_path / "crash-artifacts" / "failures" / c).is_dir() for c in crashed)
    assert report["config"]["jobs"] == 2


def test_jobs_are_counted_per_device_and_bad_counts_named(capsys, monkeypatch) -> None:
    for var in (FAKE_GPUS_ENV, *VISIBILITY_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jobs_module.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(pinning.gpus, "physical_gpu_count", lambda: 0)
    assert cli._job_count(0, "cpu") == cli._job_count(0, "auto") == auto_jobs() >= 1
    assert cli._job_count(3, "cpu") == 3
    monkeypatch.setenv(FAKE_GPUS_ENV, "nvidia:4")
    assert cli._job_count(0, "auto") == cli._job_count(0, "cuda") == 4
    assert cli._job_count(0, "cpu") == auto_jobs()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert cli._job_count(0, "auto") == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            cli.main(["run", "--jobs", bad])
        assert "allowed: an integer >= 1, or auto" in capsys.readouterr().err


def test_jobs_auto_uses_the_cores_on_gpus_too(monkeypatch) -> None:
    """One job per core, several sharing a GPU (at most 8 per GPU), at least one per GPU,
    one per 3 GiB of host memory; on the CPU at most 8. Through the CLI from fake masks: the
    jobs of one GPU are all pinned to it, those of a mask round-robin over its GPUs."""
    big = 512 << 30
    assert auto_jobs(1, cores=16, memory=big) == 8
    assert auto_jobs(1, cores=4, memory=big) == 4
    assert auto_jobs(2, cores=16, memory=big) == 16
    assert auto_jobs(8, cores=128, memory=big) == 64
    assert auto_jobs(4, cores=2, memory=big) == 4
    assert auto_jobs(1, cores=16, memory=12 << 30) == 4
    assert auto_jobs(0, cores=16, memory=big) == 8
    assert auto_jobs(0, cores=2, memory=big) == 2
    for var in VISIBILITY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jobs_module.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(jobs_module, "_host_memory", lambda: 128 << 30)
    monkeypatch.setenv(FAKE_GPUS_ENV, "nvidia:1")
    assert cli._job_count(0, "auto") == cli._job_count(0, "cuda") == 8
    assert cli._job_count(0, "cpu") == 8
    assert [e["CUDA_VISIBLE_DEVICES"] for e in job_environments(8, "auto")] == ["0"] * 8
    monkeypatch.setenv(FAKE_GPUS_ENV, "amd:8")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert cli._job_count(0, "auto") == 16
    assert [e["HIP_VISIBLE_DEVICES"] for e in job_environments(16, "auto")] == ["2", "5"] * 8


def test_claim_units_keep_a_kernel_class_together_on_gpus_largest_first() -> None:
    """On a GPU each unit holds one kernel class (split when it is a large share of the
    work), so jobs compile different classes; on the CPU one run per unit. Either way every
    run is in one unit and units go out largest first."""
    cases = [case.replace(seed=seed) for case in generated_cases(8, 5) for seed in (1, 2, 3)]
    runs = [(case, None if k % 3 else ("a", "b")) for k, case in enumerate(cases)]
    widest = 2
    work = [c.total_q * (len(n) if n else widest) for c, n in runs]
    for by_class in (True, False):
        units = claim_units(runs, 3, by_class)
        assert sorted(i for unit in units for i in unit) == list(range(len(runs)))
        sizes = [sum(work[i] for i in unit) for unit in units]
        assert sizes == sorted(sizes, reverse=True)
        if by_class:
            assert all(len({kernel_class(runs[i][0]) for i in unit}) == 1 for unit in units)
            classes = {kernel_class(c) for c, _ in runs}
            assert len(classes) < len(runs)  # some class has several cases
            assert len(units) >= len(classes)
            share = sum(work) / (3 * jobs_module.UNITS_PER_JOB)
            assert all(len(unit) == 1 or sizes[n] <= share for n, unit in enumerate(units))
        else:
            assert all(len(unit) == 1 for unit in units)


def test_job_environments_pin_each_job_to_its_own_gpu_within_the_mask() -> None:
    """As the xdist workers are: one GPU each, within the runner's mask, round-robin beyond."""
    four = {FAKE_GPUS_ENV: "amd:4"}
    assert job_environments(4, "auto", four) == [
        {"HIP_VISIBLE_DEVICES": str(k), "CUDA_VISIBLE_DEVICES": str(k)} for k in range(4)]
    masked = {FAKE_GPUS_ENV: "amd:8", "ROCR_VISIBLE_DEVICES": "1,3,5,7"}
    assert job_environments(4, "auto", masked) == [
        {"ROCR_VISIBLE_DEVICES": g} for g in ("1", "3", "5", "7")]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in job_environments(
        3, "cuda", {FAKE_GPUS_ENV: "nvidia:2"})] == ["0", "1", "0"]
    assert job_environments(2, "cpu", four) == [{}, {}]
    assert job_environments(2, "auto", {FAKE_GPUS_ENV: "amd:0"}) == [{}, {}]


class _FinishedJob:
    """A job process that printed nothing and exited 0."""

    def __init__(self, argv: list[str], env: dict[str, str], **_: object) -> None:
        self.argv, self.env = argv, env
        self.stdout, self.stderr = io.StringIO(), io.StringIO()
        self.pid, self.returncode = 0, 0

    def wait(self) -> int:
        return 0


def test_jobs_auto_with_four_gpus_starts_four_jobs_each_pinned_to_its_own(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """With fake masks of 4 GPUs (and 4 cores), ``--jobs auto`` starts 4 jobs, job k pinned to
    GPU k-1."""
    for var in VISIBILITY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(FAKE_GPUS_ENV, "nvidia:4")
    monkeypatch.setattr(jobs_module.os, "cpu_count", lambda: 4)
    started: list[_FinishedJob] = []
    monkeypatch.setattr(jobs_module.subprocess, "Popen",
                        lambda argv, **kw: started.append(_FinishedJob(argv, **kw))
                        or started[-1])
    cli.main(["run", "--jobs", "auto", "--artifacts", str(tmp_path / "artifacts"),
              "--report", str(tmp_path / "r.json")])
    assert [job.argv[job.argv.index("--job") + 1] for job in started] == [
        "1/4", "2/4", "3/4", "4/4"]
    assert [job.env["CUDA_VISIBLE_DEVICES"] for job in started] == ["0", "1", "2", "3"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["jobs"] == 4
    assert report["config"]["job_gpus"] == [f"CUDA_VISIBLE_DEVICES={k}" for k in range(4)]
    assert "job 4/4: CUDA_VISIBLE_DEVICES=3" in capsys.readouterr().err
