"""The AITER bump gate: is a candidate report safe against a baseline on the same case set?

Every (case id, backend) of the baseline is judged against the candidate, by each result's
recorded verdict (``known_bug``, :class:`difftest.results.records.KnownBug`): a failing result
is a known bug (known kernel bugs explain all of it) or a new failure. The gate fails on

* an empty baseline (nothing to compare with is no pass);
* a case of the baseline missing from the candidate (the case set shrank), or a backend's
  result missing from a case;
* a new failure in the candidate where the baseline had none, or of another status (e.g. a
  disagreement became a crash), known bugs in it or not (``new disagree``,
  ``new disagree beyond known bug F28``);
* a known bug the candidate shows where the baseline agreed (``known bug F23 newly shows``):
  the bump brought it;
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

A known bug that stays (``still known bug F28``) or turns into another known bug
(``known bug F25 -> F21``), a failure that became a known bug, a newly supported case
showing a known bug, fixed cases (a known bug or a failure that now agrees), cases new in the
candidate and cases the candidate newly supports (its release runs what the baseline's
reported ``unsupported``) are listed but never fail the gate; a newly supported case that
fails anew does. Reports that list a backend twice in one case are refused
(:class:`GateError`: which result would be judged?).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from difftest.machine.fingerprint import comparable
from difftest.primitives.text import printable
from difftest.reporting.report import backend_twice, case_records
from difftest.results.artifacts import repro_command
from difftest.results.records import FAILING, NOT_RUN, CaseRecord, ResultRecord, Status

DEFAULT_MAX_RATIO_GROWTH = 2.0
DEFAULT_RATIO_FLOOR = 0.5
HUNKS_SHOWN = 5  # unreached hunks listed per changed file (all with --all)


class GateError(ValueError):
    """A report the gate cannot judge (a backend listed twice in one case); the message names
    the side, the case and the backend."""


@dataclass(frozen=True)
class GateRow:
    """The verdict on one (case, backend); ``None`` statuses mean the entry is missing. A
    status of a failing result names its known bugs: ``disagree [F28]`` when they explain it
    wholly, ``disagree [beyond F28]`` for a new failure with a known part."""

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


def _status(result: ResultRecord) -> str:
    """``disagree``, ``disagree [F28]`` (a known bug), ``disagree [beyond F28]``."""
    if result.known_bug is None or result.status not in FAILING:
        return result.status.value
    beyond = "" if result.is_known_bug else "beyond "
    return f"{result.status.value} [{beyond}{_findings(result)}]"


def _findings(result: ResultRecord) -> str:
    return ", ".join(result.known_bug.names) if result.known_bug is not None else ""


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
    if cand.is_known_bug:
        known = _findings(cand)
        if base.is_known_bug:
            was = _findings(base)
            return ((f"still known bug {known}", False) if was == known
                    else (f"known bug {was} -> {known}", False))
        if b in FAILING:
            return (f"now known bug {known} (was a new {b.value})", False)
        if b in NOT_RUN:
            return (f"newly supported: known bug {known}", False)
        return (f"known bug {known} newly shows", True)
    beyond = (f" beyond known bug {_findings(cand)}"
              if cand.is_new_failure and cand.known_bug is not None else "")
    if b is Status.UNSUPPORTED and c not in NOT_RUN:  # the candidate's release runs it
        return (f"newly supported, {c.value}{beyond}" if c in FAILING else "newly supported",
                c in FAILING)
    if cand.is_new_failure and (c != b or base.is_known_bug):
        return (f"new {c.value}{beyond}", True)
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
    for side, records in (("baseline", base_cases), ("candidate", cand_list)):
        twice = backend_twice(records)
        if twice:
            raise GateError(f"the {side}: {twice}")
    if not base_cases:
        findings.append("the baseline holds no case: nothing was compared (an empty baseline "
                        "is no pass)")
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
                case.case_id, case.name, backend, base and _status(base),
                base and base.ratio, cand and _status(cand), cand and cand.ratio,
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
    return [f"case {printable(case_id)} is listed {n} times in the {side} (each case once; "
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
        (printable(r.case_id), printable(r.name) or "-", printable(r.backend),
         r.baseline_status or "-",
         _fmt_ratio(r.baseline_ratio), r.candidate_status or "-", _fmt_ratio(r.candidate_ratio),
         ("FAIL " if r.fails else "") + printable(r.verdict))
        for r in sorted(shown, key=lambda r: (not r.fails, r.case_id, r.backend))
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in table] if shown else []
    lines += [f"FAIL {printable(finding)}" for finding in result.backend_findings]
    same = sum(r.verdict == "same" for r in result.rows)
    failing = sum(r.fails for r in result.rows) + len(result.backend_findings)
    pairs = sum(r.backend != "*" for r in result.rows)
    tail = f"{result.compared} baseline cases, {pairs} (case, backend) pairs, {same} unchanged"
    known = [r for r in result.rows if not r.fails and "known bug" in r.verdict]
    if known:
        tail += f", {len(known)} known bug(s) not regressions"
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
             *map(printable, [*changes, *reach_lines(baseline, candidate,
                                                     None if show_all else HUNKS_SHOWN),
                              *device_code_lines(baseline, candidate, candidate_path)])]
    result = gate(baseline, candidate, max_ratio_growth, ratio_floor)
    return [*lines, format_result(result, show_all)], result
