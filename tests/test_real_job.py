"""The GPU speed commands (scripts/gpu_check.sh's speed parts) and the real-job benchmark.

No GPU here: the script runs with a stand-in Python that records each command, and each
recorded command's options are checked by the benchmark's own parser; the benchmark itself
runs the CPU's version of the job (a fake backend, a few cases) and keeps its numbers.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import real_job, throughput

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PLUGIN = Path(__file__).parent / "fake_backends.py"


def test_gpu_check_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_speed_part_runs_every_gpu_measurement(tmp_path: Path) -> None:
    """``gpu_check.sh OUT speed`` runs the main job cold and warm with device-busy, the
    production shape and pytest's worker counts, each writing speed.json, with options the
    benchmarks accept (on an image that writes bytecode)."""
    stand_in = tmp_path / "python"
    log = tmp_path / "commands"
    stand_in.write_text(f'#!/usr/bin/env bash\necho "$*" >> {shlex.quote(str(log))}\n')
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(["bash", str(SCRIPT), str(out), "speed"], capture_output=True,
                          text=True, env=dict(env, PYTHON=str(stand_in)), timeout=60)
    assert done.returncode == 0, done.stderr
    commands = [shlex.split(line) for line in log.read_text().splitlines()]
    assert [c[:2] for c in commands] == [["-m", "benchmarks.real_job"],
                                        ["-m", "benchmarks.throughput"],
                                        ["-m", "benchmarks.real_job"]]
    job, shape, workers = (c[2:] for c in commands)
    job_args = real_job.arguments(job)
    assert (job_args.device, job_args.passes, job_args.device_busy, job_args.examples,
            job_args.jobs) == ("cuda", ["cold", "warm"], 40, 40, "auto")
    shape_args = throughput.arguments(shape)
    assert (shape_args.shape, shape_args.device, shape_args.device_busy) == (
        "production", "cuda", 10)
    workers_args = real_job.arguments(workers)
    assert (workers_args.passes, workers_args.pytest) == ([], [1, 4])
    assert {job_args.json, shape_args.json, workers_args.json} == {str(out / "speed.json")}
    summary = (out / "summary.txt").read_text()
    assert [line.split(":")[0] for line in summary.splitlines()] == [
        "speed-job", "speed-shape", "speed-pytest"]


def test_an_image_that_writes_no_bytecode_is_measured_with_it_kept_too(tmp_path: Path) -> None:
    """Where ``PYTHONDONTWRITEBYTECODE`` is set, ``speed-job`` runs the main job cold and warm
    again with the bytecode kept (a small run writes it first) into speed-bytecode.json."""
    stand_in = tmp_path / "python"
    log = tmp_path / "commands"
    stand_in.write_text(f'#!/usr/bin/env bash\necho "${{PYTHONDONTWRITEBYTECODE:-unset}} '
                        f'${{PYTHONPYCACHEPREFIX:-none}} $*" >> {shlex.quote(str(log))}\n')
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(stand_in), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(["bash", str(SCRIPT), str(out), "speed-job"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = [shlex.split(line) for line in log.read_text().splitlines()]
    assert [r[:4] for r in runs] == [["1", "none", "-m", "benchmarks.real_job"],
                                     ["unset", str(out / "pycache"), "-m", "difftest.cli"],
                                     ["unset", str(out / "pycache"), "-m", "benchmarks.real_job"]]
    kept = real_job.arguments(runs[2][4:])
    assert (kept.passes, kept.json) == (["cold", "warm"], str(out / "speed-bytecode.json"))
    summary = (out / "summary.txt").read_text()
    assert [line.split(":")[0] for line in summary.splitlines()] == [
        "speed-job", "speed-job-bytecode"]


def test_bad_options_are_refused() -> None:
    for argv in (["--passes", "hot"], ["--device", "cpu", "--device-busy", "3"],
                 ["--pytest", "four"]):
        with pytest.raises(SystemExit) as exit_info:
            real_job.arguments(argv)
        assert exit_info.value.code == 2


def test_the_real_job_on_the_cpu_keeps_its_numbers(tmp_path: Path) -> None:
    """One pass of ``difftest run`` (a fake backend) measured and kept under ``real_job``."""
    numbers = tmp_path / "speed.json"
    numbers.write_text(json.dumps({"throughput": {"kept": True}}))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.real_job", "--device", "cpu", "--passes", "warm",
         "--examples", "2", "--jobs", "1", f"--run-option=--plugin={PLUGIN}",
         "--run-option=--backends=rounded", "--run-option=--no-corpus", "--work",
         str(tmp_path / "work"), "--json", str(numbers)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    kept = json.loads(numbers.read_text())
    assert kept["throughput"] == {"kept": True}
    warm = kept["real_job"]["warm"]
    assert warm["exit"] == 0 and warm["cases"] >= 2 and warm["cases_per_s"] > 0
    assert warm["cpu_s"] > 0 and len(warm["load_average"]) == 3
    assert warm["kernel_compiles"] == {} and "rounded" in warm["stage_seconds"]
    assert kept["real_job"]["machine"]["device"] == "cpu"
    assert "kernels: no Triton kernel launched" in done.stdout
