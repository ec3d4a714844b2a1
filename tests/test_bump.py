"""``difftest bump``: both releases in place, the same cases on both sides, the reach, the gate
and one verdict line, with the gate's exit status.

The orchestration runs on a plug-in backend that takes an AITER release (its tree chosen by
``$DIFFTEST_AITER``, as the real ones) and computes the reference, wrong where its tree holds
a ``BUG`` file: every outcome controlled. Each bump is two ``difftest run`` processes, so the
CPU suite runs the failing one; the passing one and a bump of AITER's own
``unified_attention`` from two copies of v0.1.20.post1 (``$DIFFTEST_AITER_REPO``), the
candidate's with a launcher assertion planted, run nightly (tests/test_aiter_reach.py plants
the same assertion in-process).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from difftest import cli
from difftest.frontends.pytest_run import chosen_profile
from difftest.reporting.report import read_report
from difftest.run.bump import KINDS, Bump, BumpError
from tests.aiter_trees import aiter_tree

PLUGIN = '''
import os
from pathlib import Path

import torch

from difftest.backends.torch_ref import TorchReference
from difftest.contract.backend import Precision


class Released(TorchReference):
    """The reference in float16 from the AITER tree $DIFFTEST_AITER names; wrong where that
    tree holds a BUG file."""

    name = "released"
    releases = ("aiter",)

    def __init__(self):
        self.tree = Path(os.environ.get("DIFFTEST_AITER", "."))

    def precision(self, case, device):
        return Precision("float16", "float16", "float16")

    def versions(self):
        return {"amd-aiter": self.tree.name, "aiter_path": str(self.tree / "aiter")}

    def run(self, inputs):
        out = self.reference(inputs).output.to(torch.float16)
        if (self.tree / "BUG").exists():
            out = out + 1
        return out


DIFFTEST_BACKENDS = [Released]
'''


def _trees(tmp_path: Path, bug: bool) -> tuple[Path, Path, Path]:
    plugin = tmp_path / "released.py"
    plugin.write_text(PLUGIN)
    old, new = tmp_path / "0.0.1", tmp_path / "0.0.2"
    for tree in (old, new):
        (tree / "aiter").mkdir(parents=True)
    if bug:
        (new / "BUG").write_text("")
    return plugin, old, new


def _bump(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["bump", *args, "--device", "cpu", "--report-dir",
                     str(tmp_path / "reports")])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


NIGHTLY = pytest.mark.skipif(chosen_profile() != "nightly", reason="each bump is two difftest "
                             "run processes: the nightly profile runs this one "
                             "(HYPOTHESIS_PROFILE=nightly)")


@pytest.mark.parametrize("bug", [pytest.param(False, marks=NIGHTLY), True])
def test_a_bump_runs_the_baselines_cases_on_the_candidate_and_ends_in_the_gates_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bug: bool) -> None:
    plugin, old, new = _trees(tmp_path, bug)
    code, out = _bump(tmp_path, capsys, "aiter", str(old), str(new), "--backends", "released",
                      "--plugin", str(plugin), "--examples", "1", "--no-corpus")
    lines = out.strip().splitlines()
    assert code == (1 if bug else 0), out
    assert lines[0] == f"bump aiter {old} -> {new} on released"
    reports = tmp_path / "reports"
    baseline, candidate = (read_report(reports / f"{s}.json") for s in ("baseline", "candidate"))
    assert [c["case_id"] for c in candidate["cases"]] == [c["case_id"] for c in baseline["cases"]]
    assert candidate["config"]["cases_from"] == str(reports / "baseline.json")
    assert baseline["config"]["reach"]["tracer"].startswith("coverage.py")
    assert any(line.startswith(f"baseline DIFFTEST_AITER={old}: ") and "exit 0: PASSED" in line
               for line in lines)
    assert "  backend released: amd-aiter: 0.0.1 -> 0.0.2" in lines
    pairs = len(baseline["cases"])
    if bug:
        assert "FAIL new disagree" in out
        assert lines[-1].startswith(f"BUMP FAILED: AITER {old} -> {new}: ")
        assert f"regression(s) in {pairs} cases, {pairs} (case, backend) pairs" in lines[-1]
        assert lines[-2].startswith("GATE FAILED")
    else:
        assert lines[-1].startswith(f"BUMP PASSED: AITER {old} -> {new}: no regression in "
                                    f"{pairs} cases, {pairs} (case, backend) pairs; ")
    assert lines[-1].endswith(f"reports in {reports}")
    assert (reports / "baseline.log").is_file() and (reports / "candidate.log").is_file()


def test_the_default_backends_are_those_that_take_the_release_and_run_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_name: str) -> None:
    from difftest.machine import devices

    if device_name == "cpu":  # a GPU process keeps its runtime (conftest's device_name)
        devices.prepare_runtime("cpu")
    vllm = Bump(KINDS["vllm"], "0.33.0", "0.34.0", tmp_path)
    monkeypatch.setenv("DIFFTEST_VLLM", "")
    chosen = vllm.choose_backends("")  # the venv's vLLM
    assert {"triton-unified", "vllm-decode-attention", "vllm-paged-decode",
            "vllm-triton-sparse", "vllm-aiter@emulated"} <= set(chosen)
    assert not any(name.startswith(("aiter-", "torch-ref")) for name in chosen)
    assert any(line.startswith("vllm-aiter (") for line in vllm.left_out)  # no AMD GPU here
    aiter = Bump(KINDS["aiter"], "a", "b", tmp_path)
    monkeypatch.setenv("DIFFTEST_AITER", "")
    if device_name == "cpu" or devices.gpu_vendor() == "amd":
        assert {"aiter-unified", "aiter-unified@shuffled", "aiter-pa-decode"} <= set(
            aiter.choose_backends(""))
    else:  # AITER's Triton kernels target AMD GPUs: none runs on this one
        with pytest.raises(BumpError, match="no backend that takes an AITER release runs here"):
            aiter.choose_backends("")
    with pytest.raises(BumpError, match=r"--backends aiter-unified\[aiter=v0.1.19\]: names its "
                       r"AITER release; the bump chooses it on each side \(drop aiter=\)"):
        Bump(KINDS["aiter"], "a", "b", tmp_path, ["aiter-unified[aiter=v0.1.19]"])


def test_a_release_that_cannot_be_put_in_place_is_exit_2_naming_what_to_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFTEST_AITER_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("DIFFTEST_AITER_REPO", str(tmp_path / "no-such-repo"))
    code, out = _bump(tmp_path, capsys, "aiter", "v9.9.8", "v9.9.9")
    assert code == 2
    assert ("difftest bump: aiter=v9.9.8: fetching tag v9.9.8 of "
            f"{tmp_path / 'no-such-repo'} failed") in out
    assert "bash scripts/fetch_aiter.sh v9.9.8" in out
    assert not (tmp_path / "reports").exists()


ASSERTION = '    assert causal, "Only causal attention is supported"\n'


@NIGHTLY
def test_a_planted_launcher_assertion_fails_an_aiter_bump(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tag = aiter_tree("v0.1.20.post1")
    trees = []
    for name in ("base", "cand"):
        shutil.copytree(tag.package / "ops" / "triton", tmp_path / name / "aiter/ops/triton")
        shutil.copy(tag.package.parent / "difftest-aiter-version", tmp_path / name)
        trees.append(tmp_path / name)
    host = trees[1] / "aiter/ops/triton/attention/unified_attention.py"
    host.write_text(host.read_text().replace(
        ASSERTION, '    assert causal and q.shape[0] < 0, "planted"\n'))
    code, out = _bump(tmp_path, capsys, "aiter", str(trees[0]), str(trees[1]), "--backends",
                      "aiter-unified", "--examples", "1", "--no-corpus")
    lines = out.strip().splitlines()
    assert code == 1, out
    assert "    ops/triton/attention/unified_attention.py: 1 of 1 changed statements ran" in lines
    assert "FAIL new error" in out and lines[-1].startswith("BUMP FAILED: AITER ")


def test_choosing_backends_leaves_the_processs_release_setting_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_name: str) -> None:
    """The baseline's release is set only while the backends are probed: a later backend of
    the same process loads the release it would have loaded."""
    from difftest.machine import devices

    if device_name == "cpu":
        devices.prepare_runtime("cpu")
    monkeypatch.delenv("DIFFTEST_VLLM", raising=False)
    monkeypatch.setenv("DIFFTEST_AITER", "mine")
    for kind, before in (("vllm", None), ("aiter", "mine")):
        try:
            Bump(KINDS[kind], "a", "b", tmp_path).choose_backends("0.34.0")
        except BumpError:
            pass  # none available with that release here: the setting must be back all the same
        assert os.environ.get(KINDS[kind].env) == before
