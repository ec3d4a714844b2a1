"""A case is bit-identical on every device: GPU data, caches and tables equal the CPU's."""

from __future__ import annotations

import pytest
import torch
from difftest.cases.corpus import load_corpus

from difftest.backend import RunInputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


@pytest.mark.parametrize("case", load_corpus(), ids=lambda c: c.name)
def test_gpu_inputs_equal_cpu_inputs_bit_for_bit(case) -> None:
    cpu = RunInputs(case, torch.device("cpu"))
    gpu = RunInputs(case, torch.device("cuda"))
    for name in ("query", "k_stored", "v_stored"):
        a, b = getattr(cpu.data, name), getattr(gpu.data, name).cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for order in ("plain", "shuffled"):
        a, b = cpu.cache(order).raw, gpu.cache(order).raw.cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), order
    for a, b in zip(cpu.sparse_table, gpu.sparse_table, strict=True):
        assert torch.equal(a, b.cpu())
    for name in ("slots", "tokens", "starts", "context_lens"):
        a, b = getattr(cpu.data.segments, name), getattr(gpu.data.segments, name)
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name
    assert torch.equal(cpu.data.block_ids, gpu.data.block_ids.cpu())
    assert torch.equal(cpu.data.written, gpu.data.written.cpu())
