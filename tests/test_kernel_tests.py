"""The installed suite's verdicts per (case, backend): `pytest --pyargs difftest.kernel_tests`
with plug-in backends of every kind, read back from pytest's JUnit XML: a known bug's failure
is an expected failure naming the finding, a new failure fails with its replay command, a
refused case and an unavailable backend are skips with their reasons, an agreement passes
(tests/test_packaging.py runs the suite from an installed wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

PLUGIN = '''
import torch
from difftest.backends.torch_ref import TorchReference
from difftest.contract.backend import Availability, Precision


class Rounded(TorchReference):

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


class Refuses(Rounded):
    name = "refuses"

    def unsupported_reason(self, case, device):
        return "this kernel takes no MTP rows" if case.decode_query_len > 1 else None


class Missing(Rounded):
    name = "missing"

    def availability(self):
        return Availability(False, "needs a library this machine lacks")


DIFFTEST_BACKENDS = [Perturbed, KnownBroken, Refuses, Missing]
'''
# three of the corpus's cases (its largest ones cost time, not coverage): one with MTP rows
CORPUS_CASES = ("lbhnc-128-blocks-2048-2040-page-2039", "mtp4-straddles-block-boundary",
                "padded-request-and-empty-selection-fnuz")
EXPECTATIONS = {"expectations": [
    {"finding": "F99", "summary": "a fake known bug", "backends": ["known-broken"],
     "releases": "fake <=1.0", "when": {}}]}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ET.Element]:
    """Each test of the suite's run, by name, from pytest's JUnit XML."""
    tmp = tmp_path_factory.mktemp("suite")
    (tmp / "fakes.py").write_text(PLUGIN)
    (tmp / "expectations.json").write_text(json.dumps(EXPECTATIONS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS"))}
    env.update(DIFFTEST_EXPECTATIONS=str(tmp / "expectations.json"), CI="true")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
         "difftest.kernel_tests", "--difftest-plugin", str(tmp / "fakes.py"),
         "--difftest-backends", "perturbed,known-broken,refuses,missing",
         "--difftest-optional", "missing", "--difftest-device", "cpu",
         "--difftest-search-budget", "1", "--junitxml", "suite.xml",
         "-k", f"test_generated or {' or '.join(CORPUS_CASES)}"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 1, done.stdout + done.stderr  # perturbed fails
    return {case.get("name"): case for case in ET.parse(tmp / "suite.xml").iter("testcase")}


def _corpus(outcomes: dict[str, ET.Element], backend: str) -> list[ET.Element]:
    return [case for name, case in outcomes.items()
            if name.startswith(f"test_corpus[{backend}-")]


def test_a_known_bug_is_an_expected_failure_naming_it(outcomes) -> None:
    for case in _corpus(outcomes, "known-broken"):
        (skipped,) = case.findall("skipped")
        assert skipped.get("type") == "pytest.xfail"
        assert skipped.get("message").startswith(
            "known bug F99 (docs/findings.md): known-broken disagrees with torch-ref on case")


def test_a_new_failure_fails_with_its_replay_command(outcomes) -> None:
    for case in _corpus(outcomes, "perturbed"):
        (failure,) = case.findall("failure")
        assert "perturbed disagrees with torch-ref" in failure.text
        assert "replay: difftest repro" in failure.text and "--plugin" in failure.text
    assert outcomes["test_generated[perturbed]"].find("failure") is not None


def test_refused_cases_and_unavailable_backends_are_skips_with_reasons(outcomes) -> None:
    """(A refusing backend passes the cases it runs.)"""
    refused = [case.find("skipped") for case in _corpus(outcomes, "refuses")]
    messages = {s.get("message") for s in refused if s is not None}
    assert messages == {"unsupported: this kernel takes no MTP rows"}
    assert len(refused) == 3 and 0 < len([s for s in refused if s is not None]) < 3
    ran = [c for c in _corpus(outcomes, "refuses") if c.find("skipped") is None]
    ran.append(outcomes["test_generated[refuses]"])
    assert all(c.find("failure") is None and c.find("error") is None for c in ran)
    for case in [*_corpus(outcomes, "missing"), outcomes["test_generated[missing]"]]:
        assert case.find("skipped").get("message") == (
            "unavailable: needs a library this machine lacks")
