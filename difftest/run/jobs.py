"""``difftest run --jobs N``: the case set split across N local processes, their reports
joined into one.

On a machine with GPUs each job is pinned to one GPU as the pytest-xdist workers are
(:func:`job_environments`, :func:`difftest.machine.pinning.assign`: round-robin within the mask the
runner set). ``--jobs auto`` (:func:`auto_jobs`) runs one job per core, on GPUs too: a job
spends most of a case on one core (Python, launches, and Triton compiling each new kernel
specialization), so several jobs per GPU compile distinct specializations on the other cores
while the GPU runs cases already compiled. On the CPU, Triton's interpreter and the float64
reference run in one Python thread, so one process uses one core. Each job is ``difftest
run`` with the same options plus ``--job K/N``: it builds the same case set (the corpus, the
generated cases, the shard) and walks the same units of it (:func:`claim_units`), running
each unit it claims first (:func:`claimed`), so the jobs share the cases as they free up
(docs/performance.md, "Jobs on a GPU"); it writes pending files to the shared artifacts
directory as any run does. On a GPU a unit is a run of cases of one
kernel class (dtypes, geometry, modes: what selects the kernels' compiled code), so one job
compiles a class's specializations while the others compile other classes'; units go out
largest first, so no long one is left for the end.

This process relays each job's lines prefixed ``[job K/N]``, turns the pending case of a job
that died into a crash artifact (as the next run would), and merges the jobs' reports with
:func:`difftest.run.shard.merge_reports`: the report is the one a single process writes, but for
timings, ``config.jobs`` and ``merged_from`` (the cases each job ran).

Nothing a job finished is lost when it dies: each job appends every record to
``<its report>.records`` as the case ends, and the parent takes the records of a job that
wrote no report from there. The jobs import the parent's ``difftest`` (``PYTHONSAFEPATH``, its
directory first on ``PYTHONPATH``), never one in the current directory, and end with the
parent (``PR_SET_PDEATHSIG``: SIGTERM, on Linux). Their directory lives under the artifacts
(``jobs/<pid>.*``); one whose parent died is removed by the next ``--jobs`` run. An
interrupt (SIGINT, SIGTERM, SIGHUP) reaches every job, each writes its partial report, and the
parent merges them and says which signal stopped the run.

Each job runs with ``OMP_NUM_THREADS=1`` unless it is set: one thread for torch and for
numpy's BLAS, whose threads otherwise spin against the other jobs. The BLAS thread count
changes the bits of the interpreter's ``tl.dot`` (docs/findings.md F19, with the timings), so
a job's results equal those of one process run with the same ``OMP_NUM_THREADS``; the
fingerprint records it and a replay shows it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from difftest.case.spec import Case
from difftest.machine import pinning
from difftest.machine.fingerprint import fingerprint
from difftest.primitives.interrupts import Interrupted
from difftest.primitives.jsonfile import JSONFileError, loads
from difftest.reporting.report import build_report
from difftest.results.artifacts import ArtifactStore, pid_alive, pid_domain
from difftest.results.records import CaseRecord, RecordError
from difftest.run.shard import merge_reports

Run = TypeVar("Run")
PARENT_ENV = "DIFFTEST_JOBS_PARENT"  # a job's parent's pid
MAX_AUTO_JOBS = 8  # "auto" uses the cores, at most this many per GPU (or on the CPU)
JOB_MEMORY = 3 << 30  # host memory a job may hold (torch, vLLM, a CUDA context, its caches)
UNITS_PER_JOB = 4  # a kernel class is split into units of about 1/(jobs * this) of the work


def auto_jobs(gpus: int = 0, cores: int | None = None, memory: int | None = None) -> int:
    """The jobs ``--jobs auto`` runs with ``gpus`` GPUs visible (0: the CPU): one per core,
    at most :data:`MAX_AUTO_JOBS` per GPU (or on the CPU) and one per :data:`JOB_MEMORY` of
    host memory, and never fewer than one per GPU."""
    cores = cores if cores is not None else os.cpu_count() or 1
    memory = memory if memory is not None else _host_memory()
    fits = max(1, memory // JOB_MEMORY) if memory else cores
    return max(1, gpus, min(cores, MAX_AUTO_JOBS * max(1, gpus), fits))


def _host_memory() -> int:
    """Bytes of physical memory (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def visible_gpus(environ: dict[str, str] | None = None) -> int:
    """The GPUs jobs can be pinned to: those the drivers report (or ``DIFFTEST_FAKE_GPUS``)
    within the runner's mask, counted without starting a GPU runtime."""
    from difftest.machine.gpus import visible_gpus as read_mask

    vendor, physical = pinning.detect(environ)
    return len(read_mask(pinning.runner_mask(environ), physical, vendor).entries)


def job_environments(jobs: int, device: str, environ: dict[str, str] | None = None
                     ) -> list[dict[str, str]]:
    """The GPU visibility variables of each of ``jobs`` jobs: job ``k`` pinned to its own GPU
    (round-robin when jobs outnumber GPUs) within the runner's mask, as the xdist workers are;
    empty dicts on the CPU. :class:`difftest.machine.pinning.PinningError` on a mask that cannot be
    honoured."""
    vendor, physical = pinning.detect(environ)
    mask = pinning.runner_mask(environ)
    return [pinning.assign(k, jobs, mask, physical, vendor, device) for k in range(jobs)]


def kernel_class(case: Case) -> tuple[object, ...]:
    """What selects the compiled code of a case's kernels: dtypes, geometry and modes, not
    its sizes (rows, blocks, context lengths), which kernels take as run-time values."""
    return (case.query_dtype, case.kv_dtype, case.kv_layout, case.head_dim, case.block_size,
            case.page_size, case.num_q_heads, case.num_kv_heads, bool(case.softcap),
            bool(case.sliding_window), case.canary, bool(case.q_scale), bool(case.query_lens),
            case.decode_query_len > 1, case.split_k_segments, case.dense)


def claim_units(runs: Sequence[tuple[Case, Sequence[str] | None]], jobs: int,
                by_class: bool) -> list[list[int]]:
    """The runs (by position) as the jobs claim them: units of runs, largest first (the work
    of a run estimated as its query rows times the backends it runs on; ``None``: all).
    ``by_class``: each unit holds runs of one :func:`kernel_class`, a class split into units
    of about ``1 / (jobs * UNITS_PER_JOB)`` of the run's work; else one run per unit."""
    widest = max((len(names) for _, names in runs if names is not None), default=1)
    work = [case.total_q * (len(names) if names is not None else widest) for case, names in runs]
    if not by_class:
        return sorted(([i] for i in range(len(runs))), key=lambda unit: -work[unit[0]])
    classes: dict[tuple[object, ...], list[int]] = {}
    for i, (case, _) in enumerate(runs):
        classes.setdefault(kernel_class(case), []).append(i)
    share = sum(work) / max(1, jobs * UNITS_PER_JOB)
    units: list[list[int]] = []
    for members in classes.values():
        unit: list[int] = []
        for i in sorted(members, key=lambda i: -work[i]):
            if unit and sum(work[j] for j in unit) + work[i] > share:
                units.append(unit)
                unit = []
            unit.append(i)
        units.append(unit)
    return sorted(units, key=lambda unit: -sum(work[i] for i in unit))


def claimed(runs: Iterable[Run], claims: Path) -> Iterator[Run]:
    """The runs this job claims, lazily, each just before it runs: the first job to create
    ``claims/<position>`` (exclusively) runs it, so the jobs share the cases as they free up."""
    for position, run in enumerate(runs):
        try:
            os.close(os.open(claims / str(position), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        yield run


@dataclass
class JobsOutcome:
    """What the jobs left: the merged report (None if no job wrote one and none finished a
    case), the crash records of jobs that died, what went wrong, and the signal that
    interrupted the run (None if none did)."""

    report: dict[str, Any] | None
    crashes: list[CaseRecord]
    problems: list[str]
    interrupted: Interrupted | None = None
    in_flight: list[dict[str, Any]] = field(default_factory=list)  # the jobs' stopped cases


def run_jobs(options: Sequence[str], jobs: int, artifacts: str,
             gpu_envs: Sequence[dict[str, str]] = ()) -> JobsOutcome:
    """Run ``difftest run <options>`` as ``jobs`` processes, job ``k`` with the visibility
    variables ``gpu_envs[k]`` (:func:`job_environments`; none on the CPU), and join what they
    did."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONSAFEPATH"] = "1"  # the current directory's difftest must not shadow ours
    ours = str(Path(__file__).resolve().parents[2])  # the directory holding difftest/
    env["PYTHONPATH"] = os.pathsep.join([ours, *filter(None, [env.get("PYTHONPATH")])])
    env[PARENT_ENV] = str(os.getpid())
    envs = [env | (dict(gpu_envs[k]) if k < len(gpu_envs) else {}) for k in range(jobs)]
    problems: list[str] = []
    interrupted: Interrupted | None = None
    root = Path(artifacts) / "jobs"
    root.mkdir(parents=True, exist_ok=True)
    _remove_orphans(root)
    with tempfile.TemporaryDirectory(prefix=f"{os.getpid()}.", dir=root) as tmp:
        (Path(tmp) / "owner").write_text(pid_domain())
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
        try:
            for relay in relays:
                relay.join()
        except Interrupted as exc:  # the jobs end their cases as interrupted, then report
            interrupted = exc
            _stop(procs, exc.signum)
            for relay in relays:
                relay.join()
        dead = set()
        for k, proc in enumerate(procs, 1):
            status = proc.wait()
            if status in (0, 1) or (interrupted and status == interrupted.exit_status):
                continue
            dead.add(proc.pid)
            problems.append(f"job {k}/{jobs} died (exit status {status}) in the case it left "
                            "pending; the cases it had not claimed went to the other jobs, "
                            "while any lived")
        crashes = ArtifactStore(artifacts).recover_crashes(
            "found by difftest run --jobs when its job died", dead) if dead else []
        reports = [(f"job {k}/{jobs}", _read(path)) for k, path in enumerate(paths, 1)
                   if path.is_file()]
        salvaged = [record for path in paths if not path.is_file()
                    for record in _finished(path)]
    if not reports and not salvaged:
        return JobsOutcome(None, crashes, problems, interrupted)
    in_flight = [case for _, report in reports
                 for case in (report["config"].pop("interrupted", None) or {}).get(
                     "in_flight", [])]
    # the jobs share one config, so the only warnings are of --shard's other shards missing
    merged = merge_reports(reports)[0] if reports else None
    if merged is not None:
        known = {case["case_id"] for case in merged["cases"]}
        merged["cases"] += [r.to_dict() for r in salvaged if r.case_id not in known]
        merged["cases"].sort(key=lambda case: case["case_id"])
    elif salvaged:
        merged = build_report(salvaged, {}, {"runner": "difftest run"}, fingerprint())
    if salvaged:
        problems.append(f"{len(salvaged)} case(s) finished by jobs that wrote no report were "
                        "taken from their records")
    return JobsOutcome(merged, crashes, problems, interrupted, in_flight)


def _finished(report: Path) -> list[CaseRecord]:
    """The records a job appended as its cases ended (a killed job's last line may be cut)."""
    lines = Path(f"{report}.records")
    if not lines.is_file():
        return []
    records = []
    for n, line in enumerate(lines.read_text().splitlines(), start=1):
        try:
            records.append(CaseRecord.from_dict(loads(line, f"{lines} line {n}"), ""))
        except (JSONFileError, RecordError):
            break  # cut by the kill: the cases before it are whole
    return records


def _stop(procs: Sequence[subprocess.Popen[str]], signum: int, grace: float = 60.0) -> None:
    """Pass ``signum`` on to every live job, then wait ``grace`` seconds for each to write its
    partial report before killing it."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()


def end_with_parent() -> None:
    """In a job, before its first case: be sent SIGTERM when the parent dies (Linux
    ``PR_SET_PDEATHSIG``; elsewhere a killed parent leaves its jobs to finish on their own),
    and stop now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.environ.get(PARENT_ENV) not in (None, str(os.getppid())):
        raise Interrupted(signal.SIGTERM)


def _remove_orphans(root: Path) -> None:
    """Remove the job directories of ``--jobs`` runs that died (their pid gone, here)."""
    domain = pid_domain()
    for directory in root.iterdir():
        pid = directory.name.partition(".")[0]
        try:
            owner = (directory / "owner").read_text()
        except OSError:
            continue
        if pid.isdigit() and owner == domain and not pid_alive(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)


def _read(path: Path) -> dict[str, Any]:
    from difftest.reporting.report import read_report

    return read_report(path)


def _relay(stream: IO[str] | None, out: IO[str], prefix: str) -> None:
    assert stream is not None
    for line in stream:
        out.write(prefix + line)
        out.flush()
