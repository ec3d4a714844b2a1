"""Every report, case file and failure record a test writes follows the shipped JSON Schemas.

After each test, the JSON files written during it into the temporary directories of its
module (``tmp_path``, ``tmp_path_factory``) are read: one that difftest's own reader accepts
as a report (``read_report``), a case (``read_case``) or a failure's ``results.json``
(``read_results``) must validate against ``difftest/reporting/report.schema.json`` and
``difftest/case/case.schema.json``, or the test errors naming the file and the violation.
Files the readers refuse are malformed on purpose (tests of bad input) and left alone.
Without ``jsonschema`` (an offline setup that could not install it) nothing is validated, and
tests/test_schemas.py is skipped saying so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from difftest.case.spec import CASE_JSON_SCHEMA
from difftest.reporting.report import REPORT_JSON_SCHEMA

_created: list[Path] = []  # temporary directories made in the current module
_module: list[str] = [""]
_started: list[float] = [0.0]
_mktemp = pytest.TempPathFactory.mktemp


def _tracked_mktemp(self: pytest.TempPathFactory, basename: str, numbered: bool = True) -> Path:
    path = _mktemp(self, basename, numbered)
    _created.append(path)
    return path


pytest.TempPathFactory.mktemp = _tracked_mktemp  # type: ignore[method-assign]


def schema_validators() -> dict[str, Any] | None:
    """Validators of a report, a case and a case record (``None`` without jsonschema)."""
    try:
        from jsonschema import Draft202012Validator
        from referencing import Registry, Resource
    except ImportError:
        return None
    report = json.loads(REPORT_JSON_SCHEMA.read_text())
    case = json.loads(CASE_JSON_SCHEMA.read_text())
    registry = Registry().with_resources(
        [(s["$id"], Resource.from_contents(s)) for s in (report, case)])
    record = {"$ref": f"{report['$id']}#/$defs/case_record"}
    return {"report": Draft202012Validator(report, registry=registry),
            "case": Draft202012Validator(case, registry=registry),
            "record": Draft202012Validator(record, registry=registry)}


VALIDATORS = schema_validators()


def schema_kind(path: Path) -> str | None:
    """``report``, ``case`` or ``record`` for a file difftest's reader accepts as one."""
    from difftest.case.casefile import read_case
    from difftest.reporting.report import read_report
    from difftest.results.artifacts import read_results

    try:
        with open(path, encoding="utf-8") as fh:
            head = fh.read(4096)
    except (OSError, UnicodeDecodeError):
        return None
    readers = (("report", '"difftest.report/1"', read_report),
               ("record", '"case_id"', read_results), ("case", '"difftest.case/1"', read_case))
    for kind, mark, reader in readers:
        if mark in head:
            try:
                reader(path)
            except Exception:  # refused by difftest itself: malformed on purpose
                return None
            return kind
    return None


def schema_violations(path: Path) -> list[str]:
    """What in ``path`` breaks its schema (none: it validates, or it is no difftest file)."""
    kind = schema_kind(path)
    if VALIDATORS is None or kind is None:
        return []
    from jsonschema.exceptions import best_match

    from difftest.primitives.jsonfile import read_json

    document = read_json(path)
    # an error under anyOf (a field that may be null) is shown by its deepest cause
    errors = [best_match([e]) for e in VALIDATORS[kind].iter_errors(document)]
    return [f"{path} ({kind}): {'/'.join(map(str, e.absolute_path)) or 'top level'}: "
            f"{e.message[:300]}" for e in errors if e is not None][:5]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Note when the test starts, before its fixtures (a module's may write files too)."""
    module = item.nodeid.split("::")[0]
    if module != _module[0]:
        _module[0] = module
        _created.clear()
    _started[0] = time.time() - 1


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Fail the test (at teardown) on a written file that breaks its schema."""
    if VALIDATORS is None:
        return
    problems = []
    for directory in list(_created):
        for path in directory.rglob("*.json"):
            if path.is_file() and path.stat().st_mtime >= _started[0]:
                problems += schema_violations(path)
    if problems:
        pytest.fail("written files that break difftest's JSON Schemas:\n" + "\n".join(problems),
                    pytrace=False)
