"""The README's main job as a user runs it, cold and warm, and pytest's workers on one GPU.

    python -m benchmarks.real_job --device cuda --device-busy 40 --json out/speed.json
    python -m benchmarks.real_job --device cuda --passes none --pytest 1,4 --json out/speed.json
    python -m benchmarks.real_job --device cpu --passes warm

Each pass (``--passes``, default ``cold,warm``) is ``difftest run --examples 40 --jobs auto``
over every backend the machine has, in a process of its own: ``cold`` with an empty kernel
cache (a fresh ``DIFFTEST_KERNEL_CACHE``), ``warm`` with the same cache again (Triton loads
what ``cold`` compiled). Per pass it prints the wall and the CPU time of its processes (with
the load average: on a shared machine the wall stretches with the load), the cases and cases
per second, the jobs, the specializations compiled and loaded per stage with their seconds
(the report's ``kernel_compiles``, summed over the jobs, which compile side by side) and the
runner's seconds per stage summed over the cases (summed over the jobs too).

``--device-busy N`` (a GPU): the first N cases of the same job run again in this process,
one session, pipelined, under torch.profiler, after the passes (the cache warm): each
stage's device-busy milliseconds per case (:mod:`benchmarks.device_busy`: the GPU's own
work, charged to the stage that launched it) and framework + reference against the
backends' kernels. ``--pytest 1,4``: ``pytest -n K tests/test_differential.py`` (the ``ci``
profile: the corpus and 25 generated examples) for each K on this machine's device, each with
an empty kernel cache: the wall per worker count. ``--json PATH`` keeps every number under
``real_job`` in PATH (other keys, and those of an earlier ``real_job``, kept), for
docs/performance.md. The fixed-shape
numbers are :mod:`benchmarks.throughput`'s.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from difftest.machine.kernel_compiles import KERNEL_CACHE_ENV, describe, merged
from difftest.primitives.jsonfile import read_json, write_json

FRAMEWORK_STAGES = ("generate", "cache:plain", "cache:shuffled", "compare")
ROOT = Path(__file__).resolve().parents[1]


def machine(device: str) -> dict[str, Any]:
    """What ran it: the GPU (or CPU), cores, load and versions."""
    import torch
    import triton

    found: dict[str, Any] = {"device": device, "cores": os.cpu_count(),
                             "load_average": [round(x, 2) for x in os.getloadavg()],
                             "python": platform.python_version(), "torch": torch.__version__,
                             "triton": triton.__version__}
    if device == "cuda" and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["gpus"] = torch.cuda.device_count()
    return found


def summarize(report: dict[str, Any], wall: float) -> dict[str, Any]:
    """A pass's numbers from its report and wall time."""
    stages: dict[str, float] = {}
    for case in report["cases"]:
        for stage, seconds in case.get("timings", {}).items():
            stages[stage] = stages.get(stage, 0.0) + seconds
    compiles = merged([report["config"].get("kernel_compiles") or {}])
    cases = len(report["cases"])
    return {"wall_s": round(wall, 2), "cases": cases,
            "cases_per_s": round(cases / wall, 3) if wall > 0 else None,
            "jobs": report["config"].get("jobs", 1), "kernel_compiles": compiles,
            "stage_seconds": {k: round(v, 3) for k, v in sorted(stages.items())}}


def run_pass(name: str, device: str, examples: int, jobs: str, cache: Path, work: Path,
             extra: list[str]) -> dict[str, Any]:
    """One ``difftest run`` with ``cache`` as the kernel cache; its numbers."""
    report, log = work / f"{name}.json", work / f"{name}.log"
    env = dict(os.environ, **{KERNEL_CACHE_ENV: str(cache)})
    argv = [sys.executable, "-m", "difftest.cli", "run", "--device", device, "--examples",
            str(examples), "--jobs", jobs, "--report", str(report), "--artifacts",
            str(work / f"{name}-artifacts"), *extra]
    start, used = time.perf_counter(), _children_cpu()
    with log.open("w") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wall, cpu = time.perf_counter() - start, _children_cpu() - used
    if not report.is_file():
        return {"exit": done.returncode, "wall_s": round(wall, 2), "log": str(log)}
    numbers = summarize(read_json(report), wall) | {
        "exit": done.returncode, "cpu_s": round(cpu, 1), "log": str(log),
        "load_average": [round(x, 2) for x in os.getloadavg()]}
    print(f"{name}: {numbers['cases']} cases in {wall:.1f} s ({cpu:.0f} s of CPU, load average "
          f"{numbers['load_average'][0]} at the end), {numbers['cases_per_s']} cases/s, "
          f"{numbers['jobs']} jobs, exit {done.returncode}")
    print(f"  {describe(numbers['kernel_compiles'], str(cache))}")
    stages = numbers["stage_seconds"]
    print("  stage seconds summed over the cases: " + ", ".join(
        f"{k} {v:.1f}" for k, v in sorted(stages.items(), key=lambda item: -item[1])))
    return numbers


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children (the pass's processes):
    on a shared machine the wall stretches with the load, the CPU time much less."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def device_busy(device: str, examples: int, cases: int, work: Path) -> dict[str, Any]:
    """The first ``cases`` runs of the job in one session under the profiler: device-busy
    milliseconds per case and stage."""
    from benchmarks import device_busy as busy
    from difftest.generation.capabilities import Capabilities
    from difftest.generation.corpus import load_corpus
    from difftest.run.plan import RunPlan, drawn_examples
    from difftest.run.session import Session

    session = Session.create(None, device=device, artifacts=str(work / "busy-artifacts"))
    capabilities = Capabilities.probe(session.backends, session.device)
    plan = RunPlan.build(capabilities, load_corpus(), drawn_examples(capabilities, examples, 0))
    pairs = plan.pairs()[:cases]
    trace = busy.profiled_trace(lambda: list(session.run_all(pairs)), session.reference,
                                session.backends, work / "device-busy-trace.json")
    session.close()
    per_case = {stage: 1e3 * b.seconds / len(pairs) for stage, b in busy.attribute(trace).items()}
    spent = sum(per_case.get(s, 0.0) for s in (*FRAMEWORK_STAGES, "reference"))
    kernels = sum(per_case.get(b.name, 0.0) for b in session.backends)
    print(f"device-busy ms per case over {len(pairs)} cases of the job:")
    for stage, ms in sorted(per_case.items(), key=lambda item: -item[1]):
        print(f"  {stage:<28}{ms:9.3f}")
    print(f"  {'framework + reference':<28}{spent:9.3f}")
    print(f"  {'every backend':<28}{kernels:9.3f}")
    return {"cases": len(pairs), "ms_per_case": {k: round(v, 4) for k, v in per_case.items()},
            "framework_plus_reference_ms": round(spent, 4), "backends_ms": round(kernels, 4),
            "ratio": round(spent / kernels, 3) if kernels else None}


def pytest_walls(device: str, workers: list[int], work: Path) -> dict[str, Any]:
    """``pytest -n K`` of the differential suite per K, each with an empty kernel cache."""
    found = {}
    for count in workers:
        cache = Path(tempfile.mkdtemp(prefix=f"kernels-pytest-{count}-", dir=work))
        env = dict(os.environ, HYPOTHESIS_PROFILE="ci", **{KERNEL_CACHE_ENV: str(cache)})
        argv = [sys.executable, "-m", "pytest", "-n", str(count), "-q", "-p", "no:cacheprovider",
                "tests/test_differential.py", "--difftest-device", device,
                "--difftest-artifacts", str(work / f"pytest-{count}-artifacts")]
        log = work / f"pytest-{count}.log"
        start = time.perf_counter()
        with log.open("w") as out:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wall = time.perf_counter() - start
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        found[f"n{count}"] = {"wall_s": round(wall, 2), "exit": done.returncode,
                              "summary": tail[0], "log": str(log)}
        print(f"pytest -n {count}: {wall:.1f} s, exit {done.returncode}: {tail[0]}")
    walls = [found[f"n{k}"]["wall_s"] for k in workers]
    if len(walls) > 1:
        print(f"pytest walls relative to -n {workers[0]}: "
              + ", ".join(f"-n {k} {w / walls[0]:.2f}" for k, w in zip(workers, walls,
                                                                       strict=True)))
    return found


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options (``argv``: else ``sys.argv``); exits 2 on a bad one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--jobs", default="auto")
    parser.add_argument("--passes", default="cold,warm",
                        help="comma-separated: cold, warm (or none)")
    parser.add_argument("--device-busy", type=int, default=0, metavar="N",
                        help="on a GPU: N cases of the job under torch.profiler afterwards")
    parser.add_argument("--pytest", default="", metavar="K,K",
                        help="pytest -n K of tests/test_differential.py for each K")
    parser.add_argument("--run-option", action="append", default=[], metavar="OPTION",
                        help="passed on to difftest run (repeatable): --run-option=--no-corpus")
    parser.add_argument("--work", default=None, help="directory for reports, logs, caches")
    parser.add_argument("--json", default=None, help="keep the numbers under real_job here")
    args = parser.parse_args(argv)
    args.passes = [p for p in args.passes.split(",") if p and p != "none"]
    if set(args.passes) - {"cold", "warm"}:
        parser.error(f"--passes {','.join(args.passes)!r}: allowed cold, warm or none")
    if args.device_busy and args.device != "cuda":
        parser.error("--device-busy needs --device cuda (a GPU)")
    try:
        args.pytest = [int(k) for k in args.pytest.split(",") if k]
    except ValueError:
        parser.error(f"--pytest {args.pytest!r}: allowed worker counts, e.g. 1,4")
    return args


def main() -> None:
    """Run the passes asked for and print (and keep) their numbers."""
    args = arguments()
    passes = args.passes
    work = Path(args.work or tempfile.mkdtemp(prefix="difftest-real-job-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "kernel-cache"
    numbers: dict[str, Any] = {"machine": machine(args.device), "examples": args.examples,
                               "command": f"difftest run --device {args.device} --examples "
                                          f"{args.examples} --jobs {args.jobs}"}
    print(f"machine: {numbers['machine']}")
    for name in passes:
        if name == "cold" and cache.exists():
            cache = Path(tempfile.mkdtemp(prefix="kernel-cache-", dir=work))
        numbers[name] = run_pass(name, args.device, args.examples, args.jobs, cache, work,
                                 args.run_option)
        _keep(args.json, numbers)
    if args.device_busy:
        os.environ[KERNEL_CACHE_ENV] = str(cache)
        numbers["device_busy"] = device_busy(args.device, args.examples, args.device_busy, work)
        _keep(args.json, numbers)
    if args.pytest:
        numbers["pytest"] = pytest_walls(args.device, args.pytest, work)
        _keep(args.json, numbers)
    if passes:
        walls = [numbers[p]["wall_s"] for p in passes if "wall_s" in numbers[p]]
        print(f"median pass wall: {statistics.median(walls):.1f} s; work directory {work}")


def _keep(path: str | None, numbers: dict[str, Any]) -> None:
    """Write ``numbers`` under ``real_job`` in ``path`` (its other keys kept)."""
    if not path:
        return
    existing = read_json(path) if Path(path).is_file() else {}
    write_json(path, existing | {"real_job": existing.get("real_job", {}) | numbers})


if __name__ == "__main__":
    main()
