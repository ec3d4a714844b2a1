"""The reference's GPU kernels read fp8 blocks as bytes (difftest/backends/_reference_triton.py):
every byte must decode to the value torch gives it, exactly, in both e4m3 formats.

A one-hot query per head makes each logit one stored K value (``q . k = k[c]``, exact in
float64) and one-hot weights per head make each weighted sum one stored V token, so the
kernels' outputs are the decoded bytes themselves. Runs on a GPU, or on the CPU under
``TRITON_INTERPRET=1`` (the suite's setting).
"""

from __future__ import annotations

import pytest
import torch

from difftest.backends import _reference_triton as kernels
from difftest.machine import devices

BLOCK, DIM = 128, 128


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if devices.interpreted():
        return torch.device("cpu")
    pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")


def _every_byte(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Two blocks ``[2, 128, 128]`` of ``dtype`` holding every byte but the NaN encodings,
    each at many positions (a different order in the second block)."""
    nan = torch.isnan(torch.arange(256, dtype=torch.uint8).view(dtype).float())
    finite = torch.arange(256, dtype=torch.uint8)[~nan]
    count = 2 * BLOCK * DIM
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0))
    raw = finite.repeat(count // finite.numel() + 1)[:count][order]
    return raw.view(dtype).view(2, BLOCK, DIM).to(device)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz],
                         ids=["e4m3fn", "e4m3fnuz"])
def test_every_fp8_byte_is_read_as_its_value(dtype: torch.dtype) -> None:
    device = _device()
    stored = _every_byte(dtype, device)
    readable = kernels.readable(stored)
    assert readable.fmt != kernels.FLOAT32 and readable.values.dtype == torch.int32
    expected = stored.to(torch.float64)
    slots = torch.tensor([[1, 0]], dtype=torch.int64, device=device)  # both, out of order
    eye = torch.eye(DIM, dtype=torch.float64, device=device)[None]  # head h reads dim h
    tokens = torch.full((1, 2), BLOCK, dtype=torch.int64, device=device)
    first = torch.zeros((1, 2), dtype=torch.int64, device=device)
    scores, _ = kernels.scores_and_largest(eye, eye.float(), readable, slots, first, tokens)
    keys = torch.cat([expected[1], expected[0]]).T  # [dim, token] = q_h . k_t
    assert torch.equal(scores[0], keys)
    probs = torch.zeros((1, BLOCK, 2 * BLOCK), dtype=torch.float64, device=device)
    probs[0, torch.arange(BLOCK), torch.arange(BLOCK) + BLOCK] = 1.0  # head h: token h of slot 0
    out, abs_out = kernels.weighted_values(probs, kernels.readable(stored), slots)
    assert torch.equal(out[0, :, 1], expected[0])
    assert torch.equal(out[0, :, 0], torch.zeros_like(expected[0]))
    assert torch.equal(abs_out[0, :, 1], expected[0].abs().float())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz],
                         ids=["e4m3fn", "e4m3fnuz"])
def test_nan_bytes_are_read_as_nan(dtype: torch.dtype) -> None:
    """A NaN byte in a token's K makes that token's logits NaN, and no other token's."""
    device = _device()
    stored = torch.zeros((1, BLOCK, DIM), dtype=dtype)
    nan_bytes = [b for b in range(256)
                 if torch.isnan(torch.tensor([b], dtype=torch.uint8).view(dtype).float())]
    poisoned = torch.arange(len(nan_bytes)) * 5 + 3
    stored.view(torch.uint8)[0, poisoned, 7] = torch.tensor(nan_bytes, dtype=torch.uint8)
    stored = stored.to(device)
    heads = torch.ones((1, 16, DIM), dtype=torch.float64, device=device)
    zero = torch.zeros((1, 1), dtype=torch.int64, device=device)
    scores, _ = kernels.scores_and_largest(
        heads, heads.float(), kernels.readable(stored), zero, zero, zero + BLOCK)
    nan_tokens = torch.isnan(scores[0]).all(dim=0).nonzero().flatten().cpu()
    assert torch.equal(nan_tokens, poisoned)


def test_weights_that_are_a_view_are_read_as_their_values() -> None:
    """Beside a sink the reference's weights are a slice of a wider softmax (``[..., :-1]``,
    rows ``L + 1`` apart): the values kernel must weigh by them, not by the bytes of the
    slice's storage read as if contiguous (the GPU reference did before)."""
    device = _device()
    stored = _every_byte(torch.float8_e4m3fn, device)
    slots = torch.tensor([[1, 0]], dtype=torch.int64, device=device)
    wider = torch.rand((1, 4, 2 * BLOCK + 1), dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1)).to(device)
    view = wider[..., :-1]
    out, _ = kernels.weighted_values(view, kernels.readable(stored), slots)
    values = torch.cat([stored[1], stored[0]]).to(torch.float64)  # [2 * BLOCK, DIM]
    expected = torch.einsum("rhl,ld->rhd", view, values)
    assert torch.allclose(out.sum(dim=2), expected, rtol=1e-12, atol=1e-9)
