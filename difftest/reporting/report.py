"""The versioned JSON report of a run, and its terminal summary.

Schema ``difftest.report/1``, every field documented in ``docs/report-schema.md``:
top-level ``schema``, ``created``, ``fingerprint``, ``config``, ``backends`` (availability and
versions per backend), ``cases`` (one :class:`difftest.results.records.CaseRecord` per case, sorted
by case id so shards merge deterministically), and where they apply ``workers`` (pytest-xdist),
``merged_from`` (``difftest merge``) and ``earlier_crashes``.

A report is held as its JSON document (a dict); :func:`write_report` writes it as strict JSON,
atomically, and :func:`read_report` checks every field of what it reads. Code that looks at
the cases reads them with :func:`case_records`, never as bare dicts.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftest.contract.backend import Backend
from difftest.primitives.jsonfile import JSONFileError, read_json, write_json
from difftest.results.artifacts import repro_command
from difftest.results.features import coverage_table
from difftest.results.records import FAILING, STATUSES, CaseRecord, RecordError, Status, read_entry

if TYPE_CHECKING:
    from difftest.judgement.expectations import Judgement

REPORT_SCHEMA = "difftest.report/1"
# its JSON Schema (package data), which refers to the case's (difftest.case.spec)
REPORT_JSON_SCHEMA = Path(__file__).with_name("report.schema.json")
CASE_LISTS = ("cases", "earlier_crashes")


class ReportError(ValueError):
    """A report file cannot be read: missing, not JSON, another schema, or a field that is
    missing or wrong (the message names the file and the field)."""


@dataclass(frozen=True)
class BackendEntry:
    """A backend's entry under ``backends`` (:func:`backend_entry`)."""

    available: bool
    reason: str
    versions: dict[str, str]


@dataclass(frozen=True)
class WorkerEntry:
    """An xdist worker's entry under ``workers``."""

    pid: int
    host: str
    slot: int
    gpu_env: dict[str, str]
    visibility: dict[str, str]
    device: str
    gpu_name: str | None
    gpu_arch: str | None
    gpu_pci_bus_id: str | None
    cases: int


@dataclass(frozen=True)
class MergedFrom:
    """One input of ``difftest merge`` under ``merged_from``."""

    report: str
    shard: str | None
    cases: int


@dataclass(frozen=True)
class ReportFields:
    """The top level of a report; the case lists are read as :class:`CaseRecord` each."""

    schema: str
    created: str
    fingerprint: dict[str, Any]
    config: dict[str, Any]
    backends: dict[str, BackendEntry]
    cases: list[Any]
    workers: dict[str, WorkerEntry] | None = None
    merged_from: list[MergedFrom] | None = None
    earlier_crashes: list[Any] | None = None

    OPTIONAL = frozenset({"workers", "merged_from", "earlier_crashes"})


def now() -> str:
    """UTC time stamp of the report format."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def backend_entry(backend: Backend) -> dict[str, Any]:
    """Availability (with reason) and versions of a backend."""
    availability = backend.availability()
    versions: dict[str, str] = {}
    if availability.available:
        try:
            versions = backend.versions()
        except Exception as exc:  # versions are informative; never fail the report for them
            versions = {"error": repr(exc)}
    return {"available": availability.available, "reason": availability.reason,
            "versions": versions}


def unique_cases(records: Iterable[CaseRecord]) -> list[CaseRecord]:
    """``records`` by case id (sorted), a case id recorded twice keeping its last record."""
    by_id = {r.case_id: r for r in records}
    return [by_id[k] for k in sorted(by_id)]


@dataclass
class Report:
    """A run's report, built once with everything in it (its audit included).

    :meth:`to_dict` is its JSON document (what :func:`write_report` writes and the
    summary, ``merge``, ``gate`` and ``plot`` read); a case id recorded twice keeps its last
    record. ``earlier_crashes`` are cases an earlier, dead process left pending, found at the
    start of this run: failures to act on, but not part of this run's case set. ``audit`` is
    :func:`difftest.judgement.audit.audit_json` of the cases (``config.audit`` in JSON).
    """

    fingerprint: dict[str, Any]
    config: dict[str, Any]
    backends: dict[str, dict[str, Any]]
    cases: list[CaseRecord]
    audit: dict[str, Any] | None = None
    workers: dict[str, dict[str, Any]] | None = None
    earlier_crashes: list[CaseRecord] = field(default_factory=list)
    created: str = field(default_factory=now)

    @property
    def failed(self) -> bool:
        """Whether a backend disagreed, errored or crashed, or an earlier crash was found."""
        return bool(self.earlier_crashes) or any(c.failed for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (schema :data:`REPORT_SCHEMA`)."""
        config = dict(self.config)
        if self.audit is not None:
            config["audit"] = self.audit
        document: dict[str, Any] = {
            "schema": REPORT_SCHEMA,
            "created": self.created,
            "fingerprint": self.fingerprint,
            "config": config,
            "backends": dict(sorted(self.backends.items())),
            "cases": [r.to_dict() for r in unique_cases(self.cases)],
        }
        if self.workers is not None:
            document["workers"] = dict(sorted(self.workers.items()))
        if self.earlier_crashes:
            document["earlier_crashes"] = [c.to_dict() for c in self.earlier_crashes]
        return document


def build_report(records: Iterable[CaseRecord], backends: dict[str, dict[str, Any]],
                 config: dict[str, Any], fingerprint: dict[str, Any],
                 workers: dict[str, dict[str, Any]] | None = None,
                 earlier_crashes: Iterable[CaseRecord] = (),
                 audit: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a :class:`Report` of ``records``."""
    return Report(fingerprint, config, backends, list(records), audit, workers,
                  list(earlier_crashes)).to_dict()


def write_report(path: Path | str, report: dict[str, Any]) -> None:
    """Write ``report`` as strict JSON, atomically
    (:func:`difftest.primitives.jsonfile.write_json`)."""
    write_json(path, report)


def read_report(path: Path | str) -> dict[str, Any]:
    """Read a report (strict JSON, or an older one with bare ``NaN``/``Infinity``), checking
    its schema and every field; :class:`ReportError` names the file and the field."""
    try:
        report = read_json(path)
    except JSONFileError as exc:
        raise ReportError(str(exc)) from exc
    if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA:
        schema = report.get("schema") if isinstance(report, dict) else None
        raise ReportError(f"{path}: schema {schema!r}, expected {REPORT_SCHEMA!r}")
    try:
        read_entry(ReportFields, report, "", ReportFields.OPTIONAL)
        for key in CASE_LISTS:
            case_records(report, key)
    except RecordError as exc:
        raise ReportError(f"{path}: {exc}") from exc
    return report


def case_records(report: dict[str, Any], key: str = "cases") -> list[CaseRecord]:
    """The entries of ``report[key]`` (``cases`` or ``earlier_crashes``) as records;
    :class:`RecordError` names the field, e.g. ``cases[3].results[0].status``."""
    return [CaseRecord.from_dict(entry, f"{key}[{i}]")
            for i, entry in enumerate(report.get(key) or [])]


def status_matrix(cases: list[CaseRecord]) -> dict[str, Counter[Status]]:
    """backend -> Counter of statuses."""
    matrix: dict[str, Counter[Status]] = {}
    for case in cases:
        for result in case.results:
            matrix.setdefault(result.backend, Counter())[result.status] += 1
    return matrix


def failure_lines(cases: list[CaseRecord], plugins: tuple[str, ...] = (),
                  known: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per failing case: what failed and the command that replays it; ``known``:
    ``(case id, backend)`` results a known bug explains, left out (named elsewhere)."""
    lines = []
    for case in cases:
        failing = [r for r in case.results
                   if r.status in FAILING and (case.case_id, r.backend) not in known]
        if not failing:
            continue
        label = "CRASH" if any(r.status is Status.CRASH for r in failing) else "FAILED"
        what = ", ".join(f"{r.backend} {r.status.value}" for r in failing)
        replay = (f"replay with {repro_command(case.artifact, plugins)}" if case.artifact
                  else "no artifact directory")
        lines.append(f"{label} case {case.case_id} ({what}): {replay}")
    return lines


def unavailable_lines(report: dict[str, Any]) -> list[str]:
    """Each unavailable backend's reason, once: backends sharing a reason share a line."""
    by_reason: dict[str, list[str]] = {}
    for backend, entry in sorted(report["backends"].items()):
        if not entry["available"]:
            by_reason.setdefault(entry["reason"], []).append(backend)
    return [f"unavailable: {', '.join(names)}: {reason}" for reason, names in by_reason.items()]


def status_counts(report: dict[str, Any]) -> Counter[Status]:
    """Results by status over the report's cases."""
    return Counter(r.status for c in case_records(report) for r in c.results)


def unavailable_asked(backends: dict[str, dict[str, Any]], asked: Sequence[str] | None,
                      optional: Sequence[str]) -> list[str]:
    """One line per backend named with ``--backends`` (and not ``--optional``) that could not
    run: a run that tested nothing of what was asked for is not a pass."""
    return [f"backend {name} was asked for and could not run: {entry['reason']} (mark it "
            f"--optional {name} to run without it)"
            for name, entry in backends.items()
            if name in (asked or ()) and name not in optional and not entry["available"]]


def verdict_line(report: dict[str, Any], path: str | None = None,
                 judgement: Judgement | None = None, missing: Sequence[str] = ()) -> str:
    """The closing line of a run: PASSED or FAILED, the new failures by kind, the known bugs
    met and the expected ones not seen (``judgement``, :mod:`difftest.judgement.expectations`), the
    asked-for backends that could not run (``missing``: :func:`unavailable_asked`), what
    did not run, and where the report is."""
    counts = status_counts(report)
    known = Counter(r.status for hits in (judgement.known if judgement else {}).values()
                    for _, r in hits)
    crashes = len(report.get("earlier_crashes") or [])
    failing = sum(counts[s] - known[s] for s in FAILING) + crashes
    unseen = judgement.strict_unseen if judgement else []
    cases = len(report["cases"])
    unavailable = sorted(b for b, e in report["backends"].items() if not e["available"])
    if failing or unseen or missing:
        kinds = [f"{counts[s] - known[s]} {s.value}" for s in Status
                 if s in FAILING and counts[s] - known[s]]
        kinds += [f"{crashes} crash(es) left by an earlier run"] if crashes else []
        head = f"FAILED: {failing} new failure(s)" + (f" ({', '.join(kinds)})" if kinds else "")
        head += f" in {cases} cases"
        head += f"; expected bug(s) not seen: {', '.join(unseen)}" if unseen else ""
        head += (f"; {len(missing)} asked-for backend(s) could not run" if missing else "")
    else:
        head = f"PASSED: {cases} cases, {counts[Status.AGREE]} agreements, no new failure"
    parts = [head]
    if judgement and judgement.known:
        parts.append(f"{sum(known.values())} known bug result(s) "
                     f"({', '.join(sorted(judgement.known))})")
    parts.append(f"{counts[Status.UNSUPPORTED]} unsupported")
    if unavailable:
        parts.append(f"{counts[Status.UNAVAILABLE]} unavailable ({', '.join(unavailable)})")
    parts.append(f"report {path}" if path else "no report written (--report PATH)")
    return "; ".join(parts)


def blind_spot_lines(audit: dict[str, Any] | None, path: str | None = None,
                     without_report: str = "difftest run --audit") -> list[str]:
    """The audit's blind spots (kernel arguments that took one value over the cases a backend
    ran, though not documented as fixed), one line per backend, and where the whole audit
    is shown: ``difftest audit <path>``, or ``without_report`` when no report is written."""
    if not audit:
        return []
    lines = []
    for backend, entry in sorted(audit["backends"].items()):
        for kernel, stated in entry["kernels"].items():
            blind = [f"{a['name']}={'/'.join(a['values']) or '-'}"
                     for a in stated["arguments"] if a["blind"]]
            if blind and entry["cases"]:  # a backend that ran nothing is not audited
                lines.append(f"blind spots of {backend} ({kernel}, {entry['cases']} "
                             f"cases): {', '.join(blind)}")
    where = f"difftest audit {path}" if path else without_report
    lines.append(f"parameter audit: {len(lines)} backend(s) with blind spots; all of it: "
                 f"{where}")
    return lines


def summary(report: dict[str, Any], worst: int = 5, max_failures: int = 20,
            unavailable: bool = True, coverage: bool = True,
            known: frozenset[tuple[str, str]] = frozenset()) -> str:
    """Agreement matrix, cases per backend, the worst cases and every failure, as text;
    ``unavailable``: with each unavailable backend's reason (:func:`unavailable_lines`);
    ``coverage``: with the feature coverage table; ``known``: ``(case id, backend)``
    results of known bugs, left out of the failure lines."""
    cases = case_records(report)
    matrix = status_matrix(cases)
    width = max([len(b) for b in matrix] + [7])
    lines = [f"{len(cases)} cases; reference {cases[0].reference if cases else '-'}", ""]
    lines.append(f"{'backend':<{width}}  " + "  ".join(f"{s:>11}" for s in STATUSES)
                 + "  worst err/tol")
    for backend, counts in sorted(matrix.items()):
        ratios = [r.ratio for c in cases for r in c.results
                  if r.backend == backend and r.ratio is not None and not math.isnan(r.ratio)]
        worst_ratio = f"{max(ratios):.3g}" if ratios else "-"
        lines.append(f"{backend:<{width}}  "
                     + "  ".join(f"{counts[s]:>11}" for s in Status) + f"  {worst_ratio:>13}")
    ranked = sorted(
        ((r.ratio, c.case_id, c.name, r.backend, r.status.value)
         for c in cases for r in c.results if r.ratio is not None and not math.isnan(r.ratio)),
        reverse=True,
    )[:worst]
    if ranked:
        lines += ["", "worst cases (error/tolerance):"]
        lines += [f"  {ratio:10.3g}  {backend:<{width}}  {case_id}  {status}  {name}".rstrip()
                  for ratio, case_id, name, backend, status in ranked]
    if cases and coverage:
        lines += ["", coverage_table(cases)]
    if unavailable:
        lines += unavailable_lines(report)
    plugins = tuple(report.get("config", {}).get("plugins", ()))
    failures = failure_lines(cases, plugins, known) + [
        f"CRASH case {c.case_id} (in an earlier run): replay with "
        f"{repro_command(c.artifact or '-', c.plugins or ())}"
        for c in case_records(report, "earlier_crashes")]
    if failures:
        lines += ["", *failures[:max_failures]]
        if len(failures) > max_failures:
            lines.append(f"... and {len(failures) - max_failures} more failing cases "
                         "(every one is in the JSON report)")
    return "\n".join(lines)
