"""A case is bit-identical on every device: GPU data, caches and tables equal the CPU's."""

from __future__ import annotations

import pytest
import torch

from difftest.contract.backend import RunInputs
from difftest.generation.corpus import load_corpus
from difftest.inputs.case_data import _draw_stored, quantize
from difftest.primitives import counter_rng
from difftest.primitives.dtypes import KV_DTYPES, torch_dtype

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
    for name in ("slots", "tokens", "first", "context_lens"):
        a, b = getattr(cpu.data.segments, name), getattr(gpu.data.segments, name)
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name
    assert torch.equal(cpu.data.block_ids, gpu.data.block_ids.cpu())
    assert torch.equal(cpu.data.written, gpu.data.written.cpu())


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("scale", [2.0**-14, 1e-3, 0.05, 1.0, 3.7, 1e3])
def test_fused_draw_and_quantise_equals_the_cpu_draw_then_quantise(kv_dtype: str,
                                                                    scale: float) -> None:
    """The GPU's one-kernel draw-divide-saturate-cast gives the CPU's bytes at scales that
    push the values to saturation (small scales) and into fp8's subnormals (large ones)."""
    rows = torch.arange(0, 4096, 7)
    cpu = _draw_stored(5, 2, rows, 256, "normal", kv_dtype, scale)
    gpu = _draw_stored(5, 2, rows.cuda(), 256, "normal", kv_dtype, scale).cpu()
    assert gpu.dtype == cpu.dtype == torch_dtype(kv_dtype)
    assert torch.equal(gpu.view(torch.uint8), cpu.view(torch.uint8))
    expected = quantize(counter_rng.normal_rows(5, 2, rows, 256), kv_dtype, scale)
    assert torch.equal(cpu.view(torch.uint8), expected.view(torch.uint8))
