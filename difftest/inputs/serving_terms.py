"""The tensors of a case's serving terms: attention sinks, ALiBi slopes, per-token-head scales.

Each is a pure function of the case (the sinks and scales from its seed through the counter
RNG, so bit-identical on every device), in float32 as the kernels read them; the reference
reads the same float32 values exactly in float64. The cache builders and the kernels' adapters
take the scale caches in the layout a kernel reads (:func:`scale_cache`).
docs/kernel-modes.md#serving-terms.
"""

from __future__ import annotations

import math

import torch

from difftest.case.spec import Case
from difftest.primitives import counter_rng

_SINKS, _K_TOKEN_SCALES, _V_TOKEN_SCALES = 7, 8, 9  # counter-RNG streams (case_data uses 1-3)
SINK_SPREAD = 4.0  # sinks ~ N(0, 4^2): from negligible to dominating a row's logits (~N(0, 1))
TOKEN_SCALE_OCTAVES = 2.0  # a token-head scale is the tensor scale times 2^u, |u| <= 2


def sinks(case: Case, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """One sink logit per query head, ``[num_q_heads]`` float32 (``None`` without sinks)."""
    if not case.sinks:
        return None
    index = torch.arange(case.num_q_heads, device=device)
    return (counter_rng.normal(case.seed, _SINKS, index) * SINK_SPREAD).to(torch.float32)


def alibi_slopes(case: Case, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The ALiBi slopes of ``num_q_heads`` heads, ``[num_q_heads]`` float32 (``None``
    without ALiBi): ``2^(-8 h / n)`` for ``h = 1..n`` with ``n`` the power of two at or below
    the head count, the remaining heads interleaved from ``2n`` (Press et al.; vLLM's and
    HuggingFace's ``_get_alibi_slopes``)."""
    if not case.alibi:
        return None
    heads = case.num_q_heads
    closest = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * h / closest) for h in range(1, closest + 1)]
    if closest != heads:
        extra = [2.0 ** (-4.0 * h / closest) for h in range(1, 2 * closest + 1, 2)]
        slopes += extra[: heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def token_head_scales(case: Case, side: str, block_ids: torch.Tensor) -> torch.Tensor:
    """The scale of every token and KV head of the physical blocks ``block_ids`` on ``side``
    (``"k"`` or ``"v"``), ``[len(block_ids), block_size, num_kv_heads]`` float32: the
    case's tensor scale times ``2^u``, ``u`` uniform in ``[-2, 2]``."""
    stream = _K_TOKEN_SCALES if side == "k" else _V_TOKEN_SCALES
    base = case.k_scale if side == "k" else case.v_scale
    per_block = case.block_size * case.num_kv_heads
    u = counter_rng.uniform_rows(case.seed, stream, block_ids, per_block)
    scales = base * torch.exp2((u.to(torch.float64) * 2 - 1) * TOKEN_SCALE_OCTAVES)
    return scales.to(torch.float32).view(-1, case.block_size, case.num_kv_heads)


def scale_cache(case: Case, scales: torch.Tensor, block_ids: torch.Tensor,
                pages: int) -> torch.Tensor:
    """A kernel's per-token-head scale cache over page ids: ``[pages, page_size,
    num_kv_heads]`` float32, page id ``p`` holding the scales of the tokens the layout puts at
    that page on the K side (the same id addresses V's, :mod:`difftest.case.layouts`); every
    other slot 1.0 (written scales of unattended blocks do not exist)."""
    page, stride = case.page_size, case.block_page_stride
    per_block = case.block_size // page
    cache = torch.ones((pages, page, case.num_kv_heads), dtype=torch.float32,
                       device=scales.device)
    ids = (block_ids[:, None] * stride + torch.arange(per_block, device=scales.device)[None])
    cache[ids.reshape(-1)] = scales.reshape(-1, page, case.num_kv_heads)
    return cache
