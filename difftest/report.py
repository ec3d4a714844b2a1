"""The versioned JSON report of a run, and its terminal summary.

Schema ``difftest.report/1``, every field documented in ``docs/report-schema.md``: top-level
``schema``, ``created``, ``fingerprint``, ``config``, ``backends`` (availability and versions
per backend), ``cases`` (one :func:`difftest.artifacts.case_record` per case, sorted by case
id so shards merge deterministically), and where they apply ``workers`` (pytest-xdist) and
``merged_from`` (``difftest merge``).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

from difftest.artifacts import repro_command
from difftest.backend import Backend
from difftest.coverage import coverage_table

REPORT_SCHEMA = "difftest.report/1"
STATUSES = ("agree", "disagree", "error", "crash", "unsupported", "unavailable")
FAILING_STATUSES = frozenset({"disagree", "error", "crash"})


class ReportError(ValueError):
    """A report file cannot be read: missing, not JSON, or another schema."""


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


def build_report(records: list[dict[str, Any]], backends: dict[str, dict[str, Any]],
                 config: dict[str, Any], fingerprint: dict[str, Any],
                 workers: dict[str, dict[str, Any]] | None = None,
                 earlier_crashes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report of ``records``; a case id seen twice keeps its last record.

    ``earlier_crashes`` are cases an earlier, dead process left pending, found at the start of
    this run: failures to act on, but not part of this run's case set.
    """
    by_id = {r["case_id"]: r for r in records}
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "created": now(),
        "fingerprint": fingerprint,
        "config": config,
        "backends": dict(sorted(backends.items())),
        "cases": [by_id[k] for k in sorted(by_id)],
    }
    if workers is not None:
        report["workers"] = dict(sorted(workers.items()))
    if earlier_crashes:
        report["earlier_crashes"] = earlier_crashes
    return report


def write_report(path: Path | str, report: dict[str, Any]) -> None:
    """Write ``report`` as JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def read_report(path: Path | str) -> dict[str, Any]:
    """Read a report, checking its schema; :class:`ReportError` says what is wrong."""
    try:
        report = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA:
        schema = report.get("schema") if isinstance(report, dict) else None
        raise ReportError(f"{path}: schema {schema!r}, expected {REPORT_SCHEMA!r}")
    return report


def status_matrix(cases: list[dict[str, Any]]) -> dict[str, Counter[str]]:
    """backend -> Counter of statuses."""
    matrix: dict[str, Counter[str]] = {}
    for case in cases:
        for result in case["results"]:
            matrix.setdefault(result["backend"], Counter())[result["status"]] += 1
    return matrix


def failure_lines(cases: list[dict[str, Any]], plugins: tuple[str, ...] = ()) -> list[str]:
    """One line per failing case: what failed and the command that replays it."""
    lines = []
    for case in cases:
        failing = [r for r in case["results"] if r["status"] in FAILING_STATUSES]
        if not failing:
            continue
        label = "CRASH" if any(r["status"] == "crash" for r in failing) else "FAILED"
        what = ", ".join(f"{r['backend']} {r['status']}" for r in failing)
        replay = (f"replay with {repro_command(case['artifact'], plugins)}"
                  if case.get("artifact")
                  else "no artifact directory")
        lines.append(f"{label} case {case['case_id']} ({what}): {replay}")
    return lines


def summary(report: dict[str, Any], worst: int = 5, max_failures: int = 20) -> str:
    """Agreement matrix, cases per backend, the worst cases and every failure, as text."""
    cases = report["cases"]
    matrix = status_matrix(cases)
    width = max([len(b) for b in matrix] + [7])
    lines = [f"{len(cases)} cases; reference {cases[0]['reference'] if cases else '-'}", ""]
    lines.append(f"{'backend':<{width}}  " + "  ".join(f"{s:>11}" for s in STATUSES)
                 + "  worst err/tol")
    for backend, counts in sorted(matrix.items()):
        ratios = [r["comparison"]["max_ratio"] for c in cases for r in c["results"]
                  if r["backend"] == backend and r["comparison"]
                  and not math.isnan(r["comparison"]["max_ratio"])]
        worst_ratio = f"{max(ratios):.3g}" if ratios else "-"
        lines.append(f"{backend:<{width}}  " + "  ".join(f"{counts[s]:>11}" for s in STATUSES)
                     + f"  {worst_ratio:>13}")
    ranked = sorted(
        ((r["comparison"]["max_ratio"], c["case_id"], c["name"], r["backend"], r["status"])
         for c in cases for r in c["results"]
         if r["comparison"] and not math.isnan(r["comparison"]["max_ratio"])),
        reverse=True,
    )[:worst]
    if ranked:
        lines += ["", "worst cases (error/tolerance):"]
        lines += [f"  {ratio:10.3g}  {backend:<{width}}  {case_id}  {status}  {name}".rstrip()
                  for ratio, case_id, name, backend, status in ranked]
    if cases and all("features" in c for c in cases):
        lines += ["", coverage_table(cases)]
    for backend, entry in sorted(report["backends"].items()):
        if not entry["available"]:
            lines.append(f"unavailable: {backend}: {entry['reason']}")
    plugins = tuple(report.get("config", {}).get("plugins", ()))
    failures = failure_lines(cases, plugins) + [
        f"CRASH case {c['case_id']} (in an earlier run): replay with "
        f"{repro_command(c['artifact'], c.get('plugins', ()))}"
        for c in report.get("earlier_crashes", [])]
    if failures:
        lines += ["", *failures[:max_failures]]
        if len(failures) > max_failures:
            lines.append(f"... and {len(failures) - max_failures} more failing cases "
                         "(every one is in the JSON report)")
    return "\n".join(lines)
