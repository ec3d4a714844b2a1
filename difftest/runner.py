"""Running one case through the reference and each backend, and judging each against it.

Data flows one way: case -> inputs (data, sparse table, caches) -> each backend -> comparison
-> a :class:`BackendResult` per backend. The case is on disk (:mod:`difftest.artifacts`)
before any kernel starts, so a crash that kills the process loses nothing.
"""

from __future__ import annotations

import enum
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from difftest.artifacts import ArtifactStore
from difftest.backend import Backend, ReferenceBackend, RunInputs
from difftest.case import Case
from difftest.compare import Comparison, compare
from difftest.coverage import case_features
from difftest.tolerance import Tolerance


class Status(enum.Enum):
    """The verdict of one backend on one case."""

    AGREE = "agree"
    DISAGREE = "disagree"
    ERROR = "error"
    CRASH = "crash"
    UNSUPPORTED = "unsupported"
    UNAVAILABLE = "unavailable"


FAILING = frozenset({Status.DISAGREE, Status.ERROR, Status.CRASH})


@dataclass
class BackendResult:
    """What one backend did on one case."""

    backend: str
    status: Status
    seconds: float = 0.0
    detail: str = ""
    comparison: Comparison | None = None
    versions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "backend": self.backend,
            "status": self.status.value,
            "seconds": self.seconds,
            "detail": self.detail,
            "versions": self.versions,
            "comparison": self.comparison.to_dict() if self.comparison else None,
        }


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "case_id": self.case.case_id,
            "name": self.case.name,
            "case": self.case.to_dict(),
            "features": case_features(self.case),
            "reference": self.reference,
            "results": [r.to_dict() for r in self.results],
            "timings": self.timings,
            "artifact": self.artifact,
        }


def _traceback() -> str:
    """The exception being handled: its one-line form, then the innermost frames."""
    exc = sys.exc_info()[1]
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return f"{detail}\n{traceback.format_exc(limit=-6)}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(
    case: Case,
    reference: ReferenceBackend,
    backends: list[Backend],
    device: torch.device,
    store: ArtifactStore | None = None,
) -> CaseResult:
    """Run ``case`` through ``reference`` and ``backends`` and judge each backend."""
    if store is not None:
        store.begin(case, [reference.name] + [b.name for b in backends])
    timings: dict[str, float] = {}
    inputs = RunInputs(case, device)
    try:
        start = time.perf_counter()
        _ = inputs.data, inputs.rows, inputs.sparse_table
        _sync(device)
        timings["generate"] = time.perf_counter() - start
        start = time.perf_counter()
        truth = reference.reference(inputs)
        _sync(device)
        timings["reference"] = time.perf_counter() - start
    except Exception:  # a framework failure is every backend's error, never a lost case
        detail = f"the reference {reference.name!r} could not be computed:\n{_traceback()}"
        results = [BackendResult(b.name, Status.ERROR, detail=detail) for b in backends]
    else:
        results = [_run_backend(backend, inputs, truth, timings) for backend in backends]
    result = CaseResult(case, reference.name, results, timings)
    if store is not None:
        result.artifact = store.finish(result)
    return result


def _run_backend(backend: Backend, inputs: RunInputs, truth: Any,
                 timings: dict[str, float]) -> BackendResult:
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
            _sync(device)
            timings[f"cache:{order}"] = timings.get(f"cache:{order}", 0.0) + (
                time.perf_counter() - built)
    except Exception:
        return BackendResult(backend.name, Status.ERROR,
                             detail=f"building its cache failed:\n{_traceback()}",
                             versions=versions)
    start = time.perf_counter()
    try:
        actual = backend.run(inputs)
        _sync(device)
    except Exception:  # every failure of a backend is a result, not a crash of the run
        seconds = time.perf_counter() - start
        timings[backend.name] = seconds
        return BackendResult(backend.name, Status.ERROR, seconds, _traceback(),
                             versions=versions)
    seconds = time.perf_counter() - start
    timings[backend.name] = seconds
    start = time.perf_counter()
    try:
        comparison = compare(backend.name, actual, truth,
                             Tolerance(backend.precision(case, device)),
                             backend.empty_row_output(case), case, inputs.rows)
    except Exception:  # an output that cannot be compared (wrong shape, not a tensor)
        return BackendResult(backend.name, Status.ERROR, seconds,
                             f"its output could not be compared:\n{_traceback()}",
                             versions=versions)
    finally:
        timings["compare"] = timings.get("compare", 0.0) + time.perf_counter() - start
    status = Status.AGREE if comparison.agrees else Status.DISAGREE
    return BackendResult(backend.name, status, seconds, comparison=comparison, versions=versions)
