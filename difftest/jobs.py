"""``difftest run --jobs N``: the case set split across N local processes, their reports
joined into one.

On a machine with GPUs each job is pinned to one GPU as the pytest-xdist workers are
(:func:`job_environments`, :func:`difftest.pinning.assign`: round-robin within the mask the
runner set), and ``--jobs auto`` runs one job per visible GPU. On the CPU,
Triton's interpreter and the float64 reference run in one Python thread, so one process
uses one core. Each job is ``difftest run`` with the same options plus ``--job K/N``: it
builds the same case set (the corpus, the generated cases, the shard) and walks it in order,
running each case it claims first (:func:`claimed`), so the jobs share the cases as they
free up (a static split left one job 8 s behind the other on the main job); it writes
pending files to the shared artifacts directory as any run does.

This process relays each job's lines prefixed ``[job K/N]``, turns the pending case of a job
that died into a crash artifact (as the next run would), and merges the jobs' reports with
:func:`difftest.shard.merge_reports`: the report is the one a single process writes, but for
timings, ``config.jobs`` and ``merged_from`` (the cases each job ran).

Each job runs with ``OMP_NUM_THREADS=1`` unless it is set: one thread for torch and for
numpy's BLAS (whose threads otherwise spin against the other jobs: the README's main job
took 61.6 s with two jobs at the default threads, 43.6 s with one each). The BLAS thread
count changes the bits of the interpreter's ``tl.dot`` (vllm-triton-sparse's outputs in 2 of
22 cases; docs/findings.md F19), so a job's results equal those of one process run with the
same ``OMP_NUM_THREADS``; the fingerprint records it and a replay shows it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from difftest import pinning
from difftest.artifacts import ArtifactStore
from difftest.records import CaseRecord
from difftest.shard import merge_reports

Run = TypeVar("Run")
MAX_AUTO_JOBS = 8  # "auto" uses the cores, at most this many (each job holds torch and vLLM)


def auto_jobs() -> int:
    """The jobs ``--jobs auto`` runs on the CPU: one per core, at most :data:`MAX_AUTO_JOBS`."""
    return max(1, min(os.cpu_count() or 1, MAX_AUTO_JOBS))


def visible_gpus(environ: dict[str, str] | None = None) -> int:
    """The GPUs jobs can be pinned to: those the drivers report (or ``DIFFTEST_FAKE_GPUS``)
    within the runner's mask, counted without starting a GPU runtime."""
    from difftest.gpus import visible_gpus as read_mask

    vendor, physical = pinning.detect(environ)
    return len(read_mask(pinning.runner_mask(environ), physical, vendor).entries)


def job_environments(jobs: int, device: str, environ: dict[str, str] | None = None
                     ) -> list[dict[str, str]]:
    """The GPU visibility variables of each of ``jobs`` jobs: job ``k`` pinned to its own GPU
    (round-robin when jobs outnumber GPUs) within the runner's mask, as the xdist workers are;
    empty dicts on the CPU. :class:`difftest.pinning.PinningError` on a mask that cannot be
    honoured."""
    vendor, physical = pinning.detect(environ)
    mask = pinning.runner_mask(environ)
    return [pinning.assign(k, jobs, mask, physical, vendor, device) for k in range(jobs)]


def claimed(runs: Iterable[Run], claims: Path) -> Iterator[Run]:
    """The runs this job claims, lazily, each just before it runs: the first job to create
    ``claims/<position>`` (exclusively) runs it, so the jobs share the cases as they free up."""
    for position, run in enumerate(runs):
        try:
            os.close(os.open(claims / str(position), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        yield run


def run_jobs(options: Sequence[str], jobs: int, artifacts: str,
             gpu_envs: Sequence[dict[str, str]] = ()
             ) -> tuple[dict[str, Any] | None, list[CaseRecord], list[str]]:
    """Run ``difftest run <options>`` as ``jobs`` processes, job ``k`` with the visibility
    variables ``gpu_envs[k]`` (:func:`job_environments`; none on the CPU); return the merged
    report (None if no job wrote one), the crash records of jobs that died, and what went
    wrong."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    envs = [env | (dict(gpu_envs[k]) if k < len(gpu_envs) else {}) for k in range(jobs)]
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="difftest-jobs-") as tmp:
        paths = [Path(tmp) / f"job-{k}.json" for k in range(1, jobs + 1)]
        claims = Path(tmp) / "claims"
        claims.mkdir()
        procs = [subprocess.Popen(
            [sys.executable, "-m", "difftest.cli", "run", *options, "--job", f"{k}/{jobs}",
             "--claims", str(claims), "--report", str(path)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=envs[k - 1])
            for k, path in enumerate(paths, 1)]
        relays = [threading.Thread(target=_relay, args=(stream, out, f"[job {k}/{jobs}] "))
                  for k, proc in enumerate(procs, 1)
                  for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        for relay in relays:
            relay.start()
        for relay in relays:
            relay.join()
        dead = set()
        for k, proc in enumerate(procs, 1):
            if proc.wait() not in (0, 1):
                dead.add(proc.pid)
                problems.append(f"job {k}/{jobs} died (exit status {proc.returncode}) in the "
                                "case it left pending; the cases it had not claimed went to "
                                "the other jobs, while any lived")
        crashes = ArtifactStore(artifacts).recover_crashes(
            "found by difftest run --jobs when its job died", dead) if dead else []
        reports = [(f"job {k}/{jobs}", _read(path)) for k, path in enumerate(paths, 1)
                   if path.is_file()]
    if not reports:
        return None, crashes, problems
    # the jobs share one config, so the only warnings are of --shard's other shards missing
    merged, _ = merge_reports(reports)
    return merged, crashes, problems


def _read(path: Path) -> dict[str, Any]:
    from difftest.report import read_report

    return read_report(path)


def _relay(stream: IO[str] | None, out: IO[str], prefix: str) -> None:
    assert stream is not None
    for line in stream:
        out.write(prefix + line)
        out.flush()
