"""Running one case through the reference and each backend, and judging each against it.

Data flows one way: case -> inputs (data, sparse table, caches) -> each backend -> comparison
-> a :class:`BackendResult` per backend, and :meth:`CaseResult.record` is the case's record
(:mod:`difftest.records`). The engine writes no files: the session (:mod:`difftest.session`)
puts the case on disk before it runs and stores the failures.

A :class:`Preparation` builds a case's host-side inputs (rows, segment tables, features) ahead,
in steps that :func:`run_case` takes while an earlier case's device work runs (``idle``):
nothing in it touches the device, so no kernel of a case starts before the session has put
the case on disk, and the inputs are the ones :class:`RunInputs` builds (the same bits).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from difftest.backend import Backend, ReferenceBackend, RunInputs
from difftest.case import Case
from difftest.compare import Comparison, compare
from difftest.coverage import case_features
from difftest.diagnosis import diagnosis_lines
from difftest.inputs import HostTables, generate, host_tables
from difftest.records import FAILING, CaseRecord, ResultRecord, Status
from difftest.sparse_table import page_table
from difftest.tolerance import Reference, Tolerance

__all__ = ["FAILING", "BackendResult", "CaseResult", "Preparation", "Status", "run_case"]


@dataclass
class BackendResult:
    """What one backend did on one case."""

    backend: str
    status: Status
    seconds: float = 0.0
    detail: str = ""
    comparison: Comparison | None = None
    versions: dict[str, str] = field(default_factory=dict)

    def record(self, output_sha256: str | None = None) -> ResultRecord:
        """This result as recorded, with the digest of the backend's output."""
        return ResultRecord(self.backend, self.status, self.seconds, self.detail,
                            dict(self.versions), self.comparison, output_sha256)


@dataclass
class CaseResult:
    """All backends' results on one case, with where the time went."""

    case: Case
    reference: str
    results: list[BackendResult]
    timings: dict[str, float]
    artifact: str | None = None

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


class Preparation:
    """The host-side inputs of one case, built step by step ahead of its run.

    Steps: the case id, the rows (:attr:`RunInputs.rows`), the segment tables
    (:func:`difftest.inputs.host_tables`), the page table on the host
    (:func:`difftest.sparse_table.page_table`) and the case's features. No step touches the
    device. A step that raises stops the preparation and is forgotten: the run builds that
    part again and reports its error where a run without preparation would.
    """

    def __init__(self, case: Case, device: torch.device) -> None:
        self.case = case
        self.inputs = RunInputs(case, device)
        self.tables: HostTables | None = None
        self.page_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.features: dict[str, Any] | None = None
        self._steps: Iterator[Callable[[], object]] = iter((
            lambda: case.case_id, lambda: self.inputs.rows, self._tables, self._page_table,
            self._features))

    def _tables(self) -> None:
        self.tables = host_tables(self.case, self.inputs.rows)

    def _page_table(self) -> None:
        self.page_table = page_table(self.case, self.inputs.rows)

    def _features(self) -> None:
        self.features = case_features(self.case, self.inputs.rows)

    def step(self) -> bool:
        """Take the next step; ``False`` once none is left."""
        work = next(self._steps, None)
        if work is None:
            return False
        try:
            work()
        except Exception:  # the run redoes it and reports it in its own stage
            self._steps = iter(())
            return False
        return True

    def finish(self) -> None:
        """Take every remaining step."""
        while self.step():
            pass


def _wait(device: torch.device, idle: Callable[[], bool] | None) -> float:
    """Synchronise with ``device``; until its queued work is done, take ``idle`` steps (one
    step on the CPU, where nothing runs asynchronously). The seconds the steps took."""
    if idle is None:
        _sync(device)
        return 0.0
    begun = time.perf_counter()
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        while not done.query() and idle():
            pass
        spent = time.perf_counter() - begun
        _sync(device)
        return spent
    idle()
    return time.perf_counter() - begun


def run_case(
    case: Case,
    reference: ReferenceBackend,
    backends: list[Backend],
    device: torch.device,
    prepared: Preparation | None = None,
    idle: Callable[[], bool] | None = None,
) -> CaseResult:
    """Run ``case`` through ``reference`` and ``backends`` and judge each backend.

    ``prepared``: the case's :class:`Preparation` (finished here if it is not). ``idle``:
    called, a step at a time, while the device finishes each stage's work, and after the
    last stage until it returns ``False`` (it prepares the next case); the seconds it took
    go to ``timings["prefetch"]``, not to the stages.
    """
    timings: dict[str, float] = {}
    if prepared is not None:
        prepared.finish()
    inputs = prepared.inputs if prepared is not None else RunInputs(case, device)

    def waited(stage: str, start: float) -> None:
        aside = _wait(device, idle)
        if idle is not None:
            timings["prefetch"] = timings.get("prefetch", 0.0) + aside
        timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start - aside

    try:
        start = time.perf_counter()
        if prepared is not None and prepared.tables is not None:
            inputs.data = generate(case, inputs.rows, device, prepared.tables)
        if prepared is not None and prepared.page_table is not None:  # as RunInputs moves it
            table, ctx = prepared.page_table
            inputs.sparse_table = table.to(device), ctx.to(device)
        _ = inputs.data, inputs.rows, inputs.sparse_table
        waited("generate", start)
        start = time.perf_counter()
        truth = reference.reference(inputs)
        waited("reference", start)
    except Exception:  # a framework failure is every backend's error, never a lost case
        detail = f"the reference {reference.name!r} could not be computed:\n{_traceback()}"
        results = [BackendResult(b.name, Status.ERROR, detail=detail) for b in backends]
    else:
        results = [_run_backend(backend, inputs, truth, timings, waited)
                   for backend in backends]
    if idle is not None:  # what the device waits left of the next case's preparation
        start = time.perf_counter()
        while idle():
            pass
        timings["prefetch"] = timings.get("prefetch", 0.0) + time.perf_counter() - start
    return CaseResult(case, reference.name, results, timings)


def _run_backend(backend: Backend, inputs: RunInputs, truth: Reference,
                 timings: dict[str, float], waited: Callable[[str, float], None]
                 ) -> BackendResult:
    case, device = inputs.case, inputs.device
    availability = backend.availability()
    if not availability.available:
        return BackendResult(backend.name, Status.UNAVAILABLE, detail=availability.reason)
    try:
        reason = backend.unsupported_reason(case, device)
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
            waited(f"cache:{order}", built)
    except Exception:
        return BackendResult(backend.name, Status.ERROR,
                             detail=f"building its cache failed:\n{_traceback()}",
                             versions=versions)
    start = time.perf_counter()
    try:
        actual = backend.run(inputs)
        waited(backend.name, start)
    except Exception:  # every failure of a backend is a result, not a crash of the run
        seconds = time.perf_counter() - start
        timings[backend.name] = seconds
        return BackendResult(backend.name, Status.ERROR, seconds, _traceback(),
                             versions=versions)
    seconds = timings[backend.name]
    start = time.perf_counter()
    try:
        tolerance = Tolerance(backend.precision(case, device))
        empty_rows = backend.empty_row_output(case)
        comparison = compare(backend.name, actual, truth, tolerance, empty_rows, case,
                             inputs.rows)
    except Exception:  # an output that cannot be compared (wrong shape, not a tensor)
        return BackendResult(backend.name, Status.ERROR, seconds,
                             f"its output could not be compared:\n{_traceback()}",
                             versions=versions)
    else:
        if not comparison.agrees:  # what the worst rows read instead; never raises
            comparison = dataclasses.replace(comparison, diagnosis=diagnosis_lines(
                inputs, actual, truth, tuple(loc.row for loc in comparison.worst), tolerance,
                empty_rows))
    finally:
        timings["compare"] = timings.get("compare", 0.0) + time.perf_counter() - start
    status = Status.AGREE if comparison.agrees else Status.DISAGREE
    return BackendResult(backend.name, status, seconds, comparison=comparison, versions=versions)
