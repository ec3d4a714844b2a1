"""Splitting a deterministic case set across CI runners, and joining their reports.

A case belongs to shard ``int(case_id, 16) % N`` (0-based), so the split depends on nothing
but the case's content: N runners given ``K/N`` for K = 1..N cover the set without overlap,
whatever order or machine they run in. :func:`merge_reports` joins their reports into one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from difftest.case.spec import Case
from difftest.machine.fingerprint import comparable
from difftest.primitives.jsonfile import dumps
from difftest.primitives.text import printable
from difftest.reporting.report import REPORT_SCHEMA, backend_twice, case_records
from difftest.results.records import CaseRecord

# Fields of a case entry that differ between two runs of the same case on the same image.
VOLATILE_CASE_FIELDS = ("timings", "artifact", "worker", "nodeid")
VOLATILE_RESULT_FIELDS = ("seconds",)


class ShardError(ValueError):
    """A shard specification, or a set of reports to merge, is invalid."""


def shard_of(case_id: str, n: int) -> int:
    """The 0-based shard of ``case_id`` among ``n``."""
    return int(case_id, 16) % n


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` (1-based) of ``count``."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str, option: str = "--shard") -> Shard:
        """``"K/N"`` with ``1 <= K <= N``; the error names ``option`` and the allowed range."""
        index, sep, count = text.partition("/")
        if not (sep and index.strip().isdigit() and count.strip().isdigit()):
            raise ShardError(f"{option} {text!r}: expected K/N, e.g. 2/4")
        k, n = int(index), int(count)
        if n < 1 or not 1 <= k <= n:
            raise ShardError(f"{option} {text}: K must be 1..N and N >= 1 (got K={k}, N={n})")
        return cls(k, n)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def contains(self, case: Case) -> bool:
        """Whether ``case`` belongs to this shard."""
        return shard_of(case.case_id, self.count) == self.index - 1

    def select(self, cases: Iterable[Case]) -> list[Case]:
        """The cases of this shard, in their original order."""
        return [c for c in cases if self.contains(c)]


def comparable_case(record: CaseRecord) -> str:
    """A case's entry without the fields that legitimately differ between identical runs, as
    strict JSON text (so a NaN compares equal to a NaN)."""
    entry = record.to_dict()
    kept = {k: v for k, v in entry.items() if k not in VOLATILE_CASE_FIELDS}
    kept["results"] = [{k: v for k, v in r.items() if k not in VOLATILE_RESULT_FIELDS}
                       for r in entry["results"]]
    return dumps(kept)


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """A report's config without the shard, the processes that ran it, and the audit, the
    reach and the kernel compilations of its cases (which differ between shards by design).
    ``case_set`` counts the whole case set in every shard, so it is compared like the rest."""
    return {k: v for k, v in config.items()
            if k not in ("shard", "workers", "jobs", "audit", "reach", "kernel_compiles")}


def merge_reports(reports: list[tuple[str, dict[str, Any]]], force: bool = False
                  ) -> tuple[dict[str, Any], list[str]]:
    """Join ``(name, report)`` pairs into one report; also returns warnings.

    Refuses (:class:`ShardError`) a case id present twice with different results, a case
    that lists a backend twice (which result would be the verdict?), and, unless ``force``,
    reports whose comparable fingerprints, configs or backend entries differ.
    """
    if not reports:
        raise ShardError("nothing to merge")
    warnings: list[str] = []
    first_name, first = reports[0]
    cases: dict[str, CaseRecord] = {}
    owner: dict[str, str] = {}
    backends: dict[str, dict[str, Any]] = {}
    shards: set[str] = set()
    merged_from = []
    for name, report in reports:
        problems = []
        if comparable(report["fingerprint"]) != comparable(first["fingerprint"]):
            problems.append("its fingerprint differs from " + first_name + "'s: " +
                            _difference(comparable(first["fingerprint"]),
                                        comparable(report["fingerprint"])))
        if comparable_config(report["config"]) != comparable_config(first["config"]):
            problems.append("its config differs from " + first_name + "'s: " + _difference(
                comparable_config(first["config"]), comparable_config(report["config"])))
        for backend, entry in report["backends"].items():
            if backend in backends and backends[backend] != entry:
                problems.append(f"backend {backend} differs from an earlier report's")
            backends.setdefault(backend, entry)
        if problems and not force:
            raise ShardError(f"{name}: " + "; ".join(problems) + " (--force merges anyway)")
        warnings.extend(f"{name}: {p}" for p in problems)
        records = case_records(report)
        twice = backend_twice(records)
        if twice:
            raise ShardError(f"{name}: {twice}")
        for record in records:
            case_id = record.case_id
            if case_id in cases and comparable_case(cases[case_id]) != comparable_case(record):
                raise ShardError(f"case {printable(case_id)} is in {owner[case_id]} and "
                                 f"{name} with different results")
            cases.setdefault(case_id, record)
            owner.setdefault(case_id, name)
        shard = report["config"].get("shard")
        if shard:
            shards.add(shard)
        merged_from.append({"report": name, "shard": shard, "cases": len(report["cases"])})
    counts = {int(s.split("/")[1]) for s in shards}
    if len(counts) > 1:
        warnings.append(f"shards of different counts merged: {', '.join(sorted(shards))}")
    elif counts:
        n = counts.pop()
        missing = [f"{k}/{n}" for k in range(1, n + 1) if f"{k}/{n}" not in shards]
        if missing:
            warnings.append(f"shard(s) {', '.join(missing)} missing: the case set is partial")
    merged = {
        "schema": REPORT_SCHEMA,
        "created": first["created"],
        "fingerprint": first["fingerprint"],
        "config": comparable_config(first["config"]) | {"shard": None},
        "backends": dict(sorted(backends.items())),
        "cases": [cases[k].to_dict() for k in sorted(cases)],
        "merged_from": merged_from,
    }
    if any("audit" in report["config"] for _, report in reports):  # of the joined case set
        from difftest.judgement.audit import audit_json

        merged["config"]["audit"] = audit_json(merged["cases"], merged["config"]["backends"])
    if any("kernel_compiles" in report["config"] for _, report in reports):
        from difftest.machine.kernel_compiles import merged as merged_compiles

        merged["config"]["kernel_compiles"] = merged_compiles(
            [report["config"].get("kernel_compiles") or {} for _, report in reports])
    if any("reach" in report["config"] for _, report in reports):
        from difftest.results.reach import merge_reach

        merged["config"]["reach"] = merge_reach([report["config"].get("reach")
                                                  for _, report in reports])
    crashes = [c.to_dict() for _, report in reports
               for c in case_records(report, "earlier_crashes")]
    if crashes:  # failures of the shards' machines; the gate must still see them
        merged["earlier_crashes"] = crashes
    return merged, warnings


def _difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {json.dumps(a.get(k))} vs {json.dumps(b.get(k))}" for k in keys)
