"""The arguments of one ``unified_attention`` call over every query row of a case.

vLLM's Triton ``unified_attention`` and AITER's (a fork of it) take the same arguments: the
queries (fp8 ones as the stored fp8 values), the K/V views, one sequence per
:func:`difftest.case.selection.kernel_sequences` entry with its last row's block table and
context, the kernel modes and the descales, and the serving terms the case switches on
(sinks, ALiBi slopes, an fp8 output's scale).
"""

from __future__ import annotations

from typing import Any

import torch

from difftest.case.selection import kernel_sequences
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.inputs import serving_terms
from difftest.machine import devices
from difftest.primitives.dtypes import torch_dtype


def unified_attention_arguments(inputs: RunInputs, views: Any) -> dict[str, Any]:
    """The keyword arguments of ``unified_attention`` for ``inputs`` reading ``views``;
    ``out`` is a fresh output tensor, ``max_seqlen_k`` the longest sparse-table row."""
    case = inputs.case
    device = inputs.device
    table, ctx = inputs.sparse_table
    seqs = kernel_sequences(case)
    last = devices.to_device(
        torch.tensor([first + n - 1 for first, n in seqs], dtype=torch.long), table.device)
    lengths = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32)
    query = inputs.data.query
    if case.q_scale:  # the stored fp8 values, exactly (difftest/inputs/case_data.py)
        query = (query / case.q_scale).to(torch_dtype(case.kv_dtype))
    k_scale, v_scale = inputs.scales()
    fp8 = case.is_fp8
    return dict(
        q=query,
        k=views.k,
        v=views.v,
        out=inputs.output(torch_dtype(case.output_dtype)),
        cu_seqlens_q=devices.to_device(lengths.cumsum(0, dtype=torch.int32), device),
        max_seqlen_q=max(n for _, n in seqs),
        seqused_k=ctx[last],
        max_seqlen_k=case.topk * case.block_size,
        softmax_scale=case.softmax_scale,
        causal=True,
        window_size=(case.sliding_window - 1, 0) if case.sliding_window else (-1, -1),
        block_table=table[last],
        softcap=case.softcap,
        q_descale=(devices.to_device(torch.tensor([case.q_scale], dtype=torch.float32), device)
                   if case.q_scale else None),
        k_descale=k_scale if fp8 else None,
        v_descale=v_scale if fp8 else None,
        **serving_arguments(inputs),
    )


def serving_arguments(inputs: RunInputs) -> dict[str, Any]:
    """The serving terms the case switches on, as ``unified_attention`` (vLLM's and AITER's)
    and ``chunked_prefill_paged_decode`` take them: ``sinks`` and ``alibi_slopes`` per query
    head (float32), ``output_scale`` a 1-element float32 tensor (the output then fp8)."""
    case, device = inputs.case, inputs.device
    out: dict[str, Any] = {}
    if case.sinks:
        out["sinks"] = serving_terms.sinks(case, device)
    if case.alibi:
        out["alibi_slopes"] = serving_terms.alibi_slopes(case, device)
    if case.output_scale:
        out["output_scale"] = devices.to_device(
            torch.tensor([case.output_scale], dtype=torch.float32), device)
    return out


def real_output(case: Case, out: torch.Tensor) -> torch.Tensor:
    """A kernel's output in real units: an fp8 output (``output_scale``) times its scale,
    float32; any other as it is."""
    if not case.output_scale:
        return out
    return out.to(torch.float32) * case.output_scale
