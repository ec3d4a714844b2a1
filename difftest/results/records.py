"""The record of one case, as reports, failure artifacts and run logs hold it: one type, one
writer, one reader.

Every producer (the session's results, a crash found later, the pytest plug-in's run log)
builds a :class:`CaseRecord`, with a :class:`ResultRecord` per backend under test, and
:meth:`CaseRecord.to_dict` is the only code that turns one into JSON. Every consumer (the
summary, ``gate``, ``merge``, ``plot``, the coverage table, replays) reads an entry back with
:meth:`CaseRecord.from_dict`, which checks every field, the comparison and its worst
locations included; a :class:`RecordError` names the field, e.g.
``cases[3].results[0].status: 'pass' is not a status (allowed: agree, ...)``, and the
readers of files put the file's name in front. The
status names live here (:class:`Status`). Fields are documented in docs/report-schema.md.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

from difftest.contract.compare import Comparison
from difftest.contract.kernel_call import KernelCall
from difftest.primitives.jsonfile import number


class Status(enum.Enum):
    """The verdict of one backend on one case, in the summary's column order."""

    AGREE = "agree"
    DISAGREE = "disagree"
    ERROR = "error"
    CRASH = "crash"
    UNSUPPORTED = "unsupported"
    UNAVAILABLE = "unavailable"


STATUSES = tuple(s.value for s in Status)
FAILING = frozenset({Status.DISAGREE, Status.ERROR, Status.CRASH})
NOT_RUN = frozenset({Status.UNSUPPORTED, Status.UNAVAILABLE})


# The ``features`` entry (:func:`difftest.results.features.case_features`): field -> type.
FEATURE_TYPES: dict[str, Any] = {
    "query_dtype": str, "kv_dtype": str, "kv_layout": str, "decode_query_len": int,
    "num_blocks": int, "max_page_id": int, "context_lens": list[int],
    "last_block_attended": bool, "block_0_attended": bool, "page_ids_past_2_16": int,
    "report_boundary_2039": bool, "one_token_tail": bool, "empty_rows": int,
    "scales": list[float],
}


class RecordError(ValueError):
    """An entry lacks a field of a difftest record, has one it must not, or a wrong value."""


T = TypeVar("T")


def _read(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the type ``hint`` (as a record field declares it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _read(value, inner, where)
    if hint is Any:
        return value
    if hint is float:
        try:
            return number(value, where)
        except ValueError as exc:
            raise RecordError(str(exc)) from None
    if hint in (bool, int, str):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise RecordError(f"{where}: expected {_kind(hint)}, got {_shown(value)}")
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [m.value for m in hint]
        if value not in allowed:
            raise RecordError(f"{where}: {value!r:.80} is not a {hint.__name__.lower()} "
                              f"(allowed: {', '.join(map(str, allowed))})")
        return hint(value)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected an array, got {_shown(value)}")
        items = [_read(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        entry = _object(value, where)
        return {k: _read(v, args[1], _at(where, k)) for k, v in entry.items()}
    if dataclasses.is_dataclass(hint):  # READ_OPTIONAL: fields older reports lack
        return read_entry(hint, value, where,  # type: ignore[arg-type]
                          frozenset(getattr(hint, "READ_OPTIONAL", frozenset())))
    raise TypeError(f"{where}: no reader for {hint!r}")  # a record field of a new kind


def read_entry(cls: type[T], value: Any, where: str,
               optional: frozenset[str] = frozenset()) -> T:
    """``cls(**fields)`` from the JSON object ``value`` at field path ``where`` (``""`` for a
    file's top level): every field of the dataclass ``cls`` present (those in ``optional``
    may be absent and take their default), none unknown, each of its declared type."""
    entry = _object(value, where)
    hints, names = _fields(cls)
    unknown = sorted(set(entry) - set(names))
    if unknown:
        raise RecordError(f"{_at(where, unknown[0])}: not a field of this entry "
                          f"(allowed: {', '.join(names)})")
    values = {}
    for name in names:
        if name in entry:
            values[name] = _read(entry[name], hints[name], _at(where, name))
        elif name not in optional:
            raise RecordError(f"{_at(where, name)}: missing")
    try:
        return cls(**values)
    except RecordError as exc:  # a check across fields (__post_init__)
        raise RecordError(f"{where or 'top level'}: {exc}") from None


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The type of each field of ``cls``, and the names of those JSON holds, in order."""
    return typing.get_type_hints(cls), tuple(
        f.name for f in dataclasses.fields(cls) if f.metadata.get("json", True))


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"{where or 'top level'}: expected an object, got {_shown(value)}")
    return value


def _kind(hint: type) -> str:
    return {bool: "true or false", int: "an integer", str: "a string"}[hint]


def _shown(value: Any) -> str:
    kind = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r:.80}" if value is not None else kind


def row_ranges(rows: Iterable[int]) -> list[list[int]]:
    """Sorted query rows as inclusive ``[first, last]`` ranges (``[0, 1, 2, 5]`` ->
    ``[[0, 2], [5, 5]]``): how a record holds rows, bounded by the runs, not the rows."""
    ranges: list[list[int]] = []
    for row in sorted(set(rows)):
        if ranges and ranges[-1][1] == row - 1:
            ranges[-1][1] = row
        else:
            ranges.append([row, row])
    return ranges


def ranges_text(ranges: Iterable[Sequence[int]]) -> str:
    """``[[0, 2], [5, 5]]`` as ``0..2, 5``."""
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges) or "none"


def _check_ranges(ranges: list[list[int]], name: str) -> None:
    for pair in ranges:
        if len(pair) != 2 or not 0 <= pair[0] <= pair[1]:
            raise RecordError(f"{name}: {pair!r:.40} is not a range (allowed: [first, last] "
                              "with 0 <= first <= last)")


@dataclass(frozen=True)
class FindingRows:
    """One known kernel bug's part of a failing result: its finding (docs/findings.md) and the
    query rows whose wrong elements the bug's model predicts, as :func:`row_ranges`;
    ``rows`` is ``None`` for an error the bug raises (the whole result)."""

    finding: str
    rows: list[list[int]] | None

    def __post_init__(self) -> None:
        _check_ranges(self.rows or [], "rows")

    def describe(self) -> str:
        """``F28 (rows 0..3)``, or ``F25 (its error)``."""
        where = "its error" if self.rows is None else f"rows {ranges_text(self.rows)}"
        return f"{self.finding} ({where})"


@dataclass(frozen=True)
class KnownBug:
    """The known kernel bugs in a failing result, as the run judged them from the bugs' models
    (:mod:`difftest.judgement.expectations`): ``findings``, each with the rows it explains;
    ``new_failure`` when anything else is wrong too (elements outside every model's
    prediction, an empty row's violation), which makes the result a new failure with the known
    part named; ``unexplained_rows``: the rows wrong outside every prediction
    (:func:`row_ranges`)."""

    findings: tuple[FindingRows, ...]
    new_failure: bool
    unexplained_rows: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_ranges(self.unexplained_rows, "unexplained_rows")
        if not self.findings:
            raise RecordError("findings: empty (a known bug names at least one finding)")

    @property
    def names(self) -> list[str]:
        """The findings, in order (``["F22", "F24"]``)."""
        return [f.finding for f in self.findings]

    def describe(self) -> str:
        """One line: ``known bug F28 (rows 0..3)``, or for a new failure ``new failure beyond
        known bug F28 (rows 0..3): rows 4 wrong outside its model``."""
        known = ", ".join(f.describe() for f in self.findings)
        if not self.new_failure:
            return f"known bug {known}"
        return (f"new failure beyond known bug {known}: rows "
                f"{ranges_text(self.unexplained_rows)} wrong outside its model")

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry (``ResultRecord.known_bug``)."""
        return {"findings": [{"finding": f.finding, "rows": f.rows} for f in self.findings],
                "new_failure": self.new_failure, "unexplained_rows": self.unexplained_rows}


@dataclass
class ResultRecord:
    """What one backend did on one case, as recorded.

    ``known_bug`` (set by the run on a failing result that a known kernel bug explains, in
    whole or in part): :attr:`is_known_bug` and :attr:`is_new_failure` are the one reading
    of it for every consumer (the verdict, ``gate``, ``merge``, ``repro``, ``plot``, the
    pytest plug-in)."""

    backend: str
    status: Status
    seconds: float = 0.0
    detail: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    comparison: Comparison | None = None
    output_sha256: str | None = None
    calls: list[KernelCall] = field(default_factory=list)  # what the backend stated it ran
    known_bug: KnownBug | None = None

    # reports before them (schema difftest.report/1 had no known_bug)
    READ_OPTIONAL: ClassVar[frozenset[str]] = frozenset({"calls", "known_bug"})

    @property
    def is_known_bug(self) -> bool:
        """A failing result that known kernel bugs explain wholly: not a new failure."""
        return (self.status in FAILING and self.known_bug is not None
                and not self.known_bug.new_failure)

    @property
    def is_new_failure(self) -> bool:
        """A failing result (disagree, error, crash) that no known bug explains wholly."""
        return self.status in FAILING and not self.is_known_bug

    @property
    def ratio(self) -> float | None:
        """The comparison's greatest error/tolerance, ``None`` when nothing was compared."""
        return None if self.comparison is None else self.comparison.max_ratio

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry (non-finite numbers stay floats; the JSON writer encodes them)."""
        return {"backend": self.backend, "status": self.status.value, "seconds": self.seconds,
                "detail": self.detail, "versions": dict(self.versions),
                "comparison": None if self.comparison is None else self.comparison.to_dict(),
                "output_sha256": self.output_sha256,
                "calls": [dataclasses.asdict(c) for c in self.calls],
                "known_bug": None if self.known_bug is None else self.known_bug.to_dict()}

    @classmethod
    def from_dict(cls, value: Any, where: str) -> ResultRecord:
        """Read an entry back (its comparison, worst locations and stated calls included);
        :class:`RecordError` names ``where`` and the field."""
        return read_entry(cls, value, where, cls.READ_OPTIONAL)


@dataclass(frozen=True)
class PytestOrigin:
    """Where a pytest run's record came from: the xdist worker (``main`` without xdist) and
    the test; ``None`` for a crash recovered where neither is known."""

    worker: str | None
    nodeid: str | None


@dataclass
class CaseRecord:
    """One case's entry of a report (and a failure directory's ``results.json``).

    ``unjudged`` and ``plugins`` are set on crash records only (the backends the crash kept
    from running, and the plug-ins of the process that died) and written only when set.
    Records of pytest runs carry ``pytest`` (written as the fields ``worker`` and ``nodeid``);
    other records carry neither field.
    """

    case_id: str
    name: str
    case: dict[str, Any]
    features: dict[str, Any]
    reference: str
    results: list[ResultRecord]
    timings: dict[str, float] = field(default_factory=dict)
    artifact: str | None = None
    unjudged: list[str] | None = None
    plugins: list[str] | None = None
    pytest: PytestOrigin | None = field(default=None, metadata={"json": False})

    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("unjudged", "plugins")
    PYTEST_FIELDS: ClassVar[tuple[str, ...]] = ("worker", "nodeid")

    @property
    def failed(self) -> bool:
        """Whether any backend disagreed, errored or crashed."""
        return any(r.status in FAILING for r in self.results)

    @property
    def new_failures(self) -> list[ResultRecord]:
        """The failing results no known bug explains wholly
        (:attr:`ResultRecord.is_new_failure`)."""
        return [r for r in self.results if r.is_new_failure]

    def in_pytest(self, worker: str | None, nodeid: str | None) -> CaseRecord:
        """This record as a pytest run logs it (``worker``, ``nodeid``)."""
        return dataclasses.replace(self, pytest=PytestOrigin(worker, nodeid))

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry: the fields every record has, then the optional ones that are set."""
        entry: dict[str, Any] = {
            "case_id": self.case_id, "name": self.name, "case": self.case,
            "features": self.features, "reference": self.reference,
            "results": [r.to_dict() for r in self.results], "timings": dict(self.timings),
            "artifact": self.artifact,
        }
        for key in self.WRITTEN_WHEN_SET:
            if getattr(self, key) is not None:
                entry[key] = list(getattr(self, key))
        if self.pytest is not None:
            entry |= {"worker": self.pytest.worker, "nodeid": self.pytest.nodeid}
        return entry

    @classmethod
    def from_dict(cls, value: Any, where: str) -> CaseRecord:
        """Read an entry back, checking every field; :class:`RecordError` names ``where``
        (e.g. ``cases[3]``) and the field."""
        entry = dict(_object(value, where))
        origin = None
        if any(k in entry for k in cls.PYTEST_FIELDS):
            origin = read_entry(PytestOrigin, {k: entry.pop(k, None)
                                               for k in cls.PYTEST_FIELDS}, where)
        record = read_entry(cls, entry, where, frozenset(cls.WRITTEN_WHEN_SET))
        record.pytest = origin
        _check_case(record, where)
        record.features = _read_features(record.features, f"{where}.features")
        return record


def _check_case(record: CaseRecord, where: str) -> None:
    schema, case_id = record.case.get("schema"), record.case.get("id")
    if schema != "difftest.case/1":
        raise RecordError(f"{where}.case.schema: {schema!r}, expected 'difftest.case/1'")
    if case_id != record.case_id:
        raise RecordError(f"{where}.case.id: {case_id!r} is not the entry's case_id "
                          f"{record.case_id!r}")


def _read_features(value: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(value) - set(FEATURE_TYPES))
    if unknown:
        raise RecordError(f"{where}.{unknown[0]}: not a feature "
                          f"(allowed: {', '.join(FEATURE_TYPES)})")
    missing = [k for k in FEATURE_TYPES if k not in value]
    if missing:
        raise RecordError(f"{where}.{missing[0]}: missing")
    return {k: _read(value[k], hint, f"{where}.{k}") for k, hint in FEATURE_TYPES.items()}
