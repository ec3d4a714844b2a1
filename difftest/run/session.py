"""A configured run: device, reference, backends under test and the artifact store.

Shared by the CLI and the pytest plugin so both resolve devices, plug-ins and backends the
same way, and both produce the same records (:class:`difftest.results.records.CaseRecord`). The
session owns the artifact store: it puts each case on disk before the engine
(:func:`difftest.run.runner.run_case`, which writes no files) runs it, learns through the
engine's hooks which backend runs and what each returned, and stores its failures.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from difftest.case.spec import Case
from difftest.contract import registry
from difftest.contract.backend import (
    REFERENCE_METHODS,
    Backend,
    ReferenceBackend,
    serves_as_reference,
)
from difftest.inputs.kv_cache import CachePool
from difftest.judgement import expectations as known_bugs
from difftest.judgement.expectations import Expectation
from difftest.machine import devices
from difftest.machine.fingerprint import fingerprint
from difftest.machine.kernel_compiles import KernelCompiles
from difftest.reporting.report import backend_entry
from difftest.results.artifacts import DEFAULT_ROOT, ArtifactStore
from difftest.results.features import case_features
from difftest.results.records import CaseRecord
from difftest.run.runner import CaseResult, Preparation, RunHooks, run_case

DEFAULT_REFERENCE = "torch-ref"


class StoreHooks(RunHooks):
    """The artifact store's view of a run: it learns which backend starts (so a crash is
    attributed to the backend that caused it) and each output's digest (so a replay can be
    checked bit for bit)."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store

    def calling(self, case: Case, backend: str, stage: str) -> AbstractContextManager[None]:
        """Note on disk that ``backend`` runs ``case``."""
        self.store.running(case, backend)
        return nullcontext()

    def produced(self, case: Case, backend: str, output: torch.Tensor) -> None:
        """Keep the digest of ``output``."""
        self.store.record_output(case, backend, output)


class CompileHooks(RunHooks):
    """Kernel compilations counted in the stage that launched them: the reference's or a
    backend's call, else the framework's (:mod:`difftest.machine.kernel_compiles`)."""

    def __init__(self, compiles: KernelCompiles) -> None:
        self.compiles = compiles

    def calling(self, case: Case, backend: str, stage: str) -> AbstractContextManager[None]:
        """Count what ``backend``'s call compiles as its own."""
        return self.compiles.stage(backend)


@dataclass
class Session:
    """Everything needed to run cases; collects their results and records."""

    device: torch.device
    reference: ReferenceBackend
    backends: list[Backend]
    store: ArtifactStore
    plugins: tuple[str, ...] = ()
    results: list[CaseResult] = field(default_factory=list)
    records: list[CaseRecord] = field(default_factory=list)
    # observers of every case besides the store's (a benchmark's timers)
    hooks: list[RunHooks] = field(default_factory=list, repr=False, compare=False)
    _pool: ProcessPoolExecutor | None = field(default=None, repr=False, compare=False)
    # done once the preparation worker runs (until then no case waits for it)
    _pool_started: Future[int] | None = field(default=None, repr=False, compare=False)
    # the cache buffers reused from case to case (difftest.inputs.kv_cache.CachePool)
    caches: CachePool = field(default_factory=CachePool, repr=False, compare=False)
    # the known kernel bugs (difftest.judgement.expectations) each failing result is judged
    # against (a disagreement they explain wholly is not diagnosed)
    expectations: list[Expectation] = field(default_factory=lambda: known_bugs.load(), repr=False,
                                            compare=False)
    # the Triton specializations compiled (or, interpreted, that a GPU would compile) by stage
    compiles: KernelCompiles = field(default_factory=KernelCompiles, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        backend_names: Iterable[str] | None = None,
        plugins: Iterable[str] = (),
        device: str = "auto",
        artifacts: str = DEFAULT_ROOT,
        reference: str = DEFAULT_REFERENCE,
    ) -> Session:
        """Resolve the device (preparing the CPU runtime first), then find the backends."""
        plugins = tuple(plugins)
        resolved = devices.resolve(device)
        devices.prepare_runtime(resolved)
        known = registry.discover(plugins)
        ref = registry.select(known, [reference])[0]
        if not serves_as_reference(ref):
            lacks = [f"{m}()" for m in REFERENCE_METHODS if not callable(getattr(ref, m, None))]
            raise registry.RegistryError(f"{reference!r} cannot serve as the reference (it has "
                                         f"no {' and no '.join(lacks)} method)")
        names = list(backend_names) if backend_names is not None else [
            n for n in sorted(known) if n != reference]
        chosen = registry.select(known, [n for n in names if n != reference])
        store = ArtifactStore(artifacts, environment=fingerprint(resolved), plugins=plugins)
        session = cls(torch.device(resolved), ref, chosen, store, plugins)
        session.compiles.start()
        return session

    @property
    def environment(self) -> dict[str, Any]:
        """The fingerprint of this session's process and device."""
        assert self.store.environment is not None
        return self.store.environment

    def run(self, case: Case, backends: Iterable[str] | None = None) -> CaseResult:
        """Run one case on every backend under test, or on those named in ``backends`` (a
        fitted run, :meth:`difftest.generation.capabilities.Capabilities.fit`); the case is on
        disk while it runs and its failure stored. Keeps its result and record."""
        return self._run(case, backends, None)

    def run_all(self, runs: Iterable[tuple[Case, Iterable[str] | None]], ahead: int = 2
                ) -> Iterator[CaseResult]:
        """:meth:`run` each ``(case, backends)`` in order, yielding each result as it is
        recorded, with a small pipeline: a worker process (:meth:`pool`) builds the next
        ``ahead`` cases' host-side inputs (:func:`difftest.run.runner.prepare_host`: segment
        tables, page table, features) while this process runs the current one. The worker
        does no device work, so each case is still on disk before any kernel of it starts,
        and one case at a time is in flight. Until the worker runs, a case whose inputs it
        has not finished builds them here instead of waiting for the worker's start. The
        results and records are those of :meth:`run`."""
        pending = iter(runs)
        queue: deque[tuple[Case, Iterable[str] | None, Preparation | None]] = deque()
        first = next(pending, None)
        if first is not None:  # runs while the worker starts
            queue.append((*first, None))
        while queue:
            while len(queue) <= ahead and (following := next(pending, None)) is not None:
                queue.append((*following, Preparation(following[0], self.pool())))
            case, backends, prepared = queue.popleft()
            yield self._run(case, backends, prepared)

    def pool(self) -> Executor:
        """The session's preparation worker (one process, started on first use; spawned, so
        it inherits no device state)."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self._pool_started = self._pool.submit(os.getpid)
        return self._pool

    def close(self) -> None:
        """Stop the preparation worker, if one was started, free the cache buffers and stop
        counting compilations."""
        self.caches.clear()
        self.compiles.stop()
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool, self._pool_started = None, None

    def _run(self, case: Case, backends: Iterable[str] | None,
             prepared: Preparation | None) -> CaseResult:
        chosen = self.backends if backends is None else self.chosen(backends)
        self.store.begin(case, [self.reference.name, *(b.name for b in chosen)])
        # a spawned worker imports torch and difftest before its first case (seconds, more
        # on an image without compiled bytecode): cases run meanwhile build their own inputs
        started = self._pool_started is not None and self._pool_started.done()
        host = None if prepared is None else prepared.host(wait=started)
        try:
            result = run_case(case, self.reference, chosen, self.device, host,
                              caches=self.caches,
                              hooks=[StoreHooks(self.store), CompileHooks(self.compiles),
                                     *self.hooks],
                              known_bugs=self.expectations)
        except OSError:  # the store could not note a call (a full disk): no backend crashed
            self.store.abandon()
            raise
        # The case as begin serialised it and the features from generation's rows (or from
        # the worker): neither is built twice (at production shape each cost about 10 to
        # 25 ms per case).
        features = None
        if result.rows is not None:
            features = (host.features if host is not None
                        else case_features(case, result.rows))
        record = result.record(self.store.outputs(case), case=self.store.case_dict(case),
                               features=features)
        result.artifact = self.store.finish(case, record)
        self.results.append(result)
        self.records.append(record)
        return result

    def chosen(self, names: Iterable[str]) -> list[Backend]:
        """The backends under test called ``names``, in the session's order."""
        wanted = set(names)
        unknown = wanted - {b.name for b in self.backends}
        if unknown:
            raise registry.RegistryError(f"not backends of this session: {sorted(unknown)} "
                                         f"(it has {[b.name for b in self.backends]})")
        return [b for b in self.backends if b.name in wanted]

    def backend_entries(self) -> dict[str, dict[str, Any]]:
        """Availability and versions of the reference and every backend under test."""
        return {b.name: backend_entry(b) for b in [self.reference, *self.backends]}

    def config(self) -> dict[str, object]:
        """The part of a report that says how this session was configured."""
        return {
            "device": str(self.device),
            "reference": self.reference.name,
            "backends": [b.name for b in self.backends],
            "plugins": list(self.plugins),
        }
