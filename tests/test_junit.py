"""``difftest run --junit`` and ``difftest merge --junit``: one testcase per (case, backend),
failures with their message and replay command, skips with their reasons, known bugs
marked, and the run's own failures in a suite of their own."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from difftest.cli import main

PLUGIN = '''
import torch
from difftest.backends.torch_ref import TorchReference
from difftest.contract.backend import Availability, Precision


class Rounded(TorchReference):
    name = "rounded"

    def precision(self, case, device):
        return Precision("float16", "float16", "float16")

    def run(self, inputs):
        return self.reference(inputs).output.to(torch.float16)


class Perturbed(Rounded):
    name = "perturbed"

    def run(self, inputs):
        out = super().run(inputs)
        out[0, 0, 0] += 1.0
        return out


class KnownBroken(Perturbed):
    name = "known-broken"

    def versions(self):
        return {"fake": "1.0"}


class Raises(Rounded):
    name = "raises"

    def run(self, inputs):
        raise RuntimeError("kernel launch failed")


class Refuses(Rounded):
    name = "refuses"

    def unsupported_reason(self, case, device):
        return "this kernel takes no sparse table"


class Missing(Rounded):
    name = "missing"

    def availability(self):
        return Availability(False, "needs a library this machine lacks")


DIFFTEST_BACKENDS = [Rounded, Perturbed, KnownBroken, Raises, Refuses, Missing]
'''
EXPECTATIONS = {"expectations": [
    {"finding": "F99", "summary": "a fake known bug", "backends": ["known-broken"],
     "releases": "fake <=1.0", "when": {}},
    {"finding": "F98", "summary": "an expected bug of a backend that agrees",
     "backends": ["rounded"], "releases": "torch >=0", "when": {}}]}
BACKENDS = "rounded,perturbed,known-broken,raises,refuses,missing"


@pytest.fixture(scope="module")
def junit(tmp_path_factory: pytest.TempPathFactory) -> tuple[ET.Element, Path, int]:
    """A run of every kind of result: its JUnit document, its directory and exit status."""
    tmp = tmp_path_factory.mktemp("junit")
    (tmp / "fakes.py").write_text(PLUGIN)
    (tmp / "expectations.json").write_text(json.dumps(EXPECTATIONS))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFTEST_EXPECTATIONS", str(tmp / "expectations.json"))
        status = main(["run", "--device", "cpu", "--plugin", str(tmp / "fakes.py"),
                       "--backends", BACKENDS, "--optional", "missing", "--examples", "2",
                       "--no-corpus", "--artifacts", str(tmp / "art"),
                       "--report", str(tmp / "r.json"), "--junit", str(tmp / "j.xml")])
    return ET.parse(tmp / "j.xml").getroot(), tmp, status


def _cases(root: ET.Element, backend: str) -> list[ET.Element]:
    (suite,) = [s for s in root.iter("testsuite") if s.get("name") == backend]
    return suite.findall("testcase")


def test_one_testcase_per_case_and_backend_with_consistent_counts(junit) -> None:
    root, tmp, status = junit
    assert status == 1  # perturbed and raises are new failures
    report = json.loads((tmp / "r.json").read_text())
    pairs = {(c["case_id"], r["backend"]) for c in report["cases"] for r in c["results"]}
    found = {(t.get("name").split()[0], t.get("classname").removeprefix("difftest."))
             for t in root.iter("testcase") if t.get("classname") != "difftest.run"}
    assert found == pairs and len(pairs) == 2 * 6
    for element in [root, *root.iter("testsuite")]:
        cases = list(element.iter("testcase"))
        assert int(element.get("tests")) == len(cases)
        for kind in ("failure", "error", "skipped"):
            attribute = "failures" if kind == "failure" else f"{kind}s" if kind == "error" \
                else "skipped"
            assert int(element.get(attribute)) == sum(len(t.findall(kind)) for t in cases)


def test_failures_carry_the_message_and_replay_command(junit) -> None:
    root, _, _ = junit
    for testcase in _cases(root, "perturbed"):
        (failure,) = testcase.findall("failure")
        assert failure.get("type") == "disagree"
        assert failure.get("message").startswith("perturbed disagrees with torch-ref on case")
        assert "Worst locations:" in failure.text and "replay: difftest repro " in failure.text
        assert "--plugin" in failure.text
        ratio = testcase.find("properties/property[@name='error/tolerance']")
        assert float(ratio.get("value")) > 1
    for testcase in _cases(root, "raises"):
        (error,) = testcase.findall("error")
        assert error.get("type") == "error" and "kernel launch failed" in error.text


def test_not_run_results_are_skipped_with_their_reasons(junit) -> None:
    root, _, _ = junit
    assert all(t.find("skipped").get("message") == "unavailable: needs a library this machine "
               "lacks" for t in _cases(root, "missing"))
    assert all(t.find("skipped").get("message") == "unsupported: this kernel takes no sparse "
               "table" for t in _cases(root, "refuses"))
    assert all(t.find("skipped") is None for t in _cases(root, "rounded"))


def test_known_bugs_are_marked_and_the_run_suite_holds_the_unseen_expectation(junit) -> None:
    root, _, _ = junit
    for testcase in _cases(root, "known-broken"):
        skipped = testcase.find("skipped")
        assert skipped.get("type") == "known-bug"
        assert skipped.get("message") == "known bug F99 (docs/findings.md F99): disagree"
        assert "replay: difftest repro" in skipped.text
        assert testcase.find("properties/property[@name='known_bug']").get("value") == "F99"
    (run,) = _cases(root, "difftest run")
    assert run.get("name") == "expected bug F98 shows"
    assert "did not show" in run.find("failure").text


def test_merge_writes_junit_of_the_merged_report(junit, monkeypatch) -> None:
    root, tmp, _ = junit
    monkeypatch.setenv("DIFFTEST_EXPECTATIONS", str(tmp / "expectations.json"))
    assert main(["merge", str(tmp / "r.json"), "-o", str(tmp / "m.json"),
                 "--junit", str(tmp / "m.xml")]) == 0
    merged = ET.parse(tmp / "m.xml").getroot()
    keys = ("tests", "failures", "errors", "skipped")
    assert [merged.get(k) for k in keys] == [root.get(k) for k in keys]
