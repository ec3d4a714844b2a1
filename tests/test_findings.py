"""Pinned findings: behaviour we observed, asserted so that a change upstream is noticed.

Each test documents one finding (docs/findings.md). If one starts failing, the finding no
longer holds: update the backend's declared capabilities and the docs.
"""

from __future__ import annotations

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import INTERPRETER_BF16_FINDING, TritonUnifiedAttention
from difftest.case.spec import Case
from difftest.machine import devices
from difftest.run.runner import Status, run_case

pytestmark = pytest.mark.skipif(not devices.interpreted(),
                                reason="findings about Triton's CPU interpreter")

CASE = Case(num_blocks=128, seq_lens=(200, 130), block_tables=((127, 3), (0, 5)),
            selections=((0, 1, -1), (1, 0, -1)), seed=3)


def test_interpreter_miscomputes_bf16() -> None:
    """F1: unified_attention under TRITON_INTERPRET=1 is wrong by orders of magnitude for bf16
    queries, while the same case with fp16 queries (and bf16 KV) agrees."""
    forced = TritonUnifiedAttention(allow_interpreter_bf16=True)
    cpu = torch.device("cpu")
    bf16 = run_case(CASE.replace(query_dtype="bfloat16"), TorchReference(), [forced], cpu)
    fp16 = run_case(CASE.replace(kv_dtype="bfloat16"), TorchReference(), [forced], cpu)
    assert bf16.results[0].status is Status.DISAGREE
    assert bf16.results[0].comparison.max_ratio > 1e3
    assert fp16.results[0].status is Status.AGREE


def test_bf16_queries_are_declared_unsupported_under_the_interpreter() -> None:
    result = run_case(CASE.replace(query_dtype="bfloat16"), TorchReference(),
                      [TritonUnifiedAttention()], torch.device("cpu"))
    assert result.results[0].status is Status.UNSUPPORTED
    assert result.results[0].detail == INTERPRETER_BF16_FINDING
