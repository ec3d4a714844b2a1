"""Known kernel bugs: which disagreements a run expects, and which expected ones went away.

A real kernel bug is a finding (docs/findings.md), never an exclusion: the backend still runs
the cases that trigger it. ``expectations.json`` beside this module (package data) lists each bug
once, keyed by the backends it concerns, the releases that have it (a PEP 440 specifier over
one ``versions`` entry of the backend, e.g. ``amd-aiter <=0.1.20.post1``) and the condition
on the case that triggers it (case fields, plus ``nonfinite`` when the symptom is a
non-finite output, ``error``, a text the backend's error contains, when it raises, or
``crash`` when it takes its process down).
:func:`judge` sorts a report's failing results into new failures and known bugs, and names
every expectation whose condition some case of the run met on a matching release without the
bug showing (like a strict xfail): the bug may be fixed, so the entry must be revisited; an
entry marked ``"strict": false`` (a condition wider than the trigger) is then only reported.
``$DIFFTEST_EXPECTATIONS`` points at another file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from difftest.case.selection import build_rows
from difftest.case.spec import Case, CaseError
from difftest.results.records import FAILING, CaseRecord, ResultRecord, Status

FILE_ENV = "DIFFTEST_EXPECTATIONS"
DEFAULT_FILE = Path(__file__).resolve().parent / "expectations.json"
_FIELD_TESTS = ("min", "max", "equals")


class ExpectationError(ValueError):
    """The expectations file is malformed; the message names the entry and field."""


@dataclass(frozen=True)
class Expectation:
    """One known bug: ``finding`` (e.g. ``F21``), the backend base names it concerns, the
    version key and releases that have it, and its triggering condition."""

    finding: str
    summary: str
    backends: tuple[str, ...]
    version_key: str
    releases: SpecifierSet
    when: Mapping[str, Mapping[str, Any]]
    nonfinite: bool = False
    error: str = ""
    strict: bool = True
    crash: bool = False

    def concerns(self, result: ResultRecord) -> bool:
        """Whether ``result`` comes from a backend and release this bug is known in."""
        if result.backend.partition("[")[0] not in self.backends:
            return False
        version = result.versions.get(self.version_key)
        try:
            return version is not None and Version(version) in self.releases
        except InvalidVersion:
            return False

    def triggered_by(self, case: Mapping[str, Any]) -> bool:
        """Whether the case meets the condition (absent fields read as 0/false; ``topk``
        and ``max_seqlen_k``, the longest selection and it times the block size,
        ``k_view_elements``, the elements of the K page view, and ``longest_context``, the
        most tokens a row attends, derived)."""
        derived = {"topk": max((len(row) for row in case.get("selections", ())), default=0)}
        derived["max_seqlen_k"] = derived["topk"] * case.get("block_size", 128)
        for name, derive in GEOMETRY.items():
            if name in self.when:
                derived[name] = _derived(case, derive)
        for name, test in self.when.items():
            value = case.get(name, derived.get(name, 0))
            if "equals" in test and value != test["equals"]:
                return False
            if "min" in test and not (isinstance(value, int | float) and value >= test["min"]):
                return False
            if "max" in test and not (isinstance(value, int | float) and value <= test["max"]):
                return False
        return True

    def explains(self, case: CaseRecord, result: ResultRecord) -> bool:
        """Whether this bug explains ``result`` of ``case``: a disagreement, or with
        ``error`` an error whose detail contains it."""
        if not self.concerns(result) or not self.triggered_by(case.case):
            return False
        if self.crash:
            return result.status is Status.CRASH
        if self.error:
            return result.status is Status.ERROR and self.error in result.detail
        if result.status is not Status.DISAGREE:
            return False
        return not self.nonfinite or (result.comparison is not None
                                      and result.comparison.nonfinite > 0)


# conditions derived from the case's geometry, computed only for the entries that name them
GEOMETRY: dict[str, Callable[[Case], int]] = {
    "k_view_elements": lambda c: c.k_view_pages * c.page_size * c.num_kv_heads * c.head_dim,
    "longest_context": lambda c: max((r.context_len for r in build_rows(c)), default=0),
}


def _derived(case: Mapping[str, Any], derive: Callable[[Case], int]) -> int:
    """``derive`` of the case (0 for a dict that is no valid case)."""
    try:
        return derive(Case.from_dict(dict(case)))
    except (CaseError, TypeError, ValueError):
        return 0


def known_bug(expectations: Iterable[Expectation], case: Mapping[str, Any],
              result: ResultRecord) -> str | None:
    """The finding of the first expectation that explains ``result`` on ``case`` (a case's
    dict), else ``None``."""
    record = CaseRecord(case_id=str(case.get("id", "")), name="", case=dict(case),
                        features={}, reference="", results=[result])
    return next((e.finding for e in expectations if e.explains(record, result)), None)


@dataclass
class Judgement:
    """A run's failing results sorted by the expectations."""

    new: list[tuple[CaseRecord, ResultRecord]] = field(default_factory=list)
    known: dict[str, list[tuple[CaseRecord, ResultRecord]]] = field(default_factory=dict)
    unseen: dict[str, int] = field(default_factory=dict)  # finding -> matching results
    loose: frozenset[str] = frozenset()  # findings whose condition is wider than the trigger

    @property
    def strict_unseen(self) -> list[str]:
        """The expected bugs not seen whose entries are strict (each a failure of the run)."""
        return sorted(set(self.unseen) - self.loose)

    @property
    def failed(self) -> bool:
        """New failures, or a strict expected bug that no longer shows."""
        return bool(self.new or self.strict_unseen)

    def lines(self) -> list[str]:
        """What the run met of the expectations, one line per known bug."""
        out = []
        for finding, hits in sorted(self.known.items()):
            backends = sorted({result.backend for _, result in hits})
            out.append(f"KNOWN BUG {finding}: {len(hits)} failure(s) on "
                       f"{', '.join(backends)} (docs/findings.md {finding}); not new failures")
        for finding, matching in sorted(self.unseen.items()):
            tail = ("its condition is wider than what triggers it, so this is not a failure"
                    if finding in self.loose else
                    "fixed? revisit its entry in the expectations file")
            out.append(f"EXPECTED BUG NOT SEEN {finding}: {matching} result(s) met its "
                       f"condition on a release listed as having it and none failed; {tail}")
        return out


def _expectation(entry: Any, where: str) -> Expectation:
    if not isinstance(entry, dict):
        raise ExpectationError(f"{where}: an object is needed")
    try:
        when = entry.get("when", {})
        for name, test in when.items():
            if not isinstance(test, dict) or not set(test) <= set(_FIELD_TESTS) or not test:
                raise ExpectationError(f"{where}.when.{name}: an object with "
                                       f"{', '.join(_FIELD_TESTS)} is needed")
        key, _, specifier = str(entry["releases"]).partition(" ")
        return Expectation(str(entry["finding"]), str(entry.get("summary", "")),
                           tuple(entry["backends"]), key, SpecifierSet(specifier), when,
                           bool(entry.get("nonfinite", False)), str(entry.get("error", "")),
                           bool(entry.get("strict", True)), bool(entry.get("crash", False)))
    except KeyError as exc:
        raise ExpectationError(f"{where}: missing field {exc.args[0]!r}") from exc
    except InvalidSpecifier as exc:
        raise ExpectationError(f"{where}.releases: {exc} (e.g. 'amd-aiter <=0.1.20')") from exc


def load(path: Path | None = None) -> list[Expectation]:
    """The expectations of ``path`` (default ``$DIFFTEST_EXPECTATIONS`` or the checkout's
    ``expectations.json``; none when that file is absent)."""
    path = path or Path(os.environ.get(FILE_ENV) or DEFAULT_FILE)
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    entries = data.get("expectations") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ExpectationError(f"{path}: an object with an 'expectations' array is needed")
    return [_expectation(entry, f"{path}: expectations[{i}]") for i, entry in enumerate(entries)]


def judge(cases: Iterable[CaseRecord], expectations: list[Expectation]) -> Judgement:
    """Sort every failing result of ``cases`` into new failures and known bugs, and find the
    expected bugs that did not show."""
    judgement = Judgement()
    matching: dict[str, int] = {}
    shown: set[str] = set()
    for case in cases:
        for result in case.results:
            for expectation in expectations:
                if expectation.concerns(result) and expectation.triggered_by(case.case) and (
                        result.status in (Status.AGREE, Status.DISAGREE, Status.ERROR)):
                    matching[expectation.finding] = matching.get(expectation.finding, 0) + 1
            if result.status not in FAILING:
                continue
            known = next((e for e in expectations if e.explains(case, result)), None)
            if known is None:
                judgement.new.append((case, result))
            else:
                shown.add(known.finding)
                judgement.known.setdefault(known.finding, []).append((case, result))
    judgement.unseen = {f: n for f, n in matching.items() if f not in shown}
    judgement.loose = frozenset(e.finding for e in expectations if not e.strict)
    return judgement
