"""Known kernel bugs: which failures a run expects, judged row by row, and which went away.

A real kernel bug is a finding (docs/findings.md), never an exclusion: the backend still runs
the cases that trigger it. ``expectations.json`` beside this module (package data) lists each
bug once, keyed by the backends it concerns, the releases that have it (a PEP 440 specifier
over one ``versions`` entry of the backend, e.g. ``amd-aiter <=0.1.20.post1``), the condition
on the case under which it can show (case fields), and what it does: ``error``, a text the
backend's error contains, for a bug that raises; ``crash`` for one that takes its process
down; otherwise ``model``, the name of the bug's
model (:mod:`difftest.judgement.bug_rows`), which predicts from the case which rows and heads
it makes wrong, with ``nonfinite`` when they are NaN or inf.

At run time :func:`explain` judges each failing result (the runner calls it with the
comparison's :class:`~difftest.contract.compare.WrongElements`): it is those known bugs only
when every wrong element lies inside their predictions (non-finite where the symptom is) and
every other element agrees within tolerance; anything more makes it a new failure, with the
known part named. The verdict is recorded in the result (``known_bug``,
:class:`difftest.results.records.KnownBug`), so every reader of the report sees the same split.
:func:`judge` sorts a report's failing results by that record, and names every strict
expectation whose condition some case met on a matching release without the bug showing (like
a strict xfail): the bug may be fixed, so the entry must be revisited; an entry marked
``"strict": false`` (a condition wider than the trigger) is then only reported.
``$DIFFTEST_EXPECTATIONS`` points at another file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from difftest.case.selection import build_rows
from difftest.case.spec import Case, CaseError
from difftest.contract.backend import RunInputs
from difftest.contract.compare import WrongElements
from difftest.judgement.bug_rows import MODELS
from difftest.primitives.jsonfile import JSONFileError, read_json
from difftest.primitives.text import printable
from difftest.results.records import (
    FAILING,
    CaseRecord,
    FindingRows,
    KnownBug,
    ResultRecord,
    Status,
    row_ranges,
)

FILE_ENV = "DIFFTEST_EXPECTATIONS"
DEFAULT_FILE = Path(__file__).resolve().parent / "expectations.json"
_FIELD_TESTS = ("min", "max", "equals")


class ExpectationError(ValueError):
    """The expectations file is malformed; the message names the file, the entry and field."""


@dataclass(frozen=True)
class Expectation:
    """One known bug: ``finding`` (e.g. ``F21``), the backend base names it concerns, the
    version key and releases that have it, the condition under which it can show, and what
    it does: the ``error`` it raises, or the ``model`` (:data:`difftest.judgement.bug_rows.MODELS`)
    that predicts the rows and heads it makes wrong (``nonfinite``: NaN or inf there)."""

    finding: str
    summary: str
    backends: tuple[str, ...]
    version_key: str
    releases: SpecifierSet
    when: Mapping[str, Mapping[str, Any]]
    nonfinite: bool = False
    error: str = ""
    strict: bool = True
    model: str = ""

    def predict(self, inputs: RunInputs) -> torch.Tensor:
        """``[total_q, num_q_heads]`` bool on the host: where this bug may make the output of
        ``inputs.case`` wrong (nowhere for an error, or an entry without a model)."""
        case = inputs.case
        if self.error or self.model not in MODELS:
            return torch.zeros((case.total_q, case.num_q_heads), dtype=torch.bool)
        return MODELS[self.model](inputs).to(device="cpu", dtype=torch.bool)
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

    def explained(self, inputs: RunInputs, wrong: WrongElements) -> torch.Tensor:
        """``[total_q, num_q_heads]``: the wrong rows and heads of a disagreement on
        ``inputs.case`` that this bug explains: inside its prediction, and where its symptom
        is a non-finite output, with no finite element wrong there."""
        inside = self.predict(inputs) & wrong.wrong
        return inside & ~wrong.finite_wrong if self.nonfinite else inside


def explain(expectations: Iterable[Expectation], inputs: RunInputs, result: ResultRecord,
            wrong: WrongElements | None) -> KnownBug | None:
    """The known bugs in ``result`` (failing) of ``inputs.case``, judged from their models and
    where the output was wrong (``wrong``, for a disagreement), or ``None`` when no known bug
    explains any of it. A crash is a known bug marked ``crash``; an error, one whose
    ``error`` text its detail contains; a
    disagreement is the known bugs whose models explain its wrong rows and heads
    (:meth:`Expectation.explained`): wholly, or, with anything left unexplained (rows, heads,
    finite elements where the bug writes NaN, an empty row's violation), as a new failure
    with the known part named."""
    case = inputs.case.to_dict()
    met = [e for e in expectations if e.concerns(result) and e.triggered_by(case)]
    if result.status is Status.CRASH:
        crashed = next((e for e in met if e.crash), None)
        return None if crashed is None else KnownBug((FindingRows(crashed.finding, None),),
                                                     False)
    if result.status is Status.ERROR:
        raised = next((e for e in met if e.error and e.error in result.detail), None)
        return None if raised is None else KnownBug((FindingRows(raised.finding, None),), False)
    if wrong is None:
        return None
    covered = torch.zeros_like(wrong.wrong)
    parts = []
    for expectation in (e for e in met if not e.error):
        explained = expectation.explained(inputs, wrong)
        if bool(explained.any()):
            parts.append(FindingRows(expectation.finding,
                                     row_ranges(explained.any(dim=1).nonzero()[:, 0].tolist())))
            covered |= explained
    if not parts:
        return None
    left = (wrong.wrong & ~covered).any(dim=1) | wrong.violations
    return KnownBug(tuple(parts), bool(left.any()), row_ranges(left.nonzero()[:, 0].tolist()))


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


@dataclass
class Judgement:
    """A run's failing results sorted by their recorded verdicts (``ResultRecord.known_bug``):
    ``known``: per finding, the results known bugs explain wholly; ``partly``: per finding,
    the new failures it explains a part of; ``new``: every new failure (those included)."""

    new: list[tuple[CaseRecord, ResultRecord]] = field(default_factory=list)
    known: dict[str, list[tuple[CaseRecord, ResultRecord]]] = field(default_factory=dict)
    partly: dict[str, list[tuple[CaseRecord, ResultRecord]]] = field(default_factory=dict)
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
                       f"{', '.join(printable(b) for b in backends)} (docs/findings.md {finding}); "
                       "not new failures")
        for finding, hits in sorted(self.partly.items()):
            backends = sorted({result.backend for _, result in hits})
            out.append(f"NEW FAILURE BEYOND KNOWN BUG {finding}: {len(hits)} result(s) on "
                       f"{', '.join(printable(b) for b in backends)} are wrong outside what "
                       f"{finding} makes wrong (docs/findings.md {finding}); new failures")
        for finding, matching in sorted(self.unseen.items()):
            tail = ("its condition is wider than what triggers it, so this is not a failure"
                    if finding in self.loose else
                    "fixed? revisit its entry in the expectations file")
            out.append(f"EXPECTED BUG NOT SEEN {finding}: {matching} result(s) met its "
                       f"condition on a release listed as having it and none failed; {tail}")
        return out


_ENTRY_FIELDS = {"finding": str, "summary": str, "backends": list, "releases": str,
                 "when": dict, "nonfinite": bool, "error": str, "strict": bool, "model": str,
                 "crash": bool}


def _expectation(entry: Any, where: str) -> Expectation:
    if not isinstance(entry, dict):
        raise ExpectationError(f"{where}: an object is needed")
    for name, value in entry.items():
        kind = _ENTRY_FIELDS.get(name)
        if kind is None:
            raise ExpectationError(f"{where}.{name}: not a field of an expectation (allowed: "
                                   f"{', '.join(_ENTRY_FIELDS)})")
        if not isinstance(value, kind) or (name == "backends" and not all(
                isinstance(b, str) for b in value)):
            raise ExpectationError(f"{where}.{name}: {value!r:.60} is not a "
                                   f"{'list of strings' if kind is list else kind.__name__}")
    missing = next((n for n in ("finding", "backends", "releases") if n not in entry), None)
    if missing:
        raise ExpectationError(f"{where}: missing field {missing!r}")
    try:
        when = entry.get("when", {})
        for name, test in when.items():
            if not isinstance(test, dict) or not set(test) <= set(_FIELD_TESTS) or not test:
                raise ExpectationError(f"{where}.when.{name}: an object with "
                                       f"{', '.join(_FIELD_TESTS)} is needed")
        error, model = entry.get("error", ""), entry.get("model", "")
        if not error and not entry.get("crash") and model not in MODELS:
            raise ExpectationError(f"{where}.model: {model!r} is not a bug model (allowed: "
                                   f"{', '.join(MODELS)}; or an 'error' text for a bug that "
                                   "raises, or 'crash': true)")
        key, _, specifier = entry["releases"].partition(" ")
        return Expectation(entry["finding"], entry.get("summary", ""),
                           tuple(entry["backends"]), key, SpecifierSet(specifier), when,
                           entry.get("nonfinite", False), error, entry.get("strict", True),
                           model, bool(entry.get("crash", False)))
    except KeyError as exc:
        raise ExpectationError(f"{where}: missing field {exc.args[0]!r}") from exc
    except InvalidSpecifier as exc:
        raise ExpectationError(f"{where}.releases: {exc} (e.g. 'amd-aiter <=0.1.20')") from exc


def load(path: Path | None = None) -> list[Expectation]:
    """The expectations of ``path`` (default ``$DIFFTEST_EXPECTATIONS`` or the checkout's
    ``expectations.json``; none when that file does not exist); :class:`ExpectationError`
    names the file and what is wrong in it (a directory, not JSON, a bad entry)."""
    from_env = path is None and bool(os.environ.get(FILE_ENV))
    path = path or Path(os.environ.get(FILE_ENV) or DEFAULT_FILE)
    if not path.exists():
        return []
    try:
        data = read_json(path)
    except JSONFileError as exc:
        raise ExpectationError(f"{exc}" + (f" (${FILE_ENV})" if from_env else "")) from exc
    entries = data.get("expectations") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ExpectationError(f"{path}: an object with an 'expectations' array is needed")
    return [_expectation(entry, f"{path}: expectations[{i}]") for i, entry in enumerate(entries)]


def judge(cases: Iterable[CaseRecord], expectations: list[Expectation]) -> Judgement:
    """Sort every failing result of ``cases`` by its recorded verdict (``known_bug``) into
    new failures and known bugs, and find the expected bugs (``expectations``) that did not
    show."""
    judgement = Judgement()
    matching: dict[str, int] = {}
    seen: set[str] = set()
    for case in cases:
        for result in case.results:
            for expectation in expectations:
                if expectation.concerns(result) and expectation.triggered_by(case.case) and (
                        result.status in (Status.AGREE, Status.DISAGREE, Status.ERROR)):
                    matching[expectation.finding] = matching.get(expectation.finding, 0) + 1
            if result.status not in FAILING:
                continue
            findings = result.known_bug.names if result.known_bug is not None else []
            seen.update(findings)
            sorted_into = judgement.known if result.is_known_bug else judgement.partly
            for finding in findings:
                sorted_into.setdefault(finding, []).append((case, result))
            if result.is_new_failure:
                judgement.new.append((case, result))
    judgement.unseen = {f: n for f, n in matching.items() if f not in seen}
    judgement.loose = frozenset(e.finding for e in expectations if not e.strict)
    return judgement
