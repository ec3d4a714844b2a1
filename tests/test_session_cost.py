"""The session's bookkeeping, made cheaper (issue 11), writes exactly what it wrote before.

* :func:`difftest.primitives.jsonfile.dumps` encodes a value without non-finite floats as it is and
copies
  only a value that has one (:func:`difftest.primitives.jsonfile.encode_nonfinite`): the text, the
  record's ``results.json`` and the report file are the bytes the copy-always path wrote, for
  a real record with non-finite numbers and one without.
* :meth:`difftest.run.session.Session.run` serialises the case once (the dict the pending file
  holds goes into the record) and takes the features from the rows generation built: its
  record is the one :meth:`difftest.run.runner.CaseResult.record` builds from scratch.
* :func:`difftest.results.features.case_features` counts page ids per segment instead of listing
every
  page a case reads: the features are those of the listing (the previous code, below).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

from benchmarks.throughput import production_case
from difftest.case.selection import build_rows, row_page_ids
from difftest.case.spec import Case
from difftest.generation.corpus import load_corpus
from difftest.generation.strategies import cases
from difftest.primitives import jsonfile
from difftest.reporting.report import build_report, write_report
from difftest.results import features
from difftest.results.artifacts import ArtifactStore
from difftest.results.features import PAGE_ID_2_16, case_features
from difftest.results.records import CaseRecord
from difftest.run.session import Session

NAN_PLUGIN = f"{Path(__file__).parent / 'fake_backends.py'}:NAN_BACKENDS"


def slow_dumps(value: Any, indent: int | None = None) -> str:
    """The encoding before the fast path: always copy with the non-finite names in place."""
    return json.dumps(jsonfile.encode_nonfinite(value), allow_nan=False, indent=indent)


def listed_features(case: Case) -> dict[str, Any]:
    """The features as computed before: from the list of every page id the case reads."""
    rows = build_rows(case)
    pages = [p for row in rows for p in row_page_ids(case, row)]
    tails = [seg.tokens for row in rows for seg in row.segments[-1:]]
    last_block = case.num_blocks - 1
    return {
        "query_dtype": case.query_dtype, "kv_dtype": case.kv_dtype,
        "kv_layout": case.kv_layout,
        "decode_query_len": max(case.query_len(r) for r in range(case.batch)),
        "num_blocks": case.num_blocks, "max_page_id": max(pages, default=-1),
        "context_lens": [row.context_len for row in rows],
        "last_block_attended": any(seg.physical_block == last_block
                                   for row in rows for seg in row.segments),
        "block_0_attended": any(seg.physical_block == 0 for row in rows for seg in row.segments),
        "page_ids_past_2_16": sum(p >= PAGE_ID_2_16 for p in pages),
        "report_boundary_2039": case.num_blocks == 128 and 2039 in pages,
        "one_token_tail": 1 in tails,
        "empty_rows": sum(row.context_len == 0 for row in rows),
        "scales": [case.k_scale, case.v_scale],
    }


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory,
            device_name: str) -> tuple[CaseRecord, CaseRecord, Session]:
    """A corpus case's record with only finite numbers (the AITER emulator agrees), and one
    with non-finite numbers (a backend writing NaN: greatest error/tolerance infinite)."""
    root = tmp_path_factory.mktemp("session_cost")
    session = Session.create(["aiter-gluon@emulated", "nan-out"], [NAN_PLUGIN],
                             device=device_name, artifacts=str(root / "artifacts"))
    case = load_corpus()[0]
    session.run(case, ["aiter-gluon@emulated"])
    session.run(case.replace(name="nan"), ["nan-out"])
    finite, nonfinite = session.records
    assert nonfinite.results[0].ratio == float("inf")
    return finite, nonfinite, session


@pytest.mark.parametrize("which", ["finite", "nonfinite"])
@pytest.mark.parametrize("indent", [None, 1])
def test_fast_encoding_is_the_slow_one_byte_for_byte(records, which, indent,
                                                     monkeypatch) -> None:
    finite, nonfinite, _ = records
    entry = (finite if which == "finite" else nonfinite).to_dict()
    expected = slow_dumps(entry, indent)
    copies = []
    encode = jsonfile.encode_nonfinite
    monkeypatch.setattr(jsonfile, "encode_nonfinite", lambda v: copies.append(1) or encode(v))
    assert jsonfile.dumps(entry, indent) == expected
    assert bool(copies) == (which == "nonfinite")  # the copy is made only when it must be
    assert ("Infinity" in expected) == (which == "nonfinite")


def test_written_results_and_report_are_the_slow_paths_bytes(records, tmp_path: Path) -> None:
    finite, nonfinite, session = records
    for record in (finite, nonfinite):
        store = ArtifactStore(tmp_path / record.name, environment=session.environment)
        case = Case.from_dict(record.case)
        directory = store.write_failure(case, record, session.environment)
        written = (directory / "results.json").read_text()
        assert written == slow_dumps(record.to_dict(), 1) + "\n"
    report = build_report([finite, nonfinite], session.backend_entries(), session.config(),
                          session.environment)
    write_report(tmp_path / "report.json", report)
    assert (tmp_path / "report.json").read_text() == slow_dumps(report, 1) + "\n"


def test_features_counted_per_segment_are_those_of_the_page_list() -> None:
    corpus = load_corpus()
    shown = [production_case(0), *corpus]
    for case in shown:
        assert case_features(case) == listed_features(case), case.name
        assert case_features(case, build_rows(case)) == listed_features(case), case.name
    features = [case_features(c) for c in shown]
    assert any(f["page_ids_past_2_16"] for f in features)  # the counts are exercised
    assert any(f["one_token_tail"] for f in features) and any(f["empty_rows"] for f in features)


@given(cases())
def test_features_of_generated_cases_are_those_of_the_page_list(case: Case) -> None:
    assert case_features(case) == listed_features(case)


def test_the_session_serialises_the_case_once_and_reuses_its_rows(records, monkeypatch) -> None:
    _, _, session = records
    case = load_corpus()[1]
    serialised = []
    to_dict = Case.to_dict
    monkeypatch.setattr(Case, "to_dict", lambda self: serialised.append(self) or to_dict(self))

    def rebuilt(case: Case) -> None:
        raise AssertionError("the features rebuilt the rows")
    monkeypatch.setattr(features, "build_rows", rebuilt)
    result = session.run(case, ["aiter-gluon@emulated"])
    assert serialised == [case]  # begin's, for the pending file and the record
    monkeypatch.undo()
    from_scratch = result.record(session.store.outputs(case))
    assert session.records[-1].to_dict() == from_scratch.to_dict()


def test_a_case_that_agrees_costs_one_fsync_and_still_names_its_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pending case is fsynced before anything runs; the running notes are not (they
    survive a crash of the process, which is what attributes it), so one fsync per case."""
    session = Session.create(["aiter-gluon@emulated"], device="cpu",
                             artifacts=str(tmp_path))
    case = load_corpus()[0]
    synced, notes = [], []
    real_fsync, real_running = jsonfile.os.fsync, session.store.running

    def running(c: Case, backend: str) -> None:
        real_running(c, backend)
        notes.append(session.store._running_path(c).read_text())

    monkeypatch.setattr(jsonfile.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    monkeypatch.setattr(session.store, "running", running)
    result = session.run(case)
    assert not result.failed
    assert len(synced) == 1
    assert notes == ["torch-ref", "aiter-gluon@emulated"]
