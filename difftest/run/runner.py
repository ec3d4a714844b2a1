"""Running one case through the reference and each backend, and judging each against it.

Data flows one way: case -> inputs (data, sparse table, caches) -> each backend -> comparison
-> a :class:`BackendResult` per backend, and :meth:`CaseResult.record` is the case's record
(:mod:`difftest.results.records`). The engine writes no files: the session
(:mod:`difftest.run.session`) puts the case on disk before it runs and stores the failures.

Whoever runs a case observes it through :class:`RunHooks` (the session notes on disk which
backend runs, and keeps each output's digest; a benchmark times each call): the backends
are called as they are, never through a wrapper.

Inputs are read-only to backends (:mod:`difftest.run.read_only`): a backend that wrote into
what it was given gets the error ``wrote into its inputs``, and the inputs are rebuilt for
the backends after it. A failing result is judged against the known kernel bugs
(:func:`difftest.judgement.expectations.explain`, from where its output was wrong) and the
verdict kept in the result (``known_bug``).

A :class:`Preparation` builds a case's host-side inputs (segment tables, page table, features)
ahead, in a worker process (:func:`prepare_host`) while earlier cases run; the rows are built
only if something reads them (:class:`LazyRows`). Nothing in it touches the device, so no
kernel of a case starts before the session has put the case on disk, and the inputs are the
ones :class:`RunInputs` builds (the same bits, ``tests/test_pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch

from difftest.case.layouts import IN_PAGE_ORDERS
from difftest.case.selection import SparseRow, build_rows, page_table
from difftest.case.spec import Case
from difftest.contract.backend import Backend, ReferenceBackend, RunInputs
from difftest.contract.compare import Comparison, WrongElements, compare_elements
from difftest.contract.kernel_call import KernelCall
from difftest.contract.tolerance import Reference, Tolerance
from difftest.inputs.case_data import HostTables, generate, host_tables
from difftest.inputs.kv_cache import CachePool
from difftest.judgement.diagnosis import Rerun, diagnosis_lines
from difftest.judgement.expectations import Expectation, explain
from difftest.machine.devices import to_device
from difftest.results.features import case_features
from difftest.results.records import FAILING, CaseRecord, KnownBug, ResultRecord, Status
from difftest.run.footprint import refusal
from difftest.run.read_only import InputDigests

WROTE_INPUTS = "wrote into its inputs"

__all__ = ["FAILING", "BackendResult", "CaseResult", "LazyRows", "Preparation", "PreparedHost",
           "RunHooks", "Status", "prepare_host", "run_case"]


class RunHooks:
    """Observers of a case's run; the defaults observe nothing.

    :meth:`calling` wraps each call of the reference (``stage`` ``"reference"``) and of each
    backend (``stage`` its name); :meth:`produced` receives each backend's output tensor.
    """

    def calling(self, case: Case, backend: str, stage: str) -> AbstractContextManager[None]:
        """A context around ``backend``'s call on ``case``."""
        return nullcontext()

    def produced(self, case: Case, backend: str, output: torch.Tensor) -> None:
        """``backend`` returned ``output`` on ``case``."""


@dataclass
class BackendResult:
    """What one backend did on one case."""

    backend: str
    status: Status
    seconds: float = 0.0
    detail: str = ""
    comparison: Comparison | None = None
    versions: dict[str, str] = field(default_factory=dict)
    calls: list[KernelCall] = field(default_factory=list)
    known_bug: KnownBug | None = None

    def record(self, output_sha256: str | None = None) -> ResultRecord:
        """This result as recorded, with the digest of the backend's output."""
        return ResultRecord(self.backend, self.status, self.seconds, self.detail,
                            dict(self.versions), self.comparison, output_sha256,
                            list(self.calls), self.known_bug)


@dataclass
class CaseResult:
    """All backends' results on one case, with where the time went."""

    case: Case
    reference: str
    results: list[BackendResult]
    timings: dict[str, float]
    artifact: str | None = None
    # the case's rows as generation built them (None when generation failed), for features
    rows: Sequence[SparseRow] | None = field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        """Whether any backend disagreed, errored or crashed."""
        return any(r.status in FAILING for r in self.results)

    def failure_messages(self) -> list[str]:
        """One message per failing backend."""
        messages = []
        for r in self.results:
            if r.status is Status.DISAGREE and r.comparison is not None:
                messages.append(r.comparison.message(self.case, self.reference))
            elif r.status in FAILING:
                messages.append(f"{r.backend} {r.status.value} on case {self.case.case_id}:\n"
                                f"{r.detail}")
            else:
                continue
            if r.known_bug is not None:
                messages[-1] += f"\n  {r.known_bug.describe()}"
        return messages

    def record(self, outputs: dict[str, str] | None = None, *,
               case: dict[str, Any] | None = None,
               features: dict[str, Any] | None = None) -> CaseRecord:
        """The case's record, with ``outputs`` (backend -> sha256 of its output);
        ``case``/``features``: the case's dict and features if the caller has them."""
        return CaseRecord(
            case_id=self.case.case_id, name=self.case.name,
            case=case if case is not None else self.case.to_dict(),
            features=features if features is not None else case_features(self.case),
            reference=self.reference,
            results=[r.record((outputs or {}).get(r.backend)) for r in self.results],
            timings=dict(self.timings), artifact=self.artifact)


def _traceback() -> str:
    """The exception being handled: its one-line form, then the innermost frames."""
    exc = sys.exc_info()[1]
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return f"{detail}\n{traceback.format_exc(limit=-6)}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class PreparedHost:
    """What :func:`prepare_host` builds: generation's host tables, the page table on the host
    (``[total_q, topk*8]`` and ``[total_q]``, int32) and the case's features."""

    tables: HostTables
    page_table: tuple[np.ndarray, np.ndarray]
    features: dict[str, Any]


def prepare_host(case: Case) -> PreparedHost:
    """The host-side inputs of ``case`` from its rows (run in a worker process)."""
    rows = build_rows(case)
    table, ctx = page_table(case, rows)
    return PreparedHost(host_tables(case, rows), (table.numpy(), ctx.numpy()),
                        case_features(case, rows))


class LazyRows(Sequence[SparseRow]):
    """``build_rows(case)``, built on first read (a comparison's worst locations, a
    diagnosis): a prepared case that agrees never needs its rows in this process."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self._rows: tuple[SparseRow, ...] | None = None

    def _built(self) -> tuple[SparseRow, ...]:
        if self._rows is None:
            self._rows = build_rows(self.case)
        return self._rows

    @overload
    def __getitem__(self, index: int) -> SparseRow: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[SparseRow, ...]: ...
    def __getitem__(self, index: int | slice) -> SparseRow | tuple[SparseRow, ...]:
        return self._built()[index]

    def __len__(self) -> int:
        return self.case.total_q

    def __iter__(self) -> Iterator[SparseRow]:
        return iter(self._built())


class Preparation:
    """A case whose host-side inputs a worker builds ahead (:func:`prepare_host`).

    :meth:`host` waits for them; ``None`` when the worker failed, or when it has not
    finished them and the caller will not wait (a worker still starting): the run then
    builds them itself and reports any error where a run without preparation would.
    """

    def __init__(self, case: Case, pool: Executor) -> None:
        self.case = case
        try:
            self._future: Future[PreparedHost] | None = pool.submit(prepare_host, case)
        except Exception:  # a broken or shut-down pool: the run builds everything itself
            self._future = None

    def host(self, wait: bool = True) -> PreparedHost | None:
        """The prepared inputs (waiting for the worker where ``wait``), or ``None``."""
        if self._future is None or not (wait or self._future.done()):
            return None
        try:
            return self._future.result()
        except Exception:  # the run redoes it and reports it in its own stage
            return None


def prepared_inputs(case: Case, device: torch.device, host: PreparedHost,
                    caches: CachePool | None = None) -> RunInputs:
    """:class:`RunInputs` whose data, page table and rows come from ``host``: the data is
    generated here (the device work), the page table moved as :class:`RunInputs` moves it,
    the rows lazy; ``caches``: the pool its caches are built in."""
    inputs = RunInputs(case, device, pool=caches)
    inputs.rows = LazyRows(case)  # type: ignore[misc, assignment]
    inputs.data = generate(case, inputs.rows, device, host.tables)  # type: ignore[misc]
    table, ctx = host.page_table
    inputs.sparse_table = (  # type: ignore[misc]
        to_device(torch.from_numpy(table), device), to_device(torch.from_numpy(ctx), device))
    return inputs


def case_inputs(case: Case, device: torch.device, prepared: PreparedHost | None,
                caches: CachePool | None = None) -> RunInputs:
    """The case's inputs with its data, rows and page table made now (the runner's
    ``generate`` stage): from ``prepared`` when a worker built the host side ahead
    (:func:`prepared_inputs`), else all of it here."""
    if prepared is not None:
        inputs = prepared_inputs(case, device, prepared, caches)
    else:
        inputs = RunInputs(case, device, pool=caches)
    _ = inputs.data, inputs.rows, inputs.sparse_table
    return inputs


def run_case(
    case: Case,
    reference: ReferenceBackend,
    backends: list[Backend],
    device: torch.device,
    prepared: PreparedHost | None = None,
    diagnose: bool | Callable[[Case, BackendResult], bool] = True,
    caches: CachePool | None = None,
    hooks: Sequence[RunHooks] = (),
    known_bugs: Sequence[Expectation] = (),
) -> CaseResult:
    """Run ``case`` through ``reference`` and ``backends`` and judge each backend;
    ``prepared``: its host-side inputs, built ahead (:func:`prepare_host`); ``diagnose``:
    whether a disagreement gets its :mod:`difftest.judgement.diagnosis` (what the worst rows read
    instead; a benchmark that only counts verdicts can skip its cost), or a predicate of the
    case and the disagreeing result (a session skips known kernel bugs); ``caches``: a pool the
    session keeps across cases, so that each cache is restored and rewritten where cases
    differ instead of filled whole (the same bytes); it is cleared after a case in which a
    backend failed, in case the backend wrote into its input cache; ``hooks``: observers of
    each call (:class:`RunHooks`), whose contexts are entered outside the backends' guard (a
    hook that cannot note a call, e.g. on a full disk, stops the run: it is no backend's
    error); ``known_bugs``: the expectations each failing result is judged against (a
    disagreement a known bug explains wholly is not diagnosed)."""
    timings: dict[str, float] = {}
    rows: Sequence[SparseRow] | None = None
    # a case this device cannot hold is refused before anything is allocated
    refused = refusal(case, device, _orders_built(case, backends, device), reference,
                      caches.held_bytes() if caches is not None else 0)
    if refused is not None:
        return CaseResult(case, reference.name,
                          [BackendResult(b.name, Status.UNSUPPORTED, detail=refused)
                           for b in backends], timings)
    try:
        start = time.perf_counter()
        inputs = case_inputs(case, device, prepared, caches)
        rows = inputs.rows
        _sync(device)
        timings["generate"] = time.perf_counter() - start
        start = time.perf_counter()
    except Exception:  # a framework failure is every backend's error, never a lost case
        return _every_error(case, reference.name, backends, timings, "generating its inputs")
    with _calling(hooks, case, reference.name, "reference"):
        try:
            truth = reference.reference(inputs)
            _sync(device)
            # its own context lengths: a backend writing into the inputs cannot change them
            truth = dataclasses.replace(truth, context_lens=truth.context_lens.clone())
            digests = InputDigests(inputs)
        except Exception:
            return _every_error(case, reference.name, backends, timings,
                                f"the reference {reference.name!r} could not be computed")
    timings["reference"] = time.perf_counter() - start
    results = []
    for backend in backends:
        result = _run_backend(backend, inputs, truth, timings, diagnose, hooks, known_bugs,
                              digests)
        changed = digests.changed()
        if changed:  # judged an error; the backends after it get inputs built afresh
            result = BackendResult(
                backend.name, Status.ERROR, result.seconds,
                f"{WROTE_INPUTS}: {', '.join(changed)} changed while it ran (inputs are "
                "read-only to backends; the backends after it ran on inputs built afresh)",
                versions=result.versions, calls=result.calls)
            if caches is not None:
                caches.clear()
            inputs = case_inputs(case, device, None, caches)  # nothing shared with it
            digests = InputDigests(inputs)
        results.append(result)
    if caches is not None and any(r.status in FAILING for r in results):
        caches.clear()
    return CaseResult(case, reference.name, results, timings, rows=rows)


def _every_error(case: Case, reference: str, backends: Sequence[Backend],
                 timings: dict[str, float], stage: str) -> CaseResult:
    """The case's result when the framework failed in ``stage``: every backend's error (the
    exception being handled), never a lost case."""
    detail = f"{stage}:\n{_traceback()}"
    return CaseResult(case, reference, [BackendResult(b.name, Status.ERROR, detail=detail)
                                        for b in backends], timings)


def _calling(hooks: Sequence[RunHooks], case: Case, backend: str, stage: str) -> ExitStack:
    """Every hook's :meth:`RunHooks.calling` context, entered in order."""
    stack = ExitStack()
    for hook in hooks:
        stack.enter_context(hook.calling(case, backend, stage))
    return stack


def _pages_missing(case: Case, backend: Backend) -> str | None:
    """Why ``backend`` cannot read ``case``'s cache: an in-page order it reads that the case's
    layout does not have (vLLM's split cache has no shuffled pages), else ``None``. An order
    no layout has is the backend's own error, left to the cache build to report."""
    for order in backend.in_page_orders:
        if order in IN_PAGE_ORDERS and order not in case.layout.in_page_orders:
            return (f"it reads {order} pages, and layout {case.kv_layout} has none (its "
                    f"in-page orders: {', '.join(case.layout.in_page_orders)})")
    return None


def _orders_built(case: Case, backends: Sequence[Backend], device: torch.device) -> set[str]:
    """The in-page orders whose caches this case will build: those of the backends that run
    it (a support check that raises counts its backend in, as building may still follow)."""
    orders = set()
    for backend in backends:
        try:
            runs = (backend.availability().available and _pages_missing(case, backend) is None
                    and backend.unsupported_reason(case, device) is None)
        except Exception:
            runs = True
        if runs:
            orders.update(backend.in_page_orders)
    return orders


def _run_backend(backend: Backend, inputs: RunInputs, truth: Reference,
                 timings: dict[str, float],
                 diagnose: bool | Callable[[Case, BackendResult], bool],
                 hooks: Sequence[RunHooks], known_bugs: Sequence[Expectation],
                 digests: InputDigests) -> BackendResult:
    case, device = inputs.case, inputs.device
    availability = backend.availability()
    if not availability.available:
        return BackendResult(backend.name, Status.UNAVAILABLE, detail=availability.reason)
    try:
        reason = _pages_missing(case, backend) or backend.unsupported_reason(case, device)
    except Exception:
        return BackendResult(backend.name, Status.ERROR,
                             detail=f"deciding whether it supports the case failed:\n"
                                    f"{_traceback()}")
    if reason is not None:
        return BackendResult(backend.name, Status.UNSUPPORTED, detail=reason)
    versions = backend.versions()
    try:
        for order in backend.in_page_orders:
            built = time.perf_counter()
            inputs.cache(order)
            _sync(device)
            timings[f"cache:{order}"] = timings.get(f"cache:{order}", 0.0) + (
                time.perf_counter() - built)
    except Exception:
        return BackendResult(backend.name, Status.ERROR,
                             detail=f"building its cache failed:\n{_traceback()}",
                             versions=versions)
    digests.take()  # the caches built for it
    inputs.calls = calls = []
    with _calling(hooks, case, backend.name, backend.name):
        start = time.perf_counter()
        try:
            actual = backend.run(inputs)
            _sync(device)
        except Exception:  # every failure of a backend is a result, not a crash of the run
            seconds = time.perf_counter() - start
            timings[backend.name] = seconds
            failed = BackendResult(backend.name, Status.ERROR, seconds, _traceback(),
                                   versions=versions, calls=calls)
            failed.known_bug = _known_bug(known_bugs, inputs, failed, None)
            return failed
    if isinstance(actual, torch.Tensor):
        for hook in hooks:
            hook.produced(case, backend.name, actual)
    seconds = time.perf_counter() - start
    timings[backend.name] = seconds
    start = time.perf_counter()
    known: KnownBug | None = None
    try:
        tolerance = Tolerance.of(backend.precision(case, device), case)
        empty_rows = backend.empty_row_output(case)
        comparison, wrong = compare_elements(backend.name, actual, truth, tolerance, empty_rows,
                                             case, inputs.rows)
    except Exception:  # an output that cannot be compared (wrong shape, not a tensor)
        return BackendResult(backend.name, Status.ERROR, seconds,
                             f"its output could not be compared:\n{_traceback()}",
                             versions=versions, calls=calls)
    else:
        disagrees = BackendResult(backend.name, Status.DISAGREE, seconds, comparison=comparison,
                                  versions=versions)
        if not comparison.agrees:
            known = _known_bug(known_bugs, inputs, disagrees, wrong)
            disagrees.known_bug = known
        if not comparison.agrees and (known is None or known.new_failure) and (
                diagnose(case, disagrees) if callable(diagnose) else diagnose):
            # what the worst rows read; never raises
            comparison = dataclasses.replace(comparison, diagnosis=diagnosis_lines(
                inputs, actual, truth, tuple(loc.row for loc in comparison.worst), tolerance,
                empty_rows, Rerun(backend.run, tuple(backend.in_page_orders))))
    finally:
        timings["compare"] = timings.get("compare", 0.0) + time.perf_counter() - start
    status = Status.AGREE if comparison.agrees else Status.DISAGREE
    return BackendResult(backend.name, status, seconds, disagrees.detail, comparison,
                         versions, calls, known)


def _known_bug(known_bugs: Sequence[Expectation], inputs: RunInputs, result: BackendResult,
               wrong: WrongElements | None) -> KnownBug | None:
    """:func:`explain` of a failing result; a model that cannot judge the case leaves it a
    new failure, with the reason in the result's detail."""
    try:
        return explain(known_bugs, inputs, result.record(), wrong)
    except Exception:
        result.detail = f"judging it against the known bugs failed:\n{_traceback()}"
        return None
