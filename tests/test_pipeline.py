"""The pipelined session (issue 11): the same records as running case by case.

:meth:`difftest.run.session.Session.run_all` prepares the next cases' host-side inputs
(:func:`difftest.run.runner.prepare_host`, in a worker process) while the current case runs.
These tests show that the records, verdicts and messages are those of :meth:`Session.run`
case by case, that the preparation really happens (in the worker) while an earlier case is in
flight and that this process builds a prepared case's rows only when a comparison reads them,
and that no case's data is generated before its pending file is on disk. Also:
:meth:`Case.to_dict`'s content, built field by field, is the ``dataclasses.asdict``
formulation it replaced.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given

from benchmarks.throughput import production_case
from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import MODE_DEFAULTS, Case
from difftest.generation.corpus import load_corpus
from difftest.generation.strategies import cases
from difftest.inputs import case_data
from difftest.run import runner
from difftest.run import session as session_module
from difftest.run.session import Session

NAN_PLUGIN = f"{Path(__file__).parent / 'fake_backends.py'}:NAN_BACKENDS"
BACKENDS = ["aiter-gluon@emulated", "nan-out"]


def asdict_content(case: Case) -> dict[str, Any]:
    """The content as ``Case._content`` computed it before (``dataclasses.asdict``)."""
    data = dataclasses.asdict(case)
    data.pop("name")
    for mode, off in MODE_DEFAULTS.items():
        if data[mode] == off:
            data.pop(mode)
    if "query_lens" in data:
        data["query_lens"] = list(case.query_lens)
    data["seq_lens"] = list(case.seq_lens)
    data["block_tables"] = [list(r) for r in case.block_tables]
    data["selections"] = [list(r) for r in case.selections]
    return data


def same_content(case: Case) -> None:
    new, old = case.to_dict(), {"schema": "difftest.case/1", "id": case.case_id,
                                "name": case.name, **asdict_content(case)}
    assert json.dumps(new) == json.dumps(old)  # same keys, same order, same values
    assert Case.from_dict(new) == case


def test_the_content_is_the_asdict_one_on_the_corpus_and_at_production_shape() -> None:
    base = load_corpus()[0]
    for case in (*load_corpus(), production_case(2),
                 base.replace(softcap=0.5, sliding_window=7, canary=True)):
        same_content(case)


@given(cases())
def test_the_content_is_the_asdict_one_on_generated_cases(case: Case) -> None:
    same_content(case)


def test_to_dict_lists_are_fresh() -> None:
    case = load_corpus()[1]
    first = case.to_dict()
    first["selections"][0][0] = -7
    assert case.to_dict()["selections"][0][0] == case.selections[0][0]


def the_runs() -> list[tuple[Case, list[str] | None]]:
    corpus = load_corpus()
    runs: list[tuple[Case, list[str] | None]] = [(c, ["aiter-gluon@emulated"]) for c in corpus]
    runs.insert(2, (corpus[3].replace(name="nan"), ["nan-out"]))  # a disagreement
    runs.append((corpus[0], None))  # a case seen before, on every backend
    return runs


def comparable(session: Session) -> list[str]:
    """The session's records without what depends on the run (timings, artifact paths), as
    JSON (NaN equals NaN there)."""
    out = []
    for record in session.records:
        data = record.to_dict()
        data.pop("timings")
        for result in data["results"]:
            result.pop("seconds")
        data["artifact"] = data["artifact"] is not None
        out.append(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory, device_name: str
             ) -> tuple[Session, Session, list[tuple[str, Any]]]:
    """The runs case by case and pipelined, and the pipelined run's log of events in this
    process (the worker's are its own)."""
    root = tmp_path_factory.mktemp("pipeline")
    serial = Session.create(BACKENDS, [NAN_PLUGIN], device=device_name,
                            artifacts=str(root / "serial"))
    for case, names in the_runs():
        serial.run(case, names)
    piped = Session.create(BACKENDS, [NAN_PLUGIN], device=device_name,
                           artifacts=str(root / "piped"))
    piped.pool().submit(int).result()  # the worker runs: every case waits for its inputs
    log: list[tuple[str, Any]] = []
    store = piped.store
    begin, finish = store.begin, store.finish
    draw, tables, rows, preparation = (case_data._draw, case_data.host_tables, runner.build_rows,
                                       runner.Preparation)

    def logged_begin(case: Case, names: list[str]) -> Path:
        log.append(("begin", case.case_id))
        return begin(case, names)

    def logged_finish(case: Case, record: Any) -> str | None:
        log.append(("finish", case.case_id))
        return finish(case, record)

    def logged_draw(seed: int, *args: Any) -> torch.Tensor:
        pending = [json.loads(p.read_text())["case"]["seed"]
                   for p in store.pending_dir.glob("*.json")]
        log.append(("draw", (seed, pending)))
        return draw(seed, *args)

    def logged_tables(case: Case, rows: Any) -> Any:
        log.append(("tables", case.case_id))
        return tables(case, rows)

    def logged_rows(case: Case) -> Any:
        log.append(("rows", case.case_id))
        return rows(case)

    def logged_preparation(case: Case, pool: Any) -> runner.Preparation:
        log.append(("prepare", case.case_id))
        return preparation(case, pool)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "begin", logged_begin)
        patch.setattr(store, "finish", logged_finish)
        patch.setattr(case_data, "_draw", logged_draw)
        patch.setattr(case_data, "host_tables", logged_tables)
        patch.setattr(runner, "build_rows", logged_rows)
        patch.setattr(session_module, "Preparation", logged_preparation)
        results = list(piped.run_all(the_runs()))
    piped.close()
    assert results == piped.results
    return serial, piped, log


def test_the_pipelined_records_are_the_serial_ones(sessions) -> None:
    serial, piped, _ = sessions
    assert comparable(piped) == comparable(serial)
    assert [r.failure_messages() for r in piped.results] == [
        r.failure_messages() for r in serial.results]
    assert any(r.failed for r in piped.results)  # the disagreement is in the comparison


def test_the_next_cases_are_prepared_while_one_runs_and_generated_only_once_on_disk(
        sessions) -> None:
    _, _, log = sessions
    ids = [case.case_id for case, _ in the_runs()]
    events = [(kind, what) for kind, what in log if kind != "draw"]
    assert [w for k, w in events if k == "begin"] == ids
    assert [w for k, w in events if k == "finish"] == ids
    # runs 1.. are handed to the worker before run 0 begins and then 2 ahead
    assert [w for k, w in events if k == "prepare"] == ids[1:]
    begun, prepared_during = 0, []  # prepared_during: cases begun before each hand-over
    for kind, _ in events:
        begun += kind == "begin"
        if kind == "prepare":
            prepared_during.append(begun)
    assert prepared_during == [0, 0, *range(1, len(ids) - 2)]
    # this process built the host tables of run 0 only (not prepared), and lazy rows only
    # for the two runs where nan-out disagrees (the worst locations and diagnosis read them)
    assert [w for k, w in events if k == "tables"] == ids[:1]
    assert [w for k, w in events if k == "rows"] == [ids[2], ids[-1]]
    # every draw of generation happens while exactly its own case is on disk
    draws = [what for kind, what in log if kind == "draw"]
    assert draws and all(pending == [seed] for seed, pending in draws)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_prepared_inputs_are_bit_identical_to_those_built_lazily() -> None:
    cpu = torch.device("cpu")
    base = load_corpus()[0]
    for case in (*load_corpus(), base.replace(softcap=0.5, sliding_window=7, canary=True)):
        host = runner.prepare_host(case)
        built, fresh = runner.prepared_inputs(case, cpu, host), runner.RunInputs(case, cpu)
        for name in ("query", "k_stored", "v_stored", "block_ids", "written"):
            assert torch.equal(bits(getattr(fresh.data, name)), bits(getattr(built.data, name)))
        for name in ("slots", "tokens", "first", "context_lens"):
            assert torch.equal(getattr(fresh.data.segments, name),
                               getattr(built.data.segments, name))
        for name in ("physical_blocks", "valid_tokens", "slot_of"):
            assert getattr(fresh.data, name) == getattr(built.data, name)
        assert all(torch.equal(a, b) for a, b in zip(fresh.sparse_table, built.sparse_table,
                                                     strict=True))
        assert [t.dtype for t in fresh.sparse_table] == [t.dtype for t in built.sparse_table]
        assert torch.equal(bits(fresh.cache("plain").raw), bits(built.cache("plain").raw))
        assert host.features == runner.case_features(case)
        assert tuple(built.rows) == fresh.rows and len(built.rows) == len(fresh.rows)


class _NanOut(TorchReference):
    """NaN everywhere: a disagreement that the diagnosis explains."""

    name = "nan-out"

    def run(self, inputs: runner.RunInputs) -> torch.Tensor:
        return torch.full_like(self.reference(inputs).output, float("nan"))


def test_diagnose_false_skips_only_the_diagnosis() -> None:
    case, cpu = load_corpus()[3], torch.device("cpu")
    full, bare = (runner.run_case(case, TorchReference(), [_NanOut()], cpu, diagnose=d)
                  .results[0].comparison for d in (True, False))
    assert full is not None and bare is not None
    assert full.diagnosis and not bare.diagnosis
    assert json.dumps(dataclasses.replace(full, diagnosis=()).to_dict()) == json.dumps(
        bare.to_dict())  # JSON: the NaN outputs compare equal


def test_a_failed_worker_leaves_the_run_to_build_everything(tmp_path: Path,
                                                             device_name: str) -> None:
    session = Session.create(["aiter-gluon@emulated"], device=device_name,
                             artifacts=str(tmp_path / "art"))
    session.pool().shutdown()  # every hand-over now fails
    runs = [(case, None) for case in load_corpus()[:2]]
    results = list(session.run_all(runs))
    session.close()
    assert [r.case for r in results] == [case for case, _ in runs]
    assert [r.results[0].status for r in results] == [
        session.run(case).results[0].status for case, _ in runs]


class _NotStarting(Executor):
    """A worker that never starts: its futures never finish; ``waited`` notes each wait."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.waited: list[str] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        waited = self.waited

        class Pending(Future):
            def result(self, timeout: float | None = None) -> Any:
                waited.append(getattr(fn, "__name__", str(fn)))
                raise TimeoutError("the worker never started")

        return Pending()


def test_no_case_waits_for_a_worker_still_starting(tmp_path: Path, device_name: str) -> None:
    """While the spawned worker is still importing (seconds; more where bytecode is not
    compiled), the cases run build their own inputs instead of waiting: the same records
    as a run without the worker, and no wait on it."""
    runs = [(case, None) for case in load_corpus()[:3]]
    serial = Session.create(["aiter-gluon@emulated"], device=device_name,
                            artifacts=str(tmp_path / "serial"))
    for case, _ in runs:
        serial.run(case)
    session = Session.create(["aiter-gluon@emulated"], device=device_name,
                             artifacts=str(tmp_path / "piped"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session_module, "ProcessPoolExecutor", _NotStarting)
        results = list(session.run_all(runs))
        worker = session.pool()
    session.close()
    assert isinstance(worker, _NotStarting) and worker.waited == []
    assert comparable(session) == comparable(serial)
    assert [r.case for r in results] == [case for case, _ in runs]
