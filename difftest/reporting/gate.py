"""The AITER bump gate: is a candidate report safe against a baseline on the same case set?

Every (case id, backend) of the baseline is judged against the candidate. The gate fails on

* a case of the baseline missing from the candidate (the case set shrank), or a backend's
  result missing from a case;
* a new failing status: the candidate disagrees, errors or crashes where the baseline did not
  (or fails differently, e.g. a disagreement became a crash);
* a backend unavailable (or absent) on either side: one that was asked for and could not
  run is not a pass, whatever the other side did; and a case it supported that it no longer
  supports;
* a case id listed more than once in either report (which entry would be judged?);
* a partial report on either side (``config.interrupted``: the run was stopped by a signal);
* error/tolerance that grew more than ``max_ratio_growth`` times, where the candidate's
  ratio is above ``ratio_floor`` (tiny ratios jitter without meaning anything);
* a crash an earlier process of the candidate left behind (``earlier_crashes``).

:func:`environment_changes` says what changed between the two runs: the fingerprint's
versions (torch, vLLM, AITER, ...) and each backend's own versions, such as the vLLM release
a ``triton-unified[vllm=0.30.0]`` or ``$DIFFTEST_VLLM`` run loaded its kernel from.

Fixed cases, cases new in the candidate and cases the candidate newly supports (its release
runs what the baseline's reported ``unsupported``) are listed but never fail the gate; a
newly supported case that fails does.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from difftest.machine.fingerprint import comparable
from difftest.reporting.report import case_records
from difftest.results.artifacts import repro_command
from difftest.results.records import FAILING, NOT_RUN, CaseRecord, ResultRecord, Status

DEFAULT_MAX_RATIO_GROWTH = 2.0
DEFAULT_RATIO_FLOOR = 0.5
HUNKS_SHOWN = 5  # unreached hunks listed per changed file (all with --all)


@dataclass(frozen=True)
class GateRow:
    """The verdict on one (case, backend); ``None`` statuses mean the entry is missing."""

    case_id: str
    name: str
    backend: str
    baseline_status: str | None
    baseline_ratio: float | None
    candidate_status: str | None
    candidate_ratio: float | None
    verdict: str
    fails: bool


@dataclass(frozen=True)
class GateResult:
    """All rows, and the backend-level findings."""

    rows: tuple[GateRow, ...]
    backend_findings: tuple[str, ...]
    compared: int

    @property
    def failed(self) -> bool:
        """Whether anything regressed."""
        return bool(self.backend_findings) or any(r.fails for r in self.rows)


def _judge(base: ResultRecord | None, cand: ResultRecord | None, growth: float,
           floor: float) -> tuple[str, bool]:
    if base is None:
        return ("result missing in baseline", True)
    if cand is None:
        return ("result missing in candidate", True)
    b, c = base.status, cand.status
    if Status.UNAVAILABLE in (b, c):
        return ("became unavailable" if b is not Status.UNAVAILABLE
                else "unavailable in the baseline" if c is not Status.UNAVAILABLE
                else "unavailable in both", True)
    if b is Status.UNSUPPORTED and c not in NOT_RUN:  # the candidate's release runs it
        return (f"newly supported, {c.value}" if c in FAILING else "newly supported",
                c in FAILING)
    if c in FAILING and c != b:
        return (f"new {c.value}", True)
    if c is Status.UNSUPPORTED and b not in NOT_RUN:
        return ("no longer supported", True)
    if b in FAILING and c not in FAILING:
        return ("fixed", False)
    br, cr = base.ratio, cand.ratio
    if br is not None and cr is not None and cr > floor and (
            cr > br * growth or (math.isinf(cr) and not math.isinf(br))):
        return (f"error/tolerance grew {cr / br:.3g}x" if br > 0 and math.isfinite(cr)
                else "error/tolerance grew", True)
    if b in FAILING:
        return (f"still {c.value}", False)
    return ("same", False)


def gate(baseline: dict[str, Any], candidate: dict[str, Any],
         max_ratio_growth: float = DEFAULT_MAX_RATIO_GROWTH,
         ratio_floor: float = DEFAULT_RATIO_FLOOR) -> GateResult:
    """Compare ``candidate`` with ``baseline`` (two reports over the same case set)."""
    findings = _backend_findings(baseline["backends"], candidate["backends"])
    for side, report in (("baseline", baseline), ("candidate", candidate)):
        stop = report["config"].get("interrupted")
        if stop:
            signal = stop.get("signal", "a signal") if isinstance(stop, dict) else "a signal"
            findings.append(f"the {side} is a partial report: its run was interrupted by "
                            f"{signal}")
    for crash in case_records(candidate, "earlier_crashes"):
        replay = (f"replay with {repro_command(crash.artifact, crash.plugins or ())}"
                  if crash.artifact else "no artifact directory")
        findings.append(f"case {crash.case_id} crashed a process before the candidate's run "
                        f"({replay})")
    base_cases = case_records(baseline)
    cand_list = case_records(candidate)
    findings += _duplicates(base_cases, "baseline") + _duplicates(cand_list, "candidate")
    cand_cases = {c.case_id: c for c in cand_list}
    base_ids = {c.case_id for c in base_cases}
    rows = []
    for case in base_cases:
        other = cand_cases.get(case.case_id)
        if other is None:
            rows.append(GateRow(case.case_id, case.name, "*", "present", None, None,
                                None, "case missing in candidate (case set shrank)", True))
            continue
        theirs = {r.backend: r for r in other.results}
        ours = {r.backend: r for r in case.results}
        for backend in sorted(ours.keys() | theirs.keys()):
            base, cand = ours.get(backend), theirs.get(backend)
            verdict, fails = _judge(base, cand, max_ratio_growth, ratio_floor)
            rows.append(GateRow(
                case.case_id, case.name, backend, base and base.status.value,
                base and base.ratio, cand and cand.status.value, cand and cand.ratio,
                verdict, fails))
    for case in cand_cases.values():
        if case.case_id not in base_ids:
            rows.append(GateRow(case.case_id, case.name, "*", None, None, "present",
                                None, "new case in candidate", False))
    return GateResult(tuple(rows), tuple(findings), len(base_cases))


def _backend_findings(baseline: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """A backend absent or unavailable on either side: nothing it was asked for ran there."""
    findings = []
    for name in sorted(baseline.keys() | candidate.keys()):
        base, cand = baseline.get(name), candidate.get(name)
        if base is None or cand is None:
            side = "candidate" if cand is None else "baseline"
            findings.append(f"backend {name} is missing from the {side}")
        elif base["available"] and not cand["available"]:
            findings.append(f"backend {name} became unavailable: {cand['reason']}")
        elif not base["available"] and cand["available"]:
            findings.append(f"backend {name} was unavailable in the baseline: "
                            f"{base['reason']} (nothing to compare the candidate with)")
        elif not base["available"]:
            findings.append(f"backend {name} is unavailable in both reports: {cand['reason']}")
    return findings


def _duplicates(cases: list[CaseRecord], side: str) -> list[str]:
    """A case id listed more than once: which entry is the verdict is undecidable."""
    counts = Counter(c.case_id for c in cases)
    return [f"case {case_id} is listed {n} times in the {side} (each case once; "
            "rerun or merge the shards)" for case_id, n in sorted(counts.items()) if n > 1]


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [f"{n}: {before.get(n)} -> {after.get(n)}"
            for n in sorted(before.keys() | after.keys()) if before.get(n) != after.get(n)]


def environment_changes(baseline: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """One line per changed fingerprint field or version, then per changed backend version
    (``backend triton-unified: vllm: 0.30.0 -> 0.31.0``)."""
    before, after = comparable(baseline["fingerprint"]), comparable(candidate["fingerprint"])
    lines = []
    for key in sorted(before.keys() | after.keys()):
        if key == "versions":
            lines += [f"  {line}" for line in _changed(before[key] or {}, after.get(key) or {})]
        elif before.get(key) != after.get(key):
            lines.append(f"  {key}: {before.get(key)} -> {after.get(key)}")
    for name in sorted(baseline["backends"].keys() & candidate["backends"].keys()):
        ours = baseline["backends"][name].get("versions") or {}
        theirs = candidate["backends"][name].get("versions") or {}
        lines += [f"  backend {name}: {line}" for line in _changed(ours, theirs)]
    return lines


def reach_lines(baseline: dict[str, Any], candidate: dict[str, Any],
                max_hunks: int | None = None) -> list[str]:
    """Which changed lines of the kernel trees the candidate's run executed
    (:func:`difftest.results.reach.reach_lines`): a passing gate over unreached code says so."""
    from difftest.results.reach import reach_lines as lines

    return lines(baseline, candidate, max_hunks)


def _fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3g}"


def format_result(result: GateResult, show_all: bool = False) -> str:
    """The table (changed rows, or every row with ``show_all``) and a one-line verdict."""
    shown = [r for r in result.rows if show_all or r.verdict != "same"]
    header = ("case id", "name", "backend", "baseline", "err/tol", "candidate", "err/tol",
              "verdict")
    table = [header] + [
        (r.case_id, r.name or "-", r.backend, r.baseline_status or "-",
         _fmt_ratio(r.baseline_ratio), r.candidate_status or "-", _fmt_ratio(r.candidate_ratio),
         ("FAIL " if r.fails else "") + r.verdict)
        for r in sorted(shown, key=lambda r: (not r.fails, r.case_id, r.backend))
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in table] if shown else []
    lines += [f"FAIL {finding}" for finding in result.backend_findings]
    same = sum(r.verdict == "same" for r in result.rows)
    failing = sum(r.fails for r in result.rows) + len(result.backend_findings)
    pairs = sum(r.backend != "*" for r in result.rows)
    tail = f"{result.compared} baseline cases, {pairs} (case, backend) pairs, {same} unchanged"
    if result.failed:
        lines.append(f"GATE FAILED: {failing} regression(s); {tail}")
    else:
        lines.append(f"GATE PASSED: no regression; {tail}")
    return "\n".join(lines)


def gate_lines(baseline: dict[str, Any], candidate: dict[str, Any], baseline_path: str,
               candidate_path: str, max_ratio_growth: float = DEFAULT_MAX_RATIO_GROWTH,
               ratio_floor: float = DEFAULT_RATIO_FLOOR, show_all: bool = False
               ) -> tuple[list[str], GateResult]:
    """What ``difftest gate`` prints, its verdict line last: the environment changes, the
    reach of the changed code, the changes of device code compiled without running
    (:func:`difftest.results.reach.device_code_lines`) and the table (``show_all``: every
    row and every unreached hunk, else the changed rows and :data:`HUNKS_SHOWN` hunks of a
    file); and the result."""
    from difftest.results.reach import device_code_lines

    changes = environment_changes(baseline, candidate)
    lines = [f"baseline {baseline_path} vs candidate {candidate_path}",
             "environment changes:" if changes else "environment: identical versions",
             *changes, *reach_lines(baseline, candidate, None if show_all else HUNKS_SHOWN),
             *device_code_lines(baseline, candidate, candidate_path)]
    result = gate(baseline, candidate, max_ratio_growth, ratio_floor)
    return [*lines, format_result(result, show_all)], result
