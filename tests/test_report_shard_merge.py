"""Sharding a case set by case id, merging shard reports, and the report's contents."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftest import cli
from difftest.case.spec import Case
from difftest.generation.corpus import load_corpus
from difftest.generation.dense import dense_examples
from difftest.generation.generate import generated_cases
from difftest.primitives.jsonfile import write_json
from difftest.reporting.report import REPORT_SCHEMA, ReportError, case_records, read_report
from difftest.results.records import CaseRecord, ResultRecord, Status
from difftest.run.shard import Shard, ShardError, comparable_case, merge_reports, shard_of

SHARDS = 4


def test_shard_of_is_the_case_id_modulo_n() -> None:
    assert shard_of("00000000000000ff", 4) == 255 % 4
    assert shard_of("ffffffffffffffff", 7) == (2**64 - 1) % 7


def test_shards_partition_a_case_set() -> None:
    cases = load_corpus() + generated_cases(12, seed=3)
    parts = [Shard(k, SHARDS).select(cases) for k in range(1, SHARDS + 1)]
    ids = [c.case_id for part in parts for c in part]
    assert sorted(ids) == sorted(c.case_id for c in cases)  # every case, each exactly once


@pytest.mark.parametrize(("text", "message"), [
    ("2", "expected K/N, e.g. 2/4"),
    ("a/4", "expected K/N"),
    ("0/4", "K must be 1..N and N >= 1 (got K=0, N=4)"),
    ("5/4", "K must be 1..N and N >= 1 (got K=5, N=4)"),
    ("1/0", "K must be 1..N and N >= 1 (got K=1, N=0)"),
])
def test_shard_parse_errors_name_the_option_and_range(text: str, message: str) -> None:
    with pytest.raises(ShardError) as error:
        Shard.parse(text, "--difftest-shard")
    assert str(error.value).startswith("--difftest-shard ") and message in str(error.value)


@pytest.fixture(scope="module")
def shard_reports(tmp_path_factory: pytest.TempPathFactory,
                  device_name: str) -> tuple[Path, list[Path], Path]:
    """An unsharded run of a generated case set, its four shards, and their merge."""
    root = tmp_path_factory.mktemp("shards")
    common = ["--no-corpus", "--examples", "8", "--seed", "11", "--backends", "triton-unified",
              "--device", device_name, "--artifacts", str(root / "artifacts")]
    whole = root / "whole.json"
    assert cli.main(["run", *common, "--report", str(whole)]) == 0
    parts = []
    for k in range(1, SHARDS + 1):
        part = root / f"shard-{k}.json"
        assert cli.main(["run", *common, "--shard", f"{k}/{SHARDS}", "--report", str(part)]) == 0
        parts.append(part)
    merged = root / "merged.json"
    assert cli.main(["merge", *map(str, parts), "-o", str(merged)]) == 0
    return whole, parts, merged


def test_four_shards_merged_equal_the_unsharded_report(shard_reports) -> None:
    whole, parts, merged = shard_reports
    unsharded, joined = read_report(whole), read_report(merged)
    sizes = [len(read_report(p)["cases"]) for p in parts]
    drawn = 8 + dense_examples(8)  # --examples 8: the sparse examples, then the dense ones
    # each drawn example runs once, or as variants fitted to the backend's releases
    assert sum(sizes) == len(unsharded["cases"]) >= drawn and max(sizes) < drawn
    for k, part in enumerate(parts, start=1):
        report = read_report(part)
        assert report["config"]["shard"] == f"{k}/{SHARDS}"
        assert all(shard_of(c["case_id"], SHARDS) == k - 1 for c in report["cases"])
    assert [c["case_id"] for c in joined["cases"]] == [c["case_id"] for c in unsharded["cases"]]
    for ours, theirs in zip(case_records(joined), case_records(unsharded), strict=True):
        assert comparable_case(ours) == comparable_case(theirs)  # statuses, metrics, digests
    assert joined["backends"] == unsharded["backends"]
    # the kernels each process compiled (or would have): the shards' sum, at least the whole's
    compiles = {k: r["config"].pop("kernel_compiles") for k, r in (("joined", joined),
                                                                     ("whole", unsharded))}
    assert compiles["joined"].keys() == compiles["whole"].keys()
    for stage, entry in compiles["joined"].items():
        assert all(entry[k] >= compiles["whole"][stage][k] for k in entry), stage
    assert joined["config"] == unsharded["config"]
    assert [m["shard"] for m in joined["merged_from"]] == [f"{k}/4" for k in range(1, 5)]


def test_merge_refuses_conflicting_results(shard_reports, capsys, tmp_path: Path) -> None:
    whole, _, _ = shard_reports
    report = read_report(whole)
    changed = copy.deepcopy(report)
    changed["cases"][0]["results"][0]["status"] = "disagree"
    bad = write_json(tmp_path / "bad.json", changed)
    assert cli.main(["merge", str(whole), str(bad), "-o", str(tmp_path / "out.json")]) == 2
    assert (f"case {report['cases'][0]['case_id']} is in {whole} and {bad} with different "
            "results") in capsys.readouterr().err


def test_merge_refuses_another_environment_unless_forced(shard_reports, tmp_path: Path) -> None:
    _, parts, _ = shard_reports
    first, second = read_report(parts[0]), read_report(parts[1])
    second["fingerprint"]["versions"]["amd-aiter"] = "0.1.7"
    with pytest.raises(ShardError, match=r"fingerprint differs .*amd-aiter.*--force"):
        merge_reports([("a", first), ("b", second)])
    merged, warnings = merge_reports([("a", first), ("b", second)], force=True)
    assert len(merged["cases"]) == len(first["cases"]) + len(second["cases"])
    assert any("fingerprint differs" in w for w in warnings)
    assert any("shard(s) 3/4, 4/4 missing" in w for w in warnings)


def test_read_report_errors(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="cannot read"):
        read_report(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ReportError, match="not JSON"):
        read_report(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"schema": "other/1"}')
    with pytest.raises(ReportError, match=f"expected '{REPORT_SCHEMA}'"):
        read_report(tmp_path / "y.json")


def test_a_truncated_or_wrong_report_is_an_error_naming_the_file_and_field(
        shard_reports, tmp_path: Path) -> None:
    whole = shard_reports[0]
    cut = tmp_path / "cut.json"
    cut.write_text(whole.read_text()[: len(whole.read_text()) // 2])
    with pytest.raises(ReportError, match=r"cut\.json: not JSON: .*looks truncated"):
        read_report(cut)
    report = read_report(whole)
    for change, message in [
        (lambda r: r["cases"][1]["results"][0].pop("seconds"),
         "cases[1].results[0].seconds: missing"),
        (lambda r: r["cases"][0]["results"][0]["comparison"].update(max_ratio="big"),
         "cases[0].results[0].comparison.max_ratio: expected a number"),
        (lambda r: r["cases"][2]["features"].update(max_page_id=1.5),
         "cases[2].features.max_page_id: expected an integer, got float 1.5"),
        (lambda r: r["backends"]["triton-unified"].pop("reason"),
         "backends.triton-unified.reason: missing"),
        (lambda r: r.update(extra=1), "extra: not a field of this entry"),
    ]:
        changed = copy.deepcopy(report)
        change(changed)
        bad = write_json(tmp_path / "bad.json", changed)
        with pytest.raises(ReportError) as error:
            read_report(bad)
        assert str(error.value).startswith(f"{bad}: {message}")


def test_report_entries_carry_features_and_output_digests(shard_reports) -> None:
    report = read_report(shard_reports[0])
    assert report["config"]["runner"] == "difftest run"
    for case in report["cases"]:
        assert Case.from_dict(case["case"]).case_id == case["case_id"]
        assert case["features"]["max_page_id"] >= 0
        for result in case["results"]:
            assert result["status"] in ("agree", "unsupported")
            if result["status"] == "agree":
                assert len(result["output_sha256"]) == 64


# ----- --difftest-shard in pytest ------------------------------------------------------------

PLUGIN = (Path(__file__).parent / "fake_backends.py").read_text()

TESTS = '''
import pytest
from hypothesis import given, settings, strategies as st
from difftest.case.spec import Case

def tiny(seed):
    return Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),), selections=((0, 1),),
                seed=seed)

CASES = [tiny(s) for s in range(8)]

@pytest.mark.parametrize("case", CASES, ids=[str(s) for s in range(8)])
def test_pinned(case, check_case):
    check_case(case)

@settings(max_examples=6)
@given(seed=st.integers(100, 10**6))  # never one of the pinned cases
def test_generated(seed, check_case):
    check_case(tiny(seed))
'''


def _pytest(directory: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "--difftest-plugin", "plugin.py",
                           "--difftest-backends", "rounded", *args], cwd=directory,
                          env=env | {"HYPOTHESIS_PROFILE": "ci"}, capture_output=True,
                          text=True, timeout=300)


def test_pytest_shards_cover_the_cases_without_overlap(tmp_path: Path) -> None:
    (tmp_path / "plugin.py").write_text(PLUGIN)
    (tmp_path / "test_sharded.py").write_text(TESTS)
    pinned: list[set[str]] = []
    for k in (1, 2):
        done = _pytest(tmp_path, "--difftest-shard", f"{k}/2", "--difftest-report",
                       f"shard-{k}.json")
        assert done.returncode == 0, done.stdout + done.stderr
        report = read_report(tmp_path / f"shard-{k}.json")
        cases = report["cases"]
        assert report["config"]["audit"]["cases"] == len(cases)  # audited: this shard's cases
        assert all(shard_of(c["case_id"], 2) == k - 1 for c in cases)
        pinned.append({c["case_id"] for c in cases if "test_pinned" in c["nodeid"]})
        generated = [c for c in cases if "test_generated" in c["nodeid"]]
        assert len(generated) == 6  # Hypothesis drew 6 examples of this shard
        assert f"{8 - len(pinned[-1])} deselected" in done.stdout
    assert pinned[0].isdisjoint(pinned[1])
    all_pinned = {Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                       selections=((0, 1),), seed=s).case_id for s in range(8)}
    assert pinned[0] | pinned[1] == all_pinned


def test_pytest_rejects_a_bad_shard(tmp_path: Path) -> None:
    (tmp_path / "plugin.py").write_text(PLUGIN)
    (tmp_path / "test_sharded.py").write_text(TESTS)
    done = _pytest(tmp_path, "--difftest-shard", "3/2")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--difftest-shard 3/2: K must be 1..N and N >= 1 (got K=3, N=2)" in done.stderr


def test_merge_keeps_every_shards_earlier_crashes(shard_reports) -> None:
    _, parts, _ = shard_reports
    reports = [(str(p), read_report(p)) for p in parts]
    # two shards that hold cases (which do depends on the generated set)
    first, second = [report for _, report in reports if report["cases"]][:2]
    crashes = [_crash(case_records(report)[0]) for report in (first, second)]
    first["earlier_crashes"] = [crashes[0].to_dict()]
    second["earlier_crashes"] = [crashes[1].to_dict()]
    merged, _ = merge_reports(reports)
    assert case_records(merged, "earlier_crashes") == crashes


def _crash(record: CaseRecord) -> CaseRecord:
    """``record`` as the crash record an earlier, dead process would have left."""
    return dataclasses.replace(
        record, results=[ResultRecord("triton-unified", Status.CRASH, detail="died")],
        timings={}, artifact=f"failures/{record.case_id}", unjudged=[], plugins=[])
