"""Detection power: how fast our strategies kill each mutant, against the peers' grids.

    python -m benchmarks.mutation_benchmark            # the full run (CPU: under 10 minutes)
    python -m benchmarks.mutation_benchmark --quick    # a smoke run
    python -m benchmarks.mutation_benchmark --json out.json
    python -m benchmarks.mutation_benchmark --diagnosis 3   # the diagnosis's share only
    python -m benchmarks.mutation_benchmark --diagnosis 3 --catalog mutants.kernel_faults \
        --families sparse,dense                             # ... of other mutants, both families

For every mutant of :mod:`mutants.catalog`:

* **ours**: a Hypothesis run of what ``difftest run`` gives the mutant's backend
  (:func:`difftest.generation.capabilities.cases_for_backend`: each drawn example or its nearest
  variant the backend runs; fixed seed, no database) that raises on the first kill;
  Hypothesis then shrinks the killing case within a budget of kernel runs, and the shrunk
  case's size is reported;
* **baselines**: the peers' grids of :mod:`difftest.generation.baseline`, in their order, up to a
cap.

A kill is the engine's verdict (:func:`difftest.run.runner.run_case` against ``torch-ref``):
DISAGREE, ERROR or CRASH. A case on which the mutation provably changes nothing the kernel
reads (``Mutation.reachable``) cannot kill it; it counts as an example survived, without a
kernel run, for both generators alike. Examples count the cases a mutant faced (cases its
backend declares unsupported are not examples). Seconds to the first kill: ours, the wall
time of the Hypothesis run up to the kill; baselines, the time of the cases the mutant ran
(generation, reference, its cache builds and its own run).

Diagnosis: for our first kill of each mutant, the first line of the engine's diagnosis
(:mod:`difftest.judgement.diagnosis`, on the comparison of a disagreement) and whether the
hypothesis it names is the one the mutation declares (``Mutation.diagnosis``); an error has no
output to diagnose and counts as not diagnosed.

Then the correct backends run on a long derandomized stretch of generated cases, and every
disagreement there is a false positive.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from difftest.case.spec import Case
from difftest.generation.baseline import AITER_BATCH_SIZES, BASELINES
from difftest.judgement.diagnosis import FAILED, hypothesis_of
from difftest.judgement.expectations import Expectation
from difftest.judgement.expectations import load as load_expectations
from difftest.machine import devices
from difftest.primitives.dtypes import KV_DTYPES, QUERY_DTYPES
from difftest.primitives.jsonfile import write_json
from difftest.run.runner import FAILING, Status, run_case

CATALOG = "mutants.catalog"
FALSE_POSITIVE_BACKENDS = ("triton-unified", "aiter-gluon@emulated")
SEED = 0


@dataclass(frozen=True)
class Limits:
    """How far each part of the benchmark goes."""

    examples: int = 100
    shrink_runs: int = 40
    baseline_cap: int = 200
    false_positive_cases: int = 2000
    false_positive_batch: int = 2
    false_positive_topk: int = 4
    aiter_batches: tuple[int, ...] = AITER_BATCH_SIZES
    seed: int = SEED


FULL = Limits()
QUICK = Limits(examples=20, shrink_runs=8, baseline_cap=24, false_positive_cases=100)
CPU_AITER_BATCHES = (3,)  # AITER's batch 81 costs 20-80 s per interpreted kernel run


def case_size(case: Case) -> dict[str, int]:
    """The size of a case: requests, query tokens per request, context tokens, cache blocks,
    block-table entries, selected lanes (not ``-1``) and the sum of the physical block ids."""
    return {"requests": case.batch, "query_tokens": case.decode_query_len,
            "context_tokens": sum(case.seq_lens), "blocks": case.num_blocks,
            "table_entries": sum(len(t) for t in case.block_tables),
            "selected": sum(b != -1 for row in case.selections for b in row),
            "block_id_sum": sum(b for t in case.block_tables for b in t)}


def describe_size(size: dict[str, int] | None) -> str:
    """``requests x query tokens, context tokens, blocks``, e.g. ``1x1 req 128 tok 128 blk``."""
    if size is None:
        return "-"
    return (f"{size['requests']}x{size['query_tokens']} req {size['context_tokens']} tok "
            f"{size['blocks']} blk")


@dataclass
class Outcome:
    """One mutant under one generator."""

    mutant: str
    generator: str
    harmful: bool
    killed: bool = False
    examples: int = 0
    seconds: float = 0.0
    status: str = ""
    case_id: str = ""
    size: dict[str, int] | None = None
    first_size: dict[str, int] | None = None
    shrink_runs: int = 0
    note: str = ""
    diagnosis: list[str] = field(default_factory=list)
    expected_diagnosis: str = ""
    diagnosed: bool = False

    def examples_or_inf(self) -> float:
        """Examples to the first kill; ``inf`` when not killed."""
        return float(self.examples) if self.killed else math.inf


# ----- workers --------------------------------------------------------------------------------
def _prepare_worker(device: str) -> None:
    devices.prepare_runtime(device)
    torch.set_num_threads(1)


def _catalog(module: str = CATALOG) -> dict[str, Any]:
    from difftest.contract.registry import load_plugin

    return {m.name: m for m in load_plugin(module) if hasattr(m, "mutation")}


def _reference() -> Any:
    from difftest.backends.torch_ref import TorchReference

    return TorchReference()


def supported_dtypes(backend: Any, device: torch.device) -> tuple[tuple[str, ...],
                                                                  tuple[str, ...]]:
    """The query and KV dtypes ``backend`` declares it runs on ``device``."""
    ok = [(q, kv) for q in QUERY_DTYPES for kv in KV_DTYPES
          if backend.unsupported_reason(_probe_case(q, kv), device) is None]
    queries = tuple(q for q in QUERY_DTYPES if any(q == a for a, _ in ok))
    kvs = tuple(kv for kv in KV_DTYPES if any(kv == b for _, b in ok))
    return queries, kvs


def _probe_case(query_dtype: str, kv_dtype: str) -> Case:
    return Case(num_blocks=1, seq_lens=(1,), block_tables=((0,),), selections=((0,),),
                query_dtype=query_dtype, kv_dtype=kv_dtype)


class _Killed(Exception):
    """Raised inside the Hypothesis run on a kill; carries the case."""

    def __init__(self, case: Case, status: str) -> None:
        super().__init__(f"{status} on case {case.case_id}")
        self.case = case
        self.status = status


def known_bugs_of(mutant: Any) -> list[Expectation]:
    """The known kernel bugs (``expectations.json``) of the backend ``mutant`` is a faulty
    version of, as bugs of the mutant too: a failure they explain wholly is the kernel's
    own, not a kill."""
    base = mutant.origin.name.partition("[")[0]
    return [dataclasses.replace(e, backends=(*e.backends, mutant.name))
            for e in load_expectations() if base in e.backends]


def hunt(mutant: Any, strategy: st.SearchStrategy[Case], device: torch.device,
         limits: Limits) -> Outcome:
    """Our strategies against one mutant: examples and seconds to the first kill, the first
    killing case's size and the shrunk one's.

    After the first kill Hypothesis shrinks; once ``limits.shrink_runs`` kernel runs are spent,
    new candidates pass without running, so the shrink ends with the smallest case found.
    """
    outcome = Outcome(mutant.name, "ours", mutant.mutation.harmful)
    reference = _reference()
    known = known_bugs_of(mutant)
    failing: dict[str, str] = {}
    start = time.perf_counter()

    @hypothesis_seed(limits.seed)
    @settings(max_examples=limits.examples, database=None, deadline=None, derandomize=False,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet)
    @given(strategy)
    def probe(case: Case) -> None:
        status = failing.get(case.case_id) or _judge(case)
        if status:  # one raise site: Hypothesis tells failures apart by where they are raised
            failing[case.case_id] = status
            raise _Killed(case, status)

    def _judge(case: Case) -> str | None:
        shrinking = outcome.killed
        if shrinking and outcome.shrink_runs >= limits.shrink_runs:
            return None
        if not mutant.mutation.reachable(case):
            outcome.examples += 0 if shrinking else 1
            return None
        result = run_case(case, reference, [mutant], device, known_bugs=known).results[0]
        if result.status in (Status.UNSUPPORTED, Status.UNAVAILABLE):
            return None
        if shrinking:
            outcome.shrink_runs += 1
        else:
            outcome.examples += 1
        if result.status not in FAILING or (
                result.known_bug is not None and not result.known_bug.new_failure):
            return None  # the wrapped kernel's own known bug, wholly: not the mutation's doing
        if not outcome.killed:
            outcome.killed, outcome.status = True, result.status.value
            outcome.seconds = time.perf_counter() - start
            outcome.first_size = case_size(case)
            record_diagnosis(outcome, result, mutant.mutation.diagnosis)
        return result.status.value

    try:
        probe()
    except _Killed as kill:
        outcome.case_id = kill.case.case_id
        outcome.size = case_size(kill.case)
    if not outcome.killed:
        outcome.seconds = time.perf_counter() - start
    return outcome


def record_diagnosis(outcome: Outcome, result: Any, expected: str) -> None:
    """Put the diagnosis of a killing ``result`` on ``outcome``, and whether its first line
    names ``expected``."""
    outcome.diagnosis = list(result.comparison.diagnosis) if result.comparison else []
    outcome.expected_diagnosis = expected
    first = hypothesis_of(outcome.diagnosis[0]) if outcome.diagnosis else None
    outcome.diagnosed = bool(expected) and first == expected


def walk(mutants: Sequence[Any], grid: Iterable[Case], generator: str, device: torch.device,
         cap: int) -> list[Outcome]:
    """A peers' grid against several mutants at once, in grid order, up to ``cap`` examples.

    Each grid case is generated, referenced and cached once for every mutant that can be
    killed on it. The peers do not shrink: the size is the killing case's.
    """
    outcomes = {m.name: Outcome(m.name, generator, m.mutation.harmful) for m in mutants}
    alive = {m.name: m for m in mutants}
    reference = _reference()
    for case in grid:
        runnable = []
        for name, mutant in list(alive.items()):
            outcome = outcomes[name]
            if outcome.examples >= cap:
                del alive[name]
                continue
            if mutant.unsupported_reason(case, device) is not None:
                continue
            outcome.examples += 1
            if mutant.mutation.reachable(case):
                runnable.append(mutant)
        if not alive:
            break
        if not runnable:
            continue
        result = run_case(case, reference, runnable, device)
        shared = result.timings["generate"] + result.timings["reference"]
        for mutant, r in zip(runnable, result.results, strict=True):
            outcome = outcomes[mutant.name]
            cache = sum(result.timings.get(f"cache:{o}", 0.0) for o in mutant.in_page_orders)
            outcome.seconds += shared + cache + r.seconds
            if r.status in FAILING:
                outcome.killed, outcome.status = True, r.status.value
                outcome.case_id, outcome.size = case.case_id, case_size(case)
                del alive[mutant.name]
    return list(outcomes.values())


def _hunt_task(name: str, device: str, limits: Limits) -> Outcome:
    from difftest.generation.capabilities import cases_for_backend

    mutant = _catalog()[name]
    dev = torch.device(device)
    availability = mutant.availability()
    if not availability.available:
        return Outcome(name, "ours", mutant.mutation.harmful, note=availability.reason)
    return hunt(mutant, cases_for_backend(mutant, dev), dev, limits)


def _walk_task(names: Sequence[str], generator: str, device: str,
               limits: Limits) -> list[Outcome]:
    catalog = _catalog()
    dev = torch.device(device)
    mutants = [catalog[n] for n in names if catalog[n].availability().available]
    outcomes: list[Outcome] = []
    by_query: dict[str, list[Any]] = {}
    for mutant in mutants:  # the peers' bf16 query where the backend runs it, else fp16
        queries, _ = supported_dtypes(mutant, dev)
        by_query.setdefault("bfloat16" if "bfloat16" in queries else "float16",
                            []).append(mutant)
    for query_dtype, group in by_query.items():
        options = {"batch_sizes": limits.aiter_batches} if generator == "aiter-grid" else {}
        grid = BASELINES[generator](query_dtype=query_dtype, **options)
        outcomes.extend(walk(group, grid, generator, dev, limits.baseline_cap))
    return outcomes


@dataclass
class StretchResult:
    """The correct backends on a stretch of generated cases."""

    cases: int = 0
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    false_positives: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    runs: list[dict[str, Any]] = field(default_factory=list)  # results with stated calls

    def merge(self, other: StretchResult) -> None:
        """Add another chunk's counts."""
        self.cases += other.cases
        self.runs.extend(other.runs)
        for backend, counts in other.statuses.items():
            mine = Counter(self.statuses.get(backend, {}))
            mine.update(counts)
            self.statuses[backend] = dict(mine)
        self.false_positives.extend(other.false_positives)
        self.seconds += other.seconds


def _stretch_task(chunk: Sequence[Case], names: Sequence[str], device: str) -> StretchResult:
    from difftest.contract.registry import discover, select

    dev = torch.device(device)
    backends = [b for b in select(discover(), names) if b.availability().available]
    reference = _reference()
    out = StretchResult()
    start = time.perf_counter()
    counts: dict[str, Counter[str]] = {b.name: Counter() for b in backends}
    for case in chunk:
        result = run_case(case, reference, backends, dev)
        out.cases += 1
        out.runs.append({"results": [r.record().to_dict() for r in result.results]})
        for r in result.results:
            counts[r.backend][r.status.value] += 1
            if r.status in FAILING:
                first = (r.comparison.message(case).splitlines()[1] if r.comparison
                         else r.detail.splitlines()[0])
                out.false_positives.append({"backend": r.backend, "case": case.to_json(),
                                            "status": r.status.value, "detail": first})
    out.statuses = {k: dict(v) for k, v in counts.items()}
    out.seconds = time.perf_counter() - start
    return out


def stretch_cases(device: torch.device, limits: Limits) -> list[Case]:
    """The derandomized false-positive stretch: small geometry, every supported dtype."""
    from difftest.contract.registry import discover, select
    from difftest.generation.generate import generated_cases
    from difftest.generation.strategies import cases

    queries: set[str] = set()
    kvs: set[str] = set()
    for backend in select(discover(), FALSE_POSITIVE_BACKENDS):
        q, kv = supported_dtypes(backend, device)
        queries.update(q)
        kvs.update(kv)
    return generated_cases(limits.false_positive_cases, limits.seed, cases,
                           query_dtypes=tuple(q for q in QUERY_DTYPES if q in queries),
                           kv_dtypes=tuple(k for k in KV_DTYPES if k in kvs),
                           max_batch=limits.false_positive_batch,
                           max_topk=limits.false_positive_topk)


# ----- the whole run --------------------------------------------------------------------------
def run_benchmark(device: str, limits: Limits, workers: int) -> dict[str, Any]:
    """Every part, spread over ``workers`` processes; returns the JSON-ready results."""
    devices.prepare_runtime(device)
    start = time.perf_counter()
    catalog = _catalog()
    harmful = [m.name for m in catalog.values() if m.mutation.harmful]
    stretch = stretch_cases(torch.device(device), limits)
    chunk = max(1, math.ceil(len(stretch) / (8 * workers)))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                initializer=_prepare_worker,
                                                initargs=(device,)) as pool:
        walks = [pool.submit(_walk_task, harmful, g, device, limits) for g in BASELINES]
        hunts = [pool.submit(_hunt_task, name, device, limits) for name in catalog]
        chunks = [pool.submit(_stretch_task, stretch[i : i + chunk], FALSE_POSITIVE_BACKENDS,
                              device) for i in range(0, len(stretch), chunk)]
        outcomes = [f.result() for f in hunts] + [o for f in walks for o in f.result()]
        fp = StretchResult()
        for f in chunks:
            fp.merge(f.result())
    return {
        "outcomes": [asdict(o) for o in outcomes],
        "blind_spots": blind_spot_list(fp.runs, FALSE_POSITIVE_BACKENDS),
        "mutants": list(catalog),
        "false_positive_stretch": {k: v for k, v in asdict(fp).items() if k != "runs"},
        "limits": asdict(limits),
        "wall_seconds": time.perf_counter() - start,
        "machine": machine(device, workers),
    }


def blind_spot_list(runs: Sequence[dict[str, Any]], names: Sequence[str]) -> list[str]:
    """``backend: argument`` for every kernel argument that took a single value over the
    stretch's ``runs`` though the backend's statements do not say it is fixed
    (:mod:`difftest.judgement.audit`)."""
    from difftest.judgement.audit import blind_spots

    return [f"{c.backend}: {c.argument}" for c in blind_spots(runs, names)]


def machine(device: str, workers: int) -> dict[str, Any]:
    """Where and with what the benchmark ran."""
    import hypothesis
    import triton

    from difftest.backends.vllm_imports import vllm_version

    return {"device": device, "nproc": os.cpu_count(), "workers": workers,
            "processor": platform.processor(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "vllm": vllm_version(),
            "hypothesis": hypothesis.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])}


def _cell(o: Outcome | None) -> str:
    if o is None:
        return "not run"
    if o.note:
        return f"unavailable: {o.note[:30]}"
    if not o.killed:
        return f"- ({o.examples})"
    return f"{o.examples:>3} {o.seconds:6.2f}s {describe_size(o.size)}"


def median_examples(outcomes: Iterable[Outcome]) -> tuple[float, float]:
    """Median examples to the first kill over harmful mutants: ``(median, lower bound)``, the
    first counting a survivor as infinite, the second as the examples it survived."""
    harmful = [o for o in outcomes if o.harmful]
    if not harmful:
        return math.nan, math.nan
    exact = statistics.median(o.examples_or_inf() for o in harmful)
    bound = statistics.median(float(o.examples) for o in harmful)
    return exact, bound


def format_report(data: dict[str, Any]) -> str:
    """The table, the medians and the false-positive line."""
    outcomes = [Outcome(**o) for o in data["outcomes"]]
    generators = ["ours", *BASELINES]
    by = {(o.mutant, o.generator): o for o in outcomes}
    width = max(len(m) for m in data["mutants"])
    header = f"{'mutant':<{width}}  " + "  ".join(f"{g:<38}" for g in generators)
    lines = ["cells: examples to the first kill, seconds, size of the (shrunk) killing case "
             "[requests x query tokens, context tokens, cache blocks]; '- (N)': not killed "
             "in N examples", header, "-" * len(header)]
    for name in data["mutants"]:
        cells = [f"{_cell(by.get((name, g))):<38}" for g in generators]
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    ours, _ = median_examples(o for o in outcomes if o.generator == "ours")
    lines.append("")
    lines.append(f"median examples to the first kill (harmful mutants): ours {ours:g}")
    for g in generators[1:]:
        exact, bound = median_examples(o for o in outcomes if o.generator == g)
        if math.isinf(exact):
            lines.append(f"  {g}: not killed at the median (>= {bound:g} examples); "
                         f"ratio >= {bound / ours:.1f}x")
        else:
            lines.append(f"  {g}: {exact:g}; ratio {exact / ours:.1f}x")
    harmless = [o for o in outcomes if not o.harmful]
    flagged = [o for o in harmless if o.killed]
    lines.append(f"harmless mutants flagged: {len(flagged)} of {len(harmless)} "
                 f"({', '.join(f'{o.mutant} under {o.generator}' for o in flagged) or 'none'})")
    fp = data["false_positive_stretch"]
    lines.append(f"{len(fp['false_positives'])} false positives in {fp['cases']} derandomized "
                 f"cases of the correct backends: " + "; ".join(
                     f"{b} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                     for b, c in sorted(fp["statuses"].items())))
    for item in fp["false_positives"][:5]:
        lines.append(f"  false positive: {item['backend']} {item['status']}: {item['detail']}")
    blind = data.get("blind_spots", [])
    lines.append(f"kernel arguments not fixed that took one value: {len(blind)}"
                 + (f" ({', '.join(blind)})" if blind else ""))
    lines.extend(format_diagnoses([o for o in outcomes if o.generator == "ours"], width))
    m = data["machine"]
    batches = ",".join(str(b) for b in data["limits"]["aiter_batches"])
    lines.append(f"aiter-grid batch sizes: {batches} (AITER's: 3,81)")
    lines.append(f"wall time {data['wall_seconds']:.0f} s on {m['device']} ({m['nproc']} cores, "
                 f"{m['workers']} workers, {m['processor'] or m['platform']}), {m['date']}")
    return "\n".join(lines)


def format_diagnoses(ours: Sequence[Outcome], width: int) -> list[str]:
    """Per harmful mutant: the hypothesis the diagnosis of its first kill names first, the
    expected one, and the count of those named correctly."""
    harmful = [o for o in ours if o.harmful]
    lines = ["", f"diagnosis of the first kill (ours): {sum(o.diagnosed for o in harmful)} of "
             f"{len(harmful)} harmful mutants named correctly",
             f"{'mutant':<{width}}  {'ok':<3}  {'expected':<28}  first diagnosis line"]
    for o in harmful:
        if not o.killed:
            first = "not killed"
        elif not o.diagnosis:
            first = f"({o.status}: no output to diagnose)"
        else:
            first = o.diagnosis[0]
        lines.append(f"{o.mutant:<{width}}  {'yes' if o.diagnosed else 'no':<3}  "
                     f"{o.expected_diagnosis or '-':<28}  {first[:160]}")
    return lines


@dataclass
class Diagnosed:
    """One caught disagreement of a mutant: the hypothesis its diagnosis names first."""

    mutant: str
    case_id: str
    expected: str
    named: str | None
    first_line: str
    family: str = "sparse"

    @property
    def correct(self) -> bool:
        """Whether the first line names the planted bug."""
        return self.named == self.expected


def _family_strategy(mutant: Any, device: torch.device,
                     family: str) -> Callable[..., st.SearchStrategy[Case]]:
    """What ``difftest run`` gives ``mutant``'s backend of one case family, as
    :func:`~difftest.generation.generate.generated_cases` takes it (a function of the
    example's cover): each example, or its nearest variant the backend runs."""
    from difftest.generation.capabilities import Capabilities

    capabilities = Capabilities.probe([mutant], device)
    if family == "sparse":
        return capabilities.fitted_strategy

    def dense(**options: Any) -> st.SearchStrategy[Case]:
        return capabilities.dense_strategy(**options).map(
            lambda case: capabilities.fit(case)[0].case)

    return dense


def _diagnosis_task(name: str, device: str, examples: int, kills: int, seed: int,
                    catalog: str, family: str) -> list[Diagnosed]:
    """Up to ``kills`` disagreements of mutant ``name`` over the first ``examples`` cases of
    ``family`` that ``difftest run`` would give its backend, each with its diagnosis's first
    hypothesis."""
    from difftest.generation.generate import generated_cases

    mutant = _catalog(catalog)[name]
    dev = torch.device(device)
    reference = _reference()
    found: list[Diagnosed] = []
    for case in generated_cases(examples, seed, _family_strategy(mutant, dev, family)):
        if len(found) >= kills:
            break
        if not mutant.mutation.reachable(case):
            continue
        result = run_case(case, reference, [mutant], dev).results[0]
        if result.status is not Status.DISAGREE or result.comparison is None:
            continue
        lines = result.comparison.diagnosis
        found.append(Diagnosed(name, case.case_id, mutant.mutation.diagnosis,
                               hypothesis_of(lines[0]) if lines else None,
                               lines[0] if lines else "", family))
    return found


def diagnosis_share(device: str, examples: int, kills: int, workers: int,
                    seed: int = SEED, catalog: str = CATALOG,
                    families: Sequence[str] = ("sparse",)) -> list[Diagnosed]:
    """The caught disagreements of every mutant of ``catalog`` that declares a diagnosis, in
    catalogue order, per case family (:func:`_diagnosis_task`, ``workers`` processes)."""
    devices.prepare_runtime(device)
    names = [n for n, m in _catalog(catalog).items() if m.mutation.diagnosis
             and m.availability().available]
    tasks = [(n, f) for n in names for f in families]
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_prepare_worker, initargs=(device,)) as pool:
        parts = pool.map(_diagnosis_task, [n for n, _ in tasks], [device] * len(tasks),
                         [examples] * len(tasks), [kills] * len(tasks), [seed] * len(tasks),
                         [catalog] * len(tasks), [f for _, f in tasks])
        return [d for part in parts for d in part]


def format_diagnosis_share(found: Sequence[Diagnosed]) -> str:
    """Per mutant (and family, where there are several): caught disagreements and how many
    the diagnosis names; the share."""
    several = len({d.family for d in found}) > 1
    by_mutant: dict[str, list[Diagnosed]] = {}
    for d in found:
        by_mutant.setdefault(f"{d.mutant} ({d.family})" if several else d.mutant, []).append(d)
    width = max([len(k) for k in by_mutant] + [6])
    lines = [f"{'mutant':<{width}}  caught  named  expected / first named (wrong ones)"]
    for name, items in by_mutant.items():
        wrong = sorted({str(d.named) for d in items if not d.correct})
        lines.append(f"{name:<{width}}  {len(items):>6}  {sum(d.correct for d in items):>5}  "
                     f"{items[0].expected}" + (f" / {', '.join(wrong)}" if wrong else ""))
    named = sum(d.correct for d in found)
    share = f"{100 * named / len(found):.0f}%" if found else "-"
    failed = sum(d.first_line.startswith(FAILED) for d in found)
    lines.append(f"diagnosis names the planted bug in {named} of {len(found)} caught "
                 f"disagreements ({share}); diagnosis failed on {failed}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table; exit 1 if a harmful mutant survives ours, the
    harmless one is flagged, the stretch has a false positive, or a kernel argument not
    documented as fixed took a single value on the stretch (:mod:`difftest.judgement.audit`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (about a minute)")
    parser.add_argument("--device", default="auto", choices=devices.DEVICE_CHOICES)
    parser.add_argument("--workers", type=int, default=None,
                        help="processes (default: CPU cores on the CPU, 1 on a GPU)")
    parser.add_argument("--aiter-batches", default=None,
                        help="batch sizes of the AITER grid, e.g. 3,81 (default: AITER's 3,81 "
                        "on a GPU, 3 on the CPU)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--diagnosis", type=int, default=0, metavar="KILLS",
                        help="only measure the diagnosis: up to KILLS caught disagreements "
                        "per mutant (over --examples cases each), and the share it names")
    parser.add_argument("--examples", type=int, default=40,
                        help="cases per mutant and family for --diagnosis (default 40)")
    parser.add_argument("--catalog", default=CATALOG,
                        help=f"the mutants' module for --diagnosis (default {CATALOG})")
    parser.add_argument("--families", default="sparse",
                        help="case families for --diagnosis: sparse, dense or sparse,dense "
                        "(default sparse)")
    args = parser.parse_args(argv)
    device = devices.resolve(args.device)
    workers = args.workers or ((os.cpu_count() or 1) if device == "cpu" else 1)
    if args.diagnosis:
        families = tuple(f for f in args.families.split(",") if f)
        unknown = sorted(set(families) - {"sparse", "dense"})
        if unknown or not families:
            parser.error(f"--families: {', '.join(unknown) or 'empty'}: allowed sparse, dense")
        found = diagnosis_share(device, args.examples, args.diagnosis, workers,
                                catalog=args.catalog, families=families)
        print(format_diagnosis_share(found))
        if args.json:
            write_json(args.json, {"device": device, "examples": args.examples,
                                   "kills": args.diagnosis, "catalog": args.catalog,
                                   "families": list(families),
                                   "diagnosed": [asdict(d) | {"correct": d.correct}
                                                 for d in found]})
        return 0
    batches = (tuple(int(b) for b in args.aiter_batches.split(",")) if args.aiter_batches
               else CPU_AITER_BATCHES if device == "cpu" else AITER_BATCH_SIZES)
    limits = dataclasses.replace(QUICK if args.quick else FULL, aiter_batches=batches)
    data = run_benchmark(device, limits, workers)
    print(format_report(data))
    if args.json:
        write_json(args.json, data)
    ours = [Outcome(**o) for o in data["outcomes"] if o["generator"] == "ours"]
    bad = [o for o in ours if o.killed != o.harmful]
    return 1 if bad or data["false_positive_stretch"]["false_positives"] or data[
        "blind_spots"] else 0


if __name__ == "__main__":
    sys.exit(main())
