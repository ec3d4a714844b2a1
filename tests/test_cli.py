"""The ``difftest`` command line: run, repro, promote and their error paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from difftest import cli
from difftest.backends.aiter_gluon import AiterGluon
from difftest.backends.vllm_aiter import VllmAiter
from difftest.case.spec import Case
from difftest.generation.corpus import CORPUS_DIR, load_corpus
from difftest.results.artifacts import ArtifactStore
from difftest.results.features import case_features
from difftest.results.records import CaseRecord, ResultRecord, Status

TINY = Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),), seed=4)


def _record(case: Case, results: list[ResultRecord]) -> CaseRecord:
    """A failure directory's record of ``case`` with ``results``."""
    return CaseRecord(case.case_id, case.name, case.to_dict(), case_features(case), "torch-ref",
                      results)


def _die_in(root: Path, case: Case, backends: list[str]) -> int:
    """A process that begins ``case`` in the store at ``root`` and dies; returns its pid."""
    script = ("import os, sys; from difftest.results.artifacts import ArtifactStore; "
              "from difftest.case.spec import Case; "
              "store = ArtifactStore(sys.argv[1]); case = Case.from_json(sys.argv[2]); "
              "store.begin(case, sys.argv[3].split(',')); store.running(case, 'torch-ref'); "
              "print(os.getpid(), flush=True); os._exit(3)")
    done = subprocess.run([sys.executable, "-c", script, str(root), case.to_json(),
                           ",".join(backends)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    return int(done.stdout)


def test_run_reports_a_case_an_earlier_run_died_in(tmp_path: Path, capsys,
                                                     device_name: str) -> None:
    root = tmp_path / "artifacts"
    pid = _die_in(root, TINY, ["torch-ref", "triton-unified"])
    assert [p.pid for p in ArtifactStore(root).crashed()] == [pid]
    report = tmp_path / "report.json"
    code = cli.main(["run", "--no-corpus", "--examples", "0", "--backends", "triton-unified",
                     "--device", device_name, "--artifacts", str(root), "--report", str(report)])
    assert code == 1  # the crash is a failure of this run, though not in its case set
    written = json.loads(report.read_text())
    assert written["cases"] == []
    assert [c["case_id"] for c in written["earlier_crashes"]] == [TINY.case_id]
    directory = root / "failures" / TINY.case_id
    assert (f"CRASH case {TINY.case_id} (an earlier run died in it): replay with difftest "
            f"repro {directory}") in capsys.readouterr().err
    recorded = json.loads((directory / "results.json").read_text())
    assert [(r["backend"], r["status"]) for r in recorded["results"]] == [
        ("triton-unified", "crash")]
    assert "in torch-ref, before the backends under test ran" in recorded["results"][0]["detail"]
    assert f"(pid {pid} on " in recorded["results"][0]["detail"]
    assert not ArtifactStore(root).pending()


def test_a_pending_case_of_a_live_process_is_left_alone(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    store.begin(TINY, ["torch-ref"])
    assert store.crashed() == []
    assert [p.case.case_id for p in store.pending()] == [TINY.case_id]


def test_repro_replays_a_case_file_and_a_pending_file(tmp_path: Path, capsys,
                                                       device_name: str) -> None:
    case_file = tmp_path / "case.json"
    case_file.write_text(TINY.to_json())
    common = ["--backends", "triton-unified", "--device", device_name, "--artifacts",
              str(tmp_path / "artifacts")]
    assert cli.main(["repro", str(case_file), *common]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"case {TINY.case_id}\n")
    assert "triton-unified           agree" in out
    pending = ArtifactStore(tmp_path / "elsewhere").begin(TINY, ["torch-ref", "triton-unified"])
    assert cli.main(["repro", str(pending), *common]) == 0
    assert f"case {TINY.case_id}" in capsys.readouterr().out


def test_repro_of_an_unreadable_path_exits_2(tmp_path: Path, capsys, device_name: str) -> None:
    assert cli.main(["repro", str(tmp_path / "nothing"), "--device", device_name]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_promote_pins_an_artifact_directory(tmp_path: Path, capsys) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    directory = store.write_failure(TINY, _record(TINY, []), {})
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    assert cli.main(["promote", str(directory), "tiny-tail", "--corpus", str(corpus)]) == 0
    assert f"pinned {corpus / 'tiny-tail.json'}" in capsys.readouterr().out
    pinned = load_corpus(corpus)
    assert [c.case_id for c in pinned] == [TINY.case_id] and pinned[0].name == "tiny-tail"
    assert "difftest promote" in (directory / "repro.txt").read_text()


def test_run_shard_is_validated(capsys, device_name: str) -> None:
    assert cli.main(["run", "--shard", "5/4", "--device", device_name]) == 2
    assert "--shard 5/4: K must be 1..N and N >= 1 (got K=5, N=4)" in capsys.readouterr().err


def test_run_of_a_shard_runs_only_its_cases(tmp_path: Path, capsys, device_name: str) -> None:
    report = tmp_path / "r.json"
    corpus_ids = {c.case_id for c in load_corpus(CORPUS_DIR)}
    code = cli.main(["run", "--examples", "0", "--shard", "2/3", "--backends", "torch-ref",
                     "--device", device_name, "--artifacts", str(tmp_path),
                     "--report", str(report)])
    assert code == 0
    ran = {c["case_id"] for c in json.loads(report.read_text())["cases"]}
    assert ran == {i for i in corpus_ids if int(i, 16) % 3 == 1}
    assert f"{len(ran)} cases; reference torch-ref" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["merge", "gate", "plot"])
def test_commands_need_their_arguments(command: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command])
    assert exit_info.value.code == 2


def test_promote_creates_the_corpus_and_refuses_bad_input_with_exit_2(tmp_path: Path,
                                                                      capsys) -> None:
    case_file = tmp_path / "case.json"
    case_file.write_text(TINY.to_json())
    corpus = tmp_path / "new" / "corpus"
    assert cli.main(["promote", str(case_file), "tiny", "--corpus", str(corpus)]) == 0
    assert [c.case_id for c in load_corpus(corpus)] == [TINY.case_id]
    assert cli.main(["promote", str(case_file), "bad name", "--corpus", str(corpus)]) == 2
    assert "allowed letters, digits, '-', '_' and '.'" in capsys.readouterr().err
    other = TINY.replace(seed=5).to_json()
    case_file.write_text(other)
    assert cli.main(["promote", str(case_file), "tiny", "--corpus", str(corpus)]) == 2
    assert "already pins a different case" in capsys.readouterr().err


def test_an_unknown_backend_exits_2_with_the_known_ones(capsys, device_name: str) -> None:
    assert cli.main(["run", "--no-corpus", "--examples", "0", "--device", device_name,
                     "--backends", "aiter-gluon@emulated[k_trim=sideways]"]) == 2
    assert "k_trim='sideways' is not one of on, off, before-stride" in capsys.readouterr().err


def test_repro_replays_a_recorded_backend_configured_by_its_name(tmp_path: Path, capsys,
                                                                 device_name: str) -> None:
    """A failure of ``aiter-gluon@emulated[k_trim=off]`` replays as printed, with no flags."""
    case = {c.name: c for c in load_corpus(CORPUS_DIR)}["lbhnc-128-blocks-2048-2040-page-2039"]
    backend = "aiter-gluon@emulated[k_trim=off]"
    directory = ArtifactStore(tmp_path / "artifacts").write_failure(
        case, _record(case, [ResultRecord(backend, Status.ERROR)]), {})
    code = cli.main(["repro", str(directory), "--device", device_name,
                     "--artifacts", str(tmp_path / "replays")])
    out = capsys.readouterr().out
    assert code == 1
    assert f"  {backend} error" in out
    assert "no output either time" in out
    assert "key/value caches must have the same number of blocks" in out


def test_run_ends_in_its_verdict_and_its_report_holds_the_parameter_audit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], device_name: str) -> None:
    """Generation leaves out float32 queries for the AITER emulator (and says so); the run
    ends in its verdict line, explains its case count, and prints the audit's blind spots
    only: ``difftest audit REPORT`` lists pa_decode_gluon's arguments with their values."""
    report_path = str(tmp_path / "r.json")
    code = cli.main(["run", "--no-corpus", "--examples", "3", "--backends",
                     "aiter-gluon@emulated", "--device", device_name,
                     "--artifacts", str(tmp_path / "artifacts"), "--report", report_path])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["status"] for c in report["cases"] for r in c["results"]] == ["agree"] * 3
    assert "generation: not drawn for aiter-gluon@emulated: query float32" in out
    assert "3 cases: 0 corpus, 3 generated" in out
    assert report["config"]["case_set"] == {"corpus": 0, "generated": 3, "fitted": 0,
                                            "recorded": 0}
    assert f"all of it: difftest audit {report_path}" in out
    assert "parameter coverage over" not in out
    assert out.rstrip().splitlines()[-1] == (
        f"PASSED: 3 cases, 3 agreements, no new failure; 0 unsupported; report {report_path}")
    assert cli.main(["audit", report_path]) == 0
    out = capsys.readouterr().out
    assert "parameter coverage over 3 cases" in out
    assert "aiter-gluon@emulated -> pa_decode_gluon (3 calls stated in 3 cases)" in out
    audited = report["config"]["audit"]["backends"]["aiter-gluon@emulated"]
    assert list(audited["kernels"]) == ["pa_decode_gluon"] and audited["cases"] == 3
    arguments = audited["kernels"]["pa_decode_gluon"]["arguments"]
    fixed = {a["name"]: a["fixed"] for a in arguments if a["fixed"]}
    assert fixed and all(f["reason"] for f in fixed.values())  # documented with reasons


def test_repro_says_why_a_backend_refuses_the_case(tmp_path: Path, capsys) -> None:
    """F14's case: vllm-aiter@emulated refuses it, and the replay prints the reason; where the
    backend named is unavailable (a vLLM without a module its kernel imports, real AITER off a
    ROCm GPU), it prints why."""
    case = Path(__file__).parents[1] / "docs/data/fp-vllm-aiter-duplicate-lane.json"
    assert cli.main(["repro", str(case), "--backends", "vllm-aiter@emulated,aiter-gluon",
                     "--device", "cpu", "--artifacts", str(tmp_path / "artifacts")]) == 0
    out = capsys.readouterr().out
    availability = VllmAiter(emulated=True).availability()
    if availability.available:
        assert "vllm-aiter@emulated      unsupported" in out
        assert "vllm-aiter@emulated: unsupported: row 3 (position 128) selects no lane" in out
    else:
        assert "vllm-aiter@emulated      unavailable" in out
        assert f"vllm-aiter@emulated: unavailable: {availability.reason}" in out
    real = AiterGluon().availability()
    if not real.available:
        assert f"aiter-gluon: unavailable: {real.reason}" in out
