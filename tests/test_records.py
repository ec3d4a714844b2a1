"""One record model: every case entry is written by ``CaseRecord.to_dict`` and read back by
``CaseRecord.from_dict``, which checks every field; the schema document lists exactly the
fields written."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from difftest.contract.compare import Comparison, Location
from difftest.generation.corpus import load_corpus
from difftest.primitives.jsonfile import dumps
from difftest.reporting.report import (
    BackendEntry,
    ReportFields,
    WorkerEntry,
    build_report,
    case_records,
    read_report,
    write_report,
)
from difftest.results import records
from difftest.results.artifacts import ArtifactStore, read_results
from difftest.results.records import FEATURE_TYPES, CaseRecord, RecordError, ResultRecord, Status
from difftest.run import runner
from difftest.run.session import Session

SCHEMA_DOC = Path(__file__).parents[1] / "docs" / "report-schema.md"

NAN_PLUGIN = f"{Path(__file__).parent / 'fake_backends.py'}:NAN_BACKENDS"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, device_name: str) -> tuple[Session, Path]:
    """Three pinned corpus cases through torch-ref, the AITER emulator, a wrong backend and
    one that writes NaN; plus a crash record of a fourth case."""
    root = tmp_path_factory.mktemp("records")
    plugins = [str(Path(__file__).parent / "fake_backends.py"), NAN_PLUGIN]
    session = Session.create(["aiter-gluon@emulated", "perturbed", "nan-out"], plugins,
                             device=device_name, artifacts=str(root / "artifacts"))
    corpus = load_corpus()
    for case in corpus[:3]:
        session.run(case)
    store = ArtifactStore(root / "artifacts", environment=session.environment,
                          plugins=tuple(plugins))
    store.begin(corpus[3], ["torch-ref", "aiter-gluon@emulated", "perturbed"])
    store.running(corpus[3], "perturbed")
    (pending,) = store.pending()
    session.records.append(store.record_crash(pending, "found by test_records"))
    return session, root


def _all_records(session: Session) -> list[CaseRecord]:
    return [*session.records, session.records[0].in_pytest("gw1", "tests/t.py::test_x[3]"),
            session.records[-1].in_pytest(None, None)]


def test_the_run_covers_every_kind_of_result(run) -> None:
    session, _ = run
    statuses = {r.status for rec in session.records for r in rec.results}
    assert {Status.AGREE, Status.DISAGREE, Status.CRASH} <= statuses
    ratios = [r.ratio for rec in session.records for r in rec.results if r.ratio is not None]
    assert float("inf") in ratios  # NaN output: non-finite numbers are in the records
    crash = session.records[-1]
    assert [r.backend for r in crash.results] == ["perturbed"]  # it ran when the process died
    assert crash.unjudged == ["aiter-gluon@emulated"] and crash.plugins


def test_from_dict_of_to_dict_is_the_record(run) -> None:
    session, _ = run
    for record in _all_records(session):
        assert CaseRecord.from_dict(record.to_dict(), "case") == record


def test_records_survive_a_strict_report_file(run, tmp_path: Path) -> None:
    session, _ = run
    originals = _all_records(session)
    path = tmp_path / "r.json"
    write_report(path, build_report(originals[:-1], session.backend_entries(),
                                    session.config(), session.environment,
                                    earlier_crashes=originals[-1:]))

    def refuse(token: str) -> object:
        raise ValueError(f"non-standard JSON token {token}")

    json.loads(path.read_text(), parse_constant=refuse)  # RFC 8259: no NaN/Infinity tokens
    if shutil.which("jq"):
        subprocess.run(["jq", ".", str(path)], check=True, capture_output=True)
    report = read_report(path)
    back = case_records(report) + case_records(report, "earlier_crashes")
    by_id = {r.case_id: r for r in originals[:-1]}  # a report keeps one entry per case id
    expected = [by_id[k] for k in sorted(by_id)] + originals[-1:]
    assert [dumps(r.to_dict()) for r in back] == [dumps(r.to_dict()) for r in expected]


def test_failure_directories_hold_the_same_record(run) -> None:
    session, _ = run
    failing = [r for r in session.records if r.failed]
    assert failing
    for record in failing:
        assert record.artifact is not None
        stored = read_results(Path(record.artifact) / "results.json")
        assert dumps(stored.to_dict()) == dumps(record.to_dict())


def test_status_names_live_in_one_place() -> None:
    assert runner.Status is records.Status and runner.FAILING is records.FAILING
    assert records.STATUSES == ("agree", "disagree", "error", "crash", "unsupported",
                                "unavailable")


def _entry(run) -> dict[str, Any]:
    session, _ = run
    record = next(r for r in session.records if any(_worst_reads_pages(x) for x in r.results))
    return record.in_pytest("gw0", "t.py::t").to_dict()


def _worst_reads_pages(result: ResultRecord) -> bool:
    """Whether the result's worst location read several pages (the edits below need two)."""
    worst = result.comparison.worst if result.comparison else ()
    return bool(worst) and len(worst[0].pages) > 1


def _result_with_worst(entry: dict[str, Any]) -> int:
    return next(i for i, r in enumerate(entry["results"])
                if r["comparison"] and r["comparison"]["worst"]
                and len(r["comparison"]["worst"][0]["pages"]) > 1)


@pytest.mark.parametrize(("change", "message"), [
    (lambda e, i: e["results"][i].update(status="pass"),
     "cases[3].results[{i}].status: 'pass' is not a status (allowed: agree, disagree, error, "
     "crash, unsupported, unavailable)"),
    (lambda e, i: e["results"][i].pop("detail"), "cases[3].results[{i}].detail: missing"),
    (lambda e, i: e["results"][i].update(extra=1),
     "cases[3].results[{i}].extra: not a field of this entry"),
    (lambda e, i: e["results"][i]["comparison"]["worst"][0].update(error="huge"),
     "cases[3].results[{i}].comparison.worst[0].error: expected a number"),
    (lambda e, i: e["results"][i]["comparison"]["worst"][0]["pages"].__setitem__(1, "7"),
     "cases[3].results[{i}].comparison.worst[0].pages[1]: expected an integer, got a string"),
    (lambda e, i: e["results"][i]["comparison"].update(agrees=1),
     "cases[3].results[{i}].comparison.agrees: expected true or false, got int 1"),
    (lambda e, i: e["results"][i].update(versions={"torch": 2}),
     "cases[3].results[{i}].versions.torch: expected a string, got int 2"),
    (lambda e, i: e.update(results={}), "cases[3].results: expected an array, got an object"),
    (lambda e, i: e["timings"].update(generate=None),
     "cases[3].timings.generate: expected a number"),
    (lambda e, i: e["features"].pop("max_page_id"), "cases[3].features.max_page_id: missing"),
    (lambda e, i: e["features"].update(colour="red"),
     "cases[3].features.colour: not a feature"),
    (lambda e, i: e.update(case_id="0" * 16), "cases[3].case.id: "),
    (lambda e, i: e.update(worker=3), "cases[3].worker: expected a string, got int 3"),
    (lambda e, i: e.update(artifact=["x"]), "cases[3].artifact: expected a string"),
])
def test_a_wrong_field_is_an_error_naming_its_path(run, change, message) -> None:
    entry = copy.deepcopy(_entry(run))
    index = _result_with_worst(entry)
    change(entry, index)
    with pytest.raises(RecordError) as error:
        CaseRecord.from_dict(entry, "cases[3]")
    assert str(error.value).startswith(message.format(i=index)), str(error.value)


def test_an_old_record_with_bare_nonfinite_tokens_reads(run) -> None:
    entry = copy.deepcopy(_entry(run))
    index = _result_with_worst(entry)
    entry["results"][index]["comparison"]["max_ratio"] = float("inf")  # json.loads' Infinity
    entry["results"][index]["comparison"]["worst"][0]["actual"] = "NaN"  # strict encoding
    record = CaseRecord.from_dict(json.loads(json.dumps(entry)), "old")
    assert record.results[index].ratio == float("inf")


def test_a_record_written_before_the_diagnosis_field_reads_and_only_that_field_may_lack(
        run) -> None:
    entry = copy.deepcopy(_entry(run))
    index = _result_with_worst(entry)
    comparison = entry["results"][index]["comparison"]
    comparison.pop("diagnosis")
    assert CaseRecord.from_dict(entry, "old").results[index].comparison.diagnosis == ()
    comparison.pop("tolerance")
    with pytest.raises(RecordError, match=r"comparison\.tolerance: missing"):
        CaseRecord.from_dict(entry, "old")


# ----- docs/report-schema.md lists exactly the fields written -------------------------------

def _documented(heading: str) -> set[str]:
    """The field names in the first column of the first table after ``heading``."""
    lines = SCHEMA_DOC.read_text().splitlines()
    start = lines.index(heading)
    names: set[str] = set()
    in_table = False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            in_table = True
            first = line.split("|")[1]
            if first.strip() in ("field", "key", "status") or set(first.strip()) <= {"-"}:
                continue
            names |= set(re.findall(r"`([a-z_0-9]+)`", first))
        elif in_table:
            break
    return names


def _json_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("json", True)}


CASE_FIELDS = _json_fields(CaseRecord) | set(CaseRecord.PYTEST_FIELDS)


@pytest.mark.parametrize(("heading", "fields"), [
    ("## Top level", _json_fields(ReportFields)),
    ("### `backends`", _json_fields(BackendEntry)),
    ("### `workers`", _json_fields(WorkerEntry)),
    ("## Case entries", CASE_FIELDS),
    ("### `features`", set(FEATURE_TYPES)),
    ("### `results`: one per backend under test", _json_fields(ResultRecord)),
    ("### `comparison`", _json_fields(Comparison)),
    ("#### Location", _json_fields(Location)),
])
def test_the_schema_document_lists_exactly_the_fields_of_each_entry(heading, fields) -> None:
    assert _documented(heading) == fields


def test_a_report_writes_exactly_the_documented_fields(run, tmp_path: Path) -> None:
    session, _ = run
    crash = session.records[-1]
    path = tmp_path / "r.json"
    write_report(path, build_report(session.records[:-1], session.backend_entries(),
                                    session.config(), session.environment,
                                    earlier_crashes=[crash]))
    written = json.loads(path.read_text())
    assert set(written) == _documented("## Top level") - {"workers", "merged_from"}
    always = CASE_FIELDS - {"unjudged", "plugins", "worker", "nodeid"}
    assert all(set(c) == always for c in written["cases"])
    assert set(written["earlier_crashes"][0]) == always | {"unjudged", "plugins"}
    assert set(session.records[0].in_pytest("gw0", None).to_dict()) == always | {"worker",
                                                                                 "nodeid"}
    for case in written["cases"]:
        assert set(case["features"]) == _documented("### `features`")
        for result in case["results"]:
            assert set(result) == _documented("### `results`: one per backend under test")
            if result["comparison"] is not None:
                assert set(result["comparison"]) == _documented("### `comparison`")
                for location in result["comparison"]["worst"]:
                    assert set(location) == _documented("#### Location")
    for entry in written["backends"].values():
        assert set(entry) == _documented("### `backends`")


def test_a_kernel_calls_device_code_round_trips_and_old_calls_read_without_it() -> None:
    """``calls[].device_code`` is written with the keys the gate compares, read back equal,
    and a call written before the field reads with none."""
    from difftest.contract.kernel_call import DeviceCode, KernelCall, StatedArgument

    code = DeviceCode(kernel="paged_attention_decode_sliding_window_head_1", arch="gfx950",
                      specialization="KV_BLOCK_SIZE=16 query_ptr:*fp8e4nv/16", sha256="ab" * 32,
                      vgprs=258, sgprs=105, lds_bytes=6144, spills=8, occupancy=1)
    call = KernelCall("pa_decode_gluon", {"query": StatedArgument("float16 [N, 16, 128]")},
                      [code])
    result = ResultRecord("aiter-gluon@compiled", Status.AGREE, calls=[call])
    entry = json.loads(dumps(result.to_dict()))
    assert set(entry["calls"][0]["device_code"][0]) == {
        "kernel", "arch", "specialization", "sha256", "vgprs", "sgprs", "lds_bytes", "spills",
        "occupancy"}
    assert ResultRecord.from_dict(entry, "r") == result
    del entry["calls"][0]["device_code"]
    assert ResultRecord.from_dict(entry, "r").calls[0].device_code == []
    entry["calls"][0]["device_code"] = [{"kernel": "k"}]
    with pytest.raises(RecordError, match=r"r\.calls\[0\]\.device_code\[0\]\.arch: missing"):
        ResultRecord.from_dict(entry, "r")
