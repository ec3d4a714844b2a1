"""Reading a case file a user gives (``difftest repro``, ``difftest promote``).

A case file is untrusted input: every field's JSON type is checked against the field's
declared type, by name, before :meth:`Case.from_dict` checks the ranges, so a wrong type, a
missing field or a truncated file is a :class:`~difftest.case.spec.CaseError` or
:class:`CaseFileError` naming the file, the field and the value, never a ``TypeError`` from
deep inside.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from difftest.case.spec import Case, CaseError
from difftest.primitives.jsonfile import (
    MAX_DEPTH,
    JSONFileError,
    check_parse_cost,
    nesting_depth,
    read_bounded,
)

_MAX_VALUE_TEXT = 60
MAX_NAME = 1000  # characters of a case's name (a fitted variant names its changes)


class CaseFileError(ValueError):
    """A case file cannot be read; the message names the file, and the field if one is wrong."""


def _matches(hint: Any, value: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if hint is int:
        return isinstance(value, int)
    if hint is float:
        return isinstance(value, (int, float))
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return isinstance(value, list) and all(_matches(item, v) for v in value)
    raise TypeError(f"no JSON form for {hint!r}")


def _describe(hint: Any, plural: bool = False) -> str:
    if typing.get_origin(hint) is tuple:
        inner = _describe(typing.get_args(hint)[0], plural=True)
        return f"lists of {inner}" if plural else f"a list of {inner}"
    names = {bool: ("true or false", "booleans"), int: ("an integer", "integers"),
             float: ("a number", "numbers"), str: ("a string", "strings")}[hint]
    return names[plural]


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= _MAX_VALUE_TEXT else text[:_MAX_VALUE_TEXT - 3] + "..."


def case_from_object(data: Any) -> Case:
    """The case a parsed JSON object describes; :class:`CaseError` names a wrong field."""
    if not isinstance(data, dict):
        raise CaseError("case", f"is a JSON {type(data).__name__}", "a JSON object of fields")
    hints = typing.get_type_hints(Case)
    for field in dataclasses.fields(Case):
        if field.name not in data:
            if (field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING):
                raise CaseError(field.name, "is missing", "a required field")
        elif not _matches(hints[field.name], data[field.name]):
            raise CaseError(field.name, f"= {_shown(data[field.name])}",
                            _describe(hints[field.name]))
    name = data.get("name", "")
    if not name.isprintable() or len(name) > MAX_NAME:
        raise CaseError("name", f"= {_shown(name)}",
                        f"printable text of at most {MAX_NAME} characters (no newline or "
                        "control character: it is printed on one line)")
    return Case.from_dict(data)


def read_case_json(path: Path) -> Any:
    """The parsed JSON of ``path``; :class:`CaseFileError` names the file and the problem
    (also a file that is not a regular one, too large, or nested too deep:
    :func:`difftest.primitives.jsonfile.read_bounded`)."""
    if not path.exists():
        raise CaseFileError(f"cannot read {path}: No such file or directory")
    try:
        text = read_bounded(path)
        check_parse_cost(text, str(path))
    except JSONFileError as exc:
        raise CaseFileError(str(exc)) from exc
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise CaseFileError(f"{path}: nested {depth} deep (allowed: at most {MAX_DEPTH} "
                            "levels of arrays and objects)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CaseFileError(f"{path}: not JSON (truncated or corrupt?): {exc}") from exc


def read_case(path: Path) -> Case:
    """The case in the case file ``path``; errors name the file, the field and the value."""
    data = read_case_json(path)
    try:
        return case_from_object(data)
    except CaseError as exc:
        raise CaseFileError(f"{path}: {exc}") from exc
