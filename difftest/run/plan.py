"""One run of ``difftest run``: which cases run on which backends, running them, the report.

:meth:`RunPlan.build` lists the runs (the pinned corpus, the generated examples, the variants
fitted to backends that refuse an example, then ``--shard``); :func:`execute` runs them in a
:class:`difftest.run.session.Session` (all of them, or, in a job of ``--jobs``, those the job
claims); :func:`session_report` is the :class:`difftest.reporting.report.Report` of what a session
ran, its audit included. The CLI's single process, each job of ``--jobs`` and the pytest
plug-in's processes all run cases through a session and report through
:func:`difftest.reporting.report.Report`; the CLI and its jobs share the plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from difftest.case.spec import Case
from difftest.generation.capabilities import Capabilities
from difftest.judgement.audit import audit_json
from difftest.primitives.interrupts import raise_pending
from difftest.reporting.report import Report, unique_cases
from difftest.results.records import CaseRecord
from difftest.run.runner import CaseResult
from difftest.run.session import Session
from difftest.run.shard import Shard

Origin = Literal["corpus", "generated", "fitted", "recorded"]
ORIGINS: tuple[Origin, ...] = ("corpus", "generated", "fitted", "recorded")


@dataclass(frozen=True)
class PlannedRun:
    """One case on ``backends`` (``None``: every backend under test); ``origin`` says where
    the case comes from: the pinned corpus, a generated example as drawn, a variant of one
    fitted to the backends that refuse it, or an earlier report (``--cases-from``)."""

    case: Case
    backends: tuple[str, ...] | None
    origin: Origin


@dataclass(frozen=True)
class RunPlan:
    """The runs of one ``difftest run``, in order, and what generation fitted or left out."""

    runs: tuple[PlannedRun, ...]
    generation: tuple[str, ...] = ()
    # runs by origin over the whole case set (before --shard: every shard records the same)
    case_set: tuple[tuple[str, int], ...] = ()

    @classmethod
    def build(cls, capabilities: Capabilities, cases: Iterable[Case],
              examples: Iterable[Case], shard: Shard | None = None,
              recorded: Iterable[tuple[Case, tuple[str, ...] | None]] = ()) -> RunPlan:
        """The corpus ``cases`` on every backend, then each generated example fitted to the
        backends (:meth:`Capabilities.fit_all`), then the ``recorded`` runs of an earlier
        report as they were; only those in ``shard`` when given."""
        runs = [PlannedRun(case, None, "corpus") for case in cases]
        runs += [PlannedRun(f.case, f.backends, "fitted" if f.changes else "generated")
                 for f in capabilities.fit_all(examples)]
        runs += [PlannedRun(case, names, "recorded") for case, names in recorded]
        found = Counter(run.origin for run in runs)
        case_set = tuple((origin, found[origin]) for origin in ORIGINS)
        if shard is not None:
            runs = [run for run in runs if shard.contains(run.case)]
        return cls(tuple(runs), tuple(capabilities.lines()), case_set)

    @classmethod
    def drawn(cls, capabilities: Capabilities, corpus: Iterable[Case], examples: int, seed: int,
              shard: Shard | None = None) -> RunPlan:
        """:meth:`build` over ``examples`` generated sparse examples of ``seed`` and the dense
        family's share of them (:func:`drawn_examples`)."""
        return cls.build(capabilities, corpus, drawn_examples(capabilities, examples, seed),
                         shard)

    def counts(self) -> dict[str, int]:
        """The whole case set's runs by origin (``corpus``, ``generated``, ``fitted``),
        ``--shard`` or not."""
        return dict(self.case_set)

    def pairs(self) -> list[tuple[Case, tuple[str, ...] | None]]:
        """``(case, backends)`` of every run, as :meth:`Session.run` takes them."""
        return [(run.case, run.backends) for run in self.runs]


def drawn_examples(capabilities: Capabilities, count: int, seed: int) -> list[Case]:
    """The examples ``difftest run --examples count --seed seed`` draws over what the
    backends run in every release: ``count`` of the sparse family, then the dense family's
    share."""
    from difftest.generation.dense import dense_examples
    from difftest.generation.generate import generated_cases

    return [*generated_cases(count, seed, capabilities.strategy),
            *generated_cases(dense_examples(count), seed, capabilities.dense_strategy)]


def case_set_line(counts: dict[str, int], shard: str | None = None, ran: int = 0) -> str:
    """The case count explained: ``133 cases: 6 corpus, 50 generated, 77 fitted variants``,
    and why a backend runs fewer cases than the total; with ``shard``, the ``ran`` cases of
    that shard first."""
    total = sum(counts.values())
    line = f"shard {shard}: {ran} cases of a case set of " if shard else ""
    line += (f"{total} cases: {counts.get('corpus', 0)} corpus, "
             f"{counts.get('generated', 0)} generated")
    if counts.get("fitted"):
        line += (f", {counts['fitted']} fitted variants (a backend that refuses a generated "
                 "case runs the nearest variant it accepts instead)")
    if counts.get("recorded"):
        line += f", {counts['recorded']} from an earlier report (--cases-from)"
    return line


def execute(session: Session, plan: RunPlan, claims: Path | None = None, jobs: int = 1
            ) -> Iterator[CaseResult]:
    """Run ``plan`` in ``session``, yielding each result as it is recorded; with ``claims``
    (a job of ``--jobs``, one of ``jobs``), only the units of runs this job claims first
    (:func:`difftest.run.jobs.claim_units`, :func:`difftest.run.jobs.claimed`).

    On a GPU a worker process prepares the next cases' host-side inputs
    (:meth:`Session.run_all`); on the CPU it would compete with the interpreted kernels for
    the cores, so the cases run one by one.
    """
    from difftest.run.jobs import claim_units, claimed

    pairs: Iterable[tuple[Case, tuple[str, ...] | None]] = plan.pairs()
    if claims is not None:
        runs = plan.pairs()
        units = claim_units(runs, jobs, by_class=session.device.type == "cuda")
        pairs = (runs[i] for unit in claimed(units, claims) for i in unit)
    pairs = _between_signals(pairs)
    if session.device.type == "cuda":
        yield from session.run_all(pairs)
    else:
        for case, backends in pairs:
            yield session.run(case, backends)


def _between_signals(pairs: Iterable[tuple[Case, tuple[str, ...] | None]]
                     ) -> Iterator[tuple[Case, tuple[str, ...] | None]]:
    """``pairs``, raising a signal Python had to drop before the next case starts."""
    for pair in pairs:
        raise_pending()
        yield pair


def session_report(session: Session, config: dict[str, Any],
                   earlier_crashes: Iterable[CaseRecord] = ()) -> Report:
    """The report of every case ``session`` ran: its configuration plus ``config`` and the
    kernel specializations it compiled, the backends' entries, the fingerprint and the audit
    of the cases."""
    records = unique_cases(session.records)
    config = config | {"kernel_compiles": session.compiles.to_dict()}
    return Report(session.environment, session.config() | config, session.backend_entries(),
                  records, audit_json(records, session.backends),
                  earlier_crashes=list(earlier_crashes))
