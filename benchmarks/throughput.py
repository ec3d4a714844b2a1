"""Cases per second, and where the time goes, at small and production decode shapes.

    python -m benchmarks.throughput --shape production --device cuda --cases 6
    python -m benchmarks.throughput --shape small --device cpu --cases 20
    python -m benchmarks.throughput --shape small --device cpu --cases 3 --profile 25

Production: 16 query heads per rank, 1 KV head, top-k 16, 128 requests of 64 blocks, fp8
KV, a 55k-block cache. Two warm-up cases (Triton compilation, the comparison's CUDA graph
capture) are not counted. The timed cases run as ``difftest run`` runs them on a GPU
(``Session.run_all``): a worker process builds each case's host-side inputs (rows, segment
tables, page table, features) while earlier cases run; that work is printed on its own line
(``host preparation``, measured in this process on three of the cases) and is not part of
any stage.

Stages, as the runner times them (wall clock, device synchronised): ``generate`` (the
case's data on the device from the prepared tables), ``cache:<order>``, ``reference``
(``torch-ref``, float64), each backend, ``compare``. "framework" is generation + cache
build + comparison. Inside the reference and each backend the benchmark separates:

* ``call``: the backend's own ``run``/``reference`` (without the session's bookkeeping around
  it: the fsynced pending file that names the running backend, the output digest), and
* ``kernel``: the backend's Triton launches, timed by wrapping Triton's launch entry points
  (``JITFunction.run``; ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``): CUDA
  events around each launch on a GPU (the device time of the kernel itself), the interpreted
  launch's wall time on the CPU. ``adapter`` is ``call - kernel``: views, tables, casts,
  output buffers, the kernel lookup. A backend that launches no Triton kernel (``torch-ref``)
  shows its ``call`` only, and on a GPU its device span (CUDA events around the call).
  Launches inside a CUDA graph's capture are not timed, and a replayed graph's kernels are
  not Triton launches: on a GPU the reference (replayed from its graph from the second
  case of a shape on) shows its call and device span only.

After the table, the same cases run again without the timers (no synchronisation or events
around each call), alternately one by one (``Session.run``, serial) and pipelined
(``Session.run_all``: a worker process builds the next cases' host-side inputs while the
current case runs), ``--repeats`` times each on fresh cases; both medians are printed.

``--device-busy N`` (a GPU; refused on the CPU) runs ``N`` more cases pipelined under
torch.profiler and prints each stage's device-busy time (:mod:`benchmarks.device_busy`: the
GPU's own work, charged to the stage whose host call launched it, graph replays included):
the floor below each stage's wall that no host-side change reaches, and the ratio the issue
asks for on device work alone; then each stage's host span and the torch operators and CUDA
calls that fill it (:func:`benchmarks.device_busy.host_calls`).

``--profile N`` runs one more case under cProfile (and torch.profiler on a GPU) and prints
the N largest entries. ``--json PATH`` keeps the numbers printed (mean ms per stage, the
untimed medians, device-busy per stage) under ``throughput`` in PATH (its other keys kept);
:mod:`benchmarks.real_job` measures the README's main job beside them.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks import device_busy
from difftest.case.spec import Case
from difftest.primitives.jsonfile import read_json, write_json
from difftest.run.runner import RunHooks, prepare_host
from difftest.run.session import Session

FRAMEWORK_STAGES = ("generate", "cache:plain", "cache:shuffled", "compare")
FRAMEWORK = "framework"
WARMUPS = 2


def production_case(seed: int, num_blocks: int = 55_000, batch: int = 128, topk: int = 16,
                    blocks_per_request: int = 64, query_dtype: str = "bfloat16",
                    kv_dtype: str = "float8_e4m3fn") -> Case:
    """A decode step at production shape, with indexer-style selections."""
    rng = random.Random(seed)
    physical = rng.sample(range(num_blocks), batch * blocks_per_request)
    seq_lens, tables, selections = [], [], []
    for r in range(batch):
        seq_len = blocks_per_request * 128 - rng.randrange(128)
        self_blk = (seq_len - 1) // 128
        tables.append(tuple(physical[r * blocks_per_request:(r + 1) * blocks_per_request]))
        seq_lens.append(seq_len)
        others = rng.sample(range(1, self_blk), topk - 2)
        selections.append((0, self_blk, *others))
    return Case(num_blocks=num_blocks, seq_lens=tuple(seq_lens), block_tables=tuple(tables),
                selections=tuple(selections), query_dtype=query_dtype, kv_dtype=kv_dtype,
                k_scale=0.05, v_scale=0.02, seed=seed, name=f"production-{seed}")


def small_case(seed: int, query_dtype: str) -> Case:
    """The corpus-sized case: 2 requests, top-k 16, 128 blocks."""
    return production_case(seed, num_blocks=128, batch=2, blocks_per_request=20,
                           query_dtype=query_dtype).replace(name=f"small-{seed}")


class LaunchTimer:
    """Times Triton launches and backend calls, attributed to the stage running them.

    Timings are kept as pending CUDA event pairs (resolved by :meth:`collect` after the
    case, when the runner has synchronised) or as seconds on the CPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.active = True  # False: launches run untimed
        self.stage = FRAMEWORK
        self.kernel: dict[str, list[Any]] = defaultdict(list)
        self.call: dict[str, list[float]] = defaultdict(list)
        self.span: dict[str, list[Any]] = defaultdict(list)

    def install(self) -> None:
        """Wrap Triton's launch entry points (compiled and interpreted)."""
        from triton.runtime import interpreter, jit

        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            if not getattr(cls.run, "_difftest_timed", False):
                cls.run = self._timed_launch(cls.run)

    def _timed_launch(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def timed(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if warmup or not self.active or (self.cuda and
                                             torch.cuda.is_current_stream_capturing()):
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            with self._measure(self.kernel[self.stage]):
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        timed._difftest_timed = True  # type: ignore[attr-defined]
        return timed

    @contextmanager
    def _measure(self, into: list[Any]) -> Iterator[None]:
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            into.append((start, end))
        else:
            begun = time.perf_counter()
            yield
            into.append(time.perf_counter() - begun)

    @contextmanager
    def stage_of(self, name: str) -> Iterator[None]:
        """Attribute launches to ``name`` and time the call (device span too on a GPU)."""
        outer, self.stage = self.stage, name
        begun = time.perf_counter()
        try:
            with self._measure(self.span[name]):
                yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.call[name].append(time.perf_counter() - begun)
            self.stage = outer

    def collect(self) -> dict[str, float]:
        """This case's seconds per ``<stage>:kernel``, ``<stage>:span`` and ``<stage>:call``;
        clears them."""
        found: dict[str, float] = {}
        for kind, table in (("kernel", self.kernel), ("span", self.span)):
            for stage, items in table.items():
                found[f"{stage}:{kind}"] = sum(self._seconds(item) for item in items)
        for stage, seconds in self.call.items():
            found[f"{stage}:call"] = sum(seconds)
        for table in (self.kernel, self.span, self.call):
            table.clear()
        return found

    def _seconds(self, item: Any) -> float:
        if self.cuda:
            start, end = item
            return start.elapsed_time(end) / 1e3
        return item


class TimerHooks(RunHooks):
    """Runner hooks that attribute each reference and backend call to its stage of the
    :class:`LaunchTimer`."""

    def __init__(self, timer: LaunchTimer) -> None:
        self.timer = timer

    def calling(self, case: Case, backend: str, stage: str) -> AbstractContextManager[None]:
        """The call, timed as ``stage`` (``reference`` or the backend's name)."""
        return self.timer.stage_of(stage)


def profile_case(session: Session, case: Case, top: int) -> None:
    """Run ``case`` under cProfile (and torch.profiler on a GPU) after one unprofiled case
    (the session's cache pool filled, as in a run); print the largest entries."""
    session.run(dataclasses.replace(case, seed=case.seed + 1))
    profiler = cProfile.Profile()
    if session.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiler.runcall(session.run, case)
        for order in ("cuda_time_total", "self_cpu_time_total"):
            print(prof.key_averages().table(sort_by=order, row_limit=top))
    else:
        profiler.runcall(session.run, case)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(text.getvalue())


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options (``argv``: else ``sys.argv``); exits 2 on a bad one."""
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("small", "production"), default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cases", type=int, default=5)
    parser.add_argument("--backends", default="triton-unified")
    parser.add_argument("--query-dtype", default=None,
                        help="default: bfloat16 on GPUs, float16 on the CPU (docs/findings.md F1)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating serial and pipelined passes without timers")
    parser.add_argument("--device-busy", type=int, default=0, metavar="N",
                        help="on a GPU: N more cases under torch.profiler, device-busy per stage")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile one more case and print its N largest entries")
    parser.add_argument("--json", default=None, help="keep the numbers under throughput here")
    return parser


def main() -> None:
    """Run the benchmark and print a table."""
    args = arguments()
    session = Session.create(args.backends.split(","), device=args.device)
    if args.device_busy and session.device.type != "cuda":
        parser().error(f"--device-busy needs a CUDA/ROCm GPU (the device is "
                       f"{session.device.type}); leave it out on the CPU")
    timer = LaunchTimer(session.device)
    timer.install()
    hooks = TimerHooks(timer)
    session.hooks.append(hooks)
    q_dtype = args.query_dtype or ("bfloat16" if session.device.type == "cuda" else "float16")
    make = ((lambda s: production_case(s, query_dtype=q_dtype)) if args.shape == "production"
            else (lambda s: small_case(s, q_dtype)))
    stages: dict[str, list[float]] = defaultdict(list)
    walls = []
    for seed in range(WARMUPS):  # Triton compilation; the comparison's graph capture
        session.run(make(10_000 + seed))
    timer.collect()
    start = time.perf_counter()
    session.pool().submit(int).result()  # the preparation worker's start, once per session
    print(f"preparation worker started in {time.perf_counter() - start:.2f} s", flush=True)
    cases = [make(seed) for seed in range(1, args.cases + 1)]
    runs = session.run_all((case, None) for case in cases)
    for seed in range(1, args.cases + 1):
        start = time.perf_counter()
        result = next(runs)
        wall = time.perf_counter() - start
        inner = timer.collect()
        statuses = {r.backend: r.status.value for r in result.results}
        print(f"case {seed}: {wall:.3f} s  {statuses}", flush=True)
        for r in result.results:
            if r.detail and r.status.value not in ("agree", "unsupported", "unavailable"):
                print(f"  {r.backend}: {r.detail.splitlines()[0]}", flush=True)
        walls.append(wall)
        for stage, seconds in (*result.timings.items(), *inner.items()):
            stages[stage].append(seconds)
        stages["session"].append(wall - sum(result.timings.values()))
    host = []
    for case in cases[:3]:
        start = time.perf_counter()
        prepare_host(case)
        host.append(time.perf_counter() - start)
    stages["host preparation"] = host
    mean = {stage: statistics.mean(values) for stage, values in stages.items()}
    median = {stage: statistics.median(values) for stage, values in stages.items()}
    print_table(args, session, q_dtype, mean, median, walls)
    timer.active = False
    session.hooks.remove(hooks)
    numbers: dict[str, Any] = {
        "shape": args.shape, "device": str(session.device), "query_dtype": q_dtype,
        "backends": [b.name for b in session.backends], "timed_cases": len(walls),
        "mean_ms": {stage: round(1e3 * s, 4) for stage, s in mean.items()},
        "cases_per_s_timed": round(len(walls) / sum(walls), 3)}
    untimed = print_untimed(session, make, range(1, args.cases + 1), mean, args.repeats)
    numbers["cases_per_s_untimed"] = {mode: round(1 / s, 3) for mode, s in untimed.items()}
    if args.device_busy:
        seeds = range(args.cases + 2, args.cases + 2 + args.device_busy)
        numbers["device_busy_ms"] = print_device_busy(session, make, seeds)
    if args.json:
        existing = read_json(args.json) if Path(args.json).is_file() else {}
        write_json(args.json, existing | {"throughput": numbers})
    if args.profile:
        profile_case(session, make(args.cases + 1), args.profile)
    session.close()


def print_untimed(session: Session, make: Callable[[int], Case], seeds: range,
                  mean: dict[str, float], repeats: int = 3) -> dict[str, float]:
    """Cases per second without the timers: one by one, then pipelined, alternately
    ``repeats`` times on fresh cases (nothing cached from an earlier pass); the medians, and
    a check that both give the same verdicts. Returns each mode's median seconds per case."""
    walls: dict[str, list[float]] = defaultdict(list)
    verdicts: dict[str, list[Any]] = {}
    for _ in range(repeats):
        for mode in ("serial", "pipelined"):
            cases = [make(seed) for seed in seeds]
            start = time.perf_counter()
            results = ([session.run(case) for case in cases] if mode == "serial"
                       else list(session.run_all((case, None) for case in cases)))
            walls[mode].append((time.perf_counter() - start) / len(cases))
            verdicts[mode] = [[(r.backend, r.status) for r in res.results] for res in results]
    session.close()
    if verdicts["serial"] != verdicts["pipelined"]:
        raise SystemExit("the pipelined run's verdicts differ from the serial run's")
    print(f"without timers, {len(seeds)} cases, median of {repeats} alternating passes:")
    for mode, per_case in walls.items():
        median = statistics.median(per_case)
        runs = ", ".join(f"{1e3 * w:.2f}" for w in per_case)
        print(f"  {mode:<10} {1e3 * median:6.2f} ms per case ({runs}), "
              f"{1 / median:.3f} cases per second")
    piped = statistics.median(walls["pipelined"])
    for backend in session.backends:
        kernel = mean.get(f"{backend.name}:kernel")
        if kernel:
            print(f"pipelined, (a case's wall - the {backend.name} kernel) / that kernel: "
                  f"{(piped - kernel) / kernel:.2f}")
    return {mode: statistics.median(per_case) for mode, per_case in walls.items()}


def print_device_busy(session: Session, make: Callable[[int], Case], seeds: range
                      ) -> dict[str, float]:
    """Run ``seeds``' cases pipelined under the profiler; print each stage's device-busy ms
    per case (and its largest GPU activities), (framework + reference) over each backend's
    on device work alone, then each stage's host span per case and the calls that fill it.
    Returns each stage's device-busy ms per case, and ``framework + reference``."""
    cases = [make(seed) for seed in seeds]
    trace_path = Path(tempfile.gettempdir()) / "difftest-device-busy.json"
    trace = device_busy.profiled_trace(lambda: list(session.run_all((c, None) for c in cases)),
                                       session.reference, session.backends, trace_path)
    busy = device_busy.attribute(trace)
    per_case = {stage: b.seconds / len(cases) for stage, b in busy.items()}
    print(f"device-busy ms per case, {len(cases)} cases under torch.profiler "
          f"(trace {trace_path}):")
    for stage, b in sorted(busy.items(), key=lambda item: -item[1].seconds):
        top = ", ".join(f"{name[:40]} {1e3 * s / len(cases):.3f}" for name, s in b.largest())
        print(f"  {stage:<24}{1e3 * per_case[stage]:8.3f}  ({b.activities // len(cases)} "
              f"activities; {top})")
    spent = sum(per_case.get(s, 0.0) for s in (*FRAMEWORK_STAGES, "reference"))
    print(f"  {'framework + reference':<24}{1e3 * spent:8.3f}")
    for backend in session.backends:
        if per_case.get(backend.name):
            print(f"device-busy (framework + reference) / {backend.name}: "
                  f"{spent / per_case[backend.name]:.2f}")
    print("host ms per case under the profiler (its own cost included): each stage's span, "
          "then its largest calls (op: torch operator, rt: CUDA runtime/driver), count per case")
    host = device_busy.host_calls(trace)
    for stage, h in sorted(host.items(), key=lambda item: -item[1].seconds):
        if stage == device_busy.UNATTRIBUTED:
            continue
        print(f"  {stage:<24}{1e3 * h.seconds / len(cases):8.3f}")
        for name, count, seconds in h.largest():
            print(f"      {name[:52]:<52}{count / len(cases):6.1f}x"
                  f"{1e3 * seconds / len(cases):8.3f}")
    return {stage: round(1e3 * s, 4) for stage, s in
            (*per_case.items(), ("framework + reference", spent))}


def print_table(args: argparse.Namespace, session: Session, q_dtype: str,
                mean: dict[str, float], median: dict[str, float], walls: list[float]) -> None:
    """Per stage: the runner's wall time (mean, and the median beside it, which one slow
    case such as a compilation does not move), and inside each backend its call and
    kernel (means)."""
    print(f"\nshape {args.shape}, device {session.device}, {len(walls)} timed cases, "
          f"query {q_dtype}; mean ms per case")
    ms = lambda seconds: f"{1e3 * seconds:>10.2f}"  # noqa: E731
    print(f"{'stage':<26}{'wall':>10}{'median':>10}{'call':>10}{'kernel':>10}{'adapter':>10}"
          f"{'device':>10}")
    backends = ["reference", *(b.name for b in session.backends)]
    for stage in (*FRAMEWORK_STAGES, *backends, "session"):
        if stage not in mean:
            continue
        row = f"{stage:<26}{ms(mean[stage])}{ms(median[stage])}"
        if stage in backends and f"{stage}:call" in mean:
            call, kernel = mean[f"{stage}:call"], mean.get(f"{stage}:kernel")
            row += ms(call) + (ms(kernel) + ms(call - kernel) if kernel is not None
                               else f"{'-':>10}{'-':>10}")
            if f"{stage}:span" in mean and session.device.type == "cuda":
                row += ms(mean[f"{stage}:span"])
        print(row)
    framework = sum(mean.get(s, 0.0) for s in FRAMEWORK_STAGES)
    print(f"{'framework':<26}{ms(framework)}")
    if "host preparation" in mean:
        print(f"{'host preparation':<26}{ms(mean['host preparation'])}"
              "  (in the worker process, overlapped; not in framework)")
    if f"{FRAMEWORK}:kernel" in mean:
        print(f"{'  of which Triton kernels':<26}{ms(mean[f'{FRAMEWORK}:kernel'])}")
    spent = framework + mean.get("reference", 0.0)
    print(f"{'framework + reference':<26}{ms(spent)}")
    for backend in backends[1:]:
        print(f"(framework + reference) / {backend} wall: {spent / mean[backend]:.2f}")
        kernel = mean.get(f"{backend}:kernel")
        if kernel:
            print(f"(framework + reference) / {backend} kernel: {spent / kernel:.2f}")
    print(f"cases per second: {len(walls) / sum(walls):.3f}")


if __name__ == "__main__":
    main()
