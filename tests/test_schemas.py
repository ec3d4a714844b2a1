"""The JSON Schemas shipped with difftest: a case (difftest/case/case.schema.json) and a report
(difftest/reporting/report.schema.json) hold exactly the fields difftest's records have, and
what difftest writes validates (tests/conftest.py checks every file the tests write)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import VALIDATORS, schema_violations
from difftest.case import spec
from difftest.case.spec import CASE_JSON_SCHEMA, Case
from difftest.cli import main
from difftest.contract.compare import Comparison, Location
from difftest.contract.kernel_call import DeviceCode, KernelCall, StatedArgument
from difftest.generation.corpus import load_corpus
from difftest.primitives.dtypes import KV_DTYPES, QUERY_DTYPES
from difftest.reporting.report import (
    REPORT_JSON_SCHEMA,
    BackendEntry,
    MergedFrom,
    ReportFields,
    WorkerEntry,
)
from difftest.results.records import FEATURE_TYPES, STATUSES, CaseRecord, ResultRecord

ROOT = Path(__file__).resolve().parent.parent
REPORT = json.loads(REPORT_JSON_SCHEMA.read_text())
CASE = json.loads(CASE_JSON_SCHEMA.read_text())
needs_jsonschema = pytest.mark.skipif(VALIDATORS is None, reason="jsonschema is not installed "
                                      "(scripts/setup.sh --test installs it; offline it cannot)")


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("json", True)}


def _required(cls: type, optional: frozenset[str] = frozenset()) -> set[str]:
    return _fields(cls) - set(optional)


@pytest.mark.parametrize(("definition", "cls", "optional", "extra"), [
    ("result", ResultRecord, ResultRecord.READ_OPTIONAL, set()),
    ("case_record", CaseRecord, frozenset(CaseRecord.WRITTEN_WHEN_SET), set(
        CaseRecord.PYTEST_FIELDS)),
    ("comparison", Comparison, Comparison.READ_OPTIONAL, set()),
    ("location", Location, frozenset(), set()),
    ("kernel_call", KernelCall, KernelCall.READ_OPTIONAL, set()),
    ("device_code", DeviceCode, frozenset(), set()),
    ("argument", StatedArgument, frozenset(), set()),
    ("backend", BackendEntry, frozenset(), set()),
    ("worker", WorkerEntry, frozenset(), set()),
    ("merged_from", MergedFrom, frozenset(), set()),
    (None, ReportFields, ReportFields.OPTIONAL, set()),
], ids=lambda v: getattr(v, "__name__", None) if isinstance(v, type) else None)
def test_each_report_entry_has_exactly_the_record_fields(definition: str | None, cls: type,
                                                         optional: frozenset[str],
                                                         extra: set[str]) -> None:
    """A field added to a record (or dropped) without the schema fails here: the schema is
    the report format, versioned with it."""
    entry: dict[str, Any] = REPORT["$defs"][definition] if definition else REPORT
    assert entry["additionalProperties"] is False
    assert set(entry["properties"]) == _fields(cls) | extra
    assert set(entry["required"]) == _required(cls, optional)


def test_the_features_and_statuses_are_the_records_own() -> None:
    features = REPORT["$defs"]["features"]
    assert set(features["properties"]) == set(features["required"]) == set(FEATURE_TYPES)
    assert tuple(REPORT["$defs"]["result"]["properties"]["status"]["enum"]) == STATUSES
    assert REPORT["properties"]["schema"]["const"] == "difftest.report/1"


def test_the_case_schema_has_every_case_field_and_its_choices() -> None:
    properties = CASE["properties"]
    assert set(properties) == {f.name for f in dataclasses.fields(Case)} | {"schema", "id"}
    required = {f.name for f in dataclasses.fields(Case)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert set(CASE["required"]) == required
    assert properties["schema"]["const"] == spec.CASE_SCHEMA
    assert tuple(properties["query_dtype"]["enum"]) == QUERY_DTYPES
    assert tuple(properties["kv_dtype"]["enum"]) == KV_DTYPES
    assert tuple(properties["kv_layout"]["enum"]) == spec.ALL_LAYOUTS
    assert tuple(properties["head_dim"]["enum"]) == spec.HEAD_DIMS
    assert tuple(properties["distribution"]["enum"]) == spec.DISTRIBUTIONS
    assert tuple(properties["split_k_segments"]["enum"]) == (0, *spec.SPLIT_K_SEGMENTS)
    assert properties["num_blocks"]["maximum"] == spec.MAX_NUM_BLOCKS
    assert properties["num_q_heads"]["maximum"] == spec.MAX_Q_HEADS


@needs_jsonschema
def test_the_corpus_cases_validate() -> None:
    assert VALIDATORS is not None
    for case in load_corpus():
        assert not list(VALIDATORS["case"].iter_errors(case.to_dict())), case.name


@needs_jsonschema
def test_a_run_report_validates_and_a_wrong_one_is_named(tmp_path: Path) -> None:
    """A failing run's report and failure record validate; a value difftest's reader lets
    through but the schema does not (a negative row) is named with its path."""
    plugin = str(ROOT / "tests" / "fake_backends.py")
    status = main(["run", "--device", "cpu", "--plugin", plugin, "--backends",
                   "rounded,perturbed", "--examples", "2", "--no-corpus", "--artifacts",
                   str(tmp_path / "art"), "--report", str(tmp_path / "r.json")])
    assert status == 1
    report = tmp_path / "r.json"
    assert schema_violations(report) == []
    records = sorted((tmp_path / "art" / "failures").glob("*/results.json"))
    assert records
    for record in records:
        assert schema_violations(record) == []
        assert schema_violations(record.with_name("case.json")) == []
    document = json.loads(report.read_text())
    entry = next(r for c in document["cases"] for r in c["results"] if r["comparison"]
                 and r["comparison"]["worst"])
    entry["comparison"]["worst"][0]["row"] = -1
    broken = tmp_path / "broken" / "r.json"
    broken.parent.mkdir()
    broken.write_text(json.dumps(document))
    (problem,) = schema_violations(broken)
    assert "cases/" in problem and "/worst/0/row: -1 is less than the minimum of 0" in problem
    broken.unlink()  # or this test's own check fails on it


def test_the_docs_point_at_the_schemas() -> None:
    text = (ROOT / "docs" / "report-schema.md").read_text()
    assert "difftest/reporting/report.schema.json" in text
    assert "difftest/case/case.schema.json" in text
