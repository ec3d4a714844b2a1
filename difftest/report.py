"""The versioned JSON report of a run, and its terminal summary.

Schema ``difftest.report/1`` (documented in ``docs/report-schema.md``): top-level ``schema``,
``created``, ``fingerprint``, ``config``, ``backends`` (availability and versions per backend)
and ``cases`` (one :meth:`difftest.runner.CaseResult.to_dict` per case, sorted by case id).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from difftest.backend import Backend
from difftest.fingerprint import fingerprint
from difftest.runner import CaseResult

REPORT_SCHEMA = "difftest.report/1"
STATUSES = ("agree", "disagree", "error", "crash", "unsupported", "unavailable")


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


def build_report(results: list[CaseResult], backends: list[Backend],
                 config: dict[str, Any]) -> dict[str, Any]:
    """The report of ``results`` (cases sorted by id, so shards merge deterministically)."""
    return {
        "schema": REPORT_SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fingerprint(),
        "config": config,
        "backends": {b.name: backend_entry(b) for b in backends},
        "cases": sorted((r.to_dict() for r in results), key=lambda c: c["case_id"]),
    }


def write_report(path: Path | str, report: dict[str, Any]) -> None:
    """Write ``report`` as JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def read_report(path: Path | str) -> dict[str, Any]:
    """Read a report, checking its schema."""
    report = json.loads(Path(path).read_text())
    if report.get("schema") != REPORT_SCHEMA:
        raise ValueError(f"{path}: schema {report.get('schema')!r}, expected {REPORT_SCHEMA!r}")
    return report


def status_matrix(cases: list[dict[str, Any]]) -> dict[str, Counter[str]]:
    """backend -> Counter of statuses."""
    matrix: dict[str, Counter[str]] = {}
    for case in cases:
        for result in case["results"]:
            matrix.setdefault(result["backend"], Counter())[result["status"]] += 1
    return matrix


def summary(report: dict[str, Any], worst: int = 5) -> str:
    """Agreement matrix, cases per backend and the worst cases, as text."""
    cases = report["cases"]
    matrix = status_matrix(cases)
    width = max([len(b) for b in matrix] + [7])
    lines = [f"{len(cases)} cases; reference {cases[0]['reference'] if cases else '-'}", ""]
    lines.append(f"{'backend':<{width}}  " + "  ".join(f"{s:>11}" for s in STATUSES)
                 + "  worst err/tol")
    for backend, counts in sorted(matrix.items()):
        ratios = [r["comparison"]["max_ratio"] for c in cases for r in c["results"]
                  if r["backend"] == backend and r["comparison"]]
        worst_ratio = f"{max(ratios):.3g}" if ratios else "-"
        lines.append(f"{backend:<{width}}  " + "  ".join(f"{counts[s]:>11}" for s in STATUSES)
                     + f"  {worst_ratio:>13}")
    ranked = sorted(
        ((r["comparison"]["max_ratio"], c["case_id"], c["name"], r["backend"], r["status"])
         for c in cases for r in c["results"] if r["comparison"]),
        reverse=True,
    )[:worst]
    if ranked:
        lines += ["", "worst cases (error/tolerance):"]
        lines += [f"  {ratio:10.3g}  {backend:<{width}}  {case_id}  {status}  {name}"
                  for ratio, case_id, name, backend, status in ranked]
    for backend, entry in sorted(report["backends"].items()):
        if not entry["available"]:
            lines.append(f"unavailable: {backend}: {entry['reason']}")
    return "\n".join(lines)
