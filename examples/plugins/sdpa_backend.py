"""A worked difftest plug-in: torch's ``scaled_dot_product_attention`` over the logical tokens.

Run it beside the reference (docs/plugins.md walks through every part):

    difftest run --plugin examples/plugins/sdpa_backend.py --backends torch-sdpa --device cpu

It reads no KV cache: each query row's attended tokens are taken from the case's stored data
in the order of the row's segments, dequantised to float64, padded to the longest row and
masked (to the last ``sliding_window`` of them where the case has a window), and one SDPA call
computes every row. So it checks the framework's semantics of a
selection (which tokens a row attends) against an independent attention implementation, and
shows everything a backend declares: what it cannot run and why, its rounding stages, what it
writes on a row that attends nothing, and the kernel call it made.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from difftest import (
    Availability,
    Case,
    EmptyRowOutput,
    Precision,
    RunInputs,
    kernel_call,
    length_classes,
)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` under a Python signature: the
    builtin has none for :func:`difftest.kernel_call` to walk."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


# why the parameters that never vary do not (the parameter audit shows them, not as blind)
FIXED = {
    "dropout_p": "inference attention has no dropout",
    "is_causal": "attn_mask holds exactly the tokens each row attends (its causal limit and "
                 "window included)",
    "enable_gqa": "query head h reads KV head h // (Hq / Hkv), as the case's heads are grouped",
}


class TorchSdpa:
    """torch's SDPA in float64 over each query row's attended tokens."""

    name = "torch-sdpa"
    in_page_orders: tuple[str, ...] = ()  # it reads no cache, so none is built for it

    def availability(self) -> Availability:
        """torch is all it needs."""
        return Availability(True)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """SDPA has no logit softcap."""
        if case.softcap:
            return "scaled_dot_product_attention has no logit softcap"
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """q, K and V dequantised to float64, softmax in float64, the output stored in the
        query dtype. Not float32: torch's CPU SDPA flushes float32 weights below the normal
        range to zero, which float32 rounding stages do not allow (docs/plugins.md)."""
        return Precision(operands="float64", probabilities="float64", output=case.query_dtype)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """A row that attends nothing is written 0."""
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        """torch's version: SDPA is torch's."""
        return {"torch": torch.__version__}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One SDPA call over every query row: ``[total_q, Hq, D]`` in the query dtype."""
        case, data = inputs.case, inputs.data
        longest = max(max((row.context_len for row in inputs.rows), default=0), 1)
        kv = torch.zeros((2, case.total_q, case.num_kv_heads, longest, case.head_dim),
                         dtype=torch.float64, device=inputs.device)
        mask = torch.zeros((case.total_q, 1, 1, longest), dtype=torch.bool,
                           device=inputs.device)
        for n, row in enumerate(inputs.rows):
            at = 0
            for segment in row.segments:  # attend order: full blocks, then the tail
                slot = data.slot_of[segment.physical_block]
                tokens = slice(at, at + segment.tokens)
                # stored [block_size, Hkv, D] -> [Hkv, tokens, D]
                kv[0, n, :, tokens] = data.k_stored[slot, :segment.tokens].transpose(0, 1)
                kv[1, n, :, tokens] = data.v_stored[slot, :segment.tokens].transpose(0, 1)
                at += segment.tokens
            window = case.sliding_window or at  # the last W of the row's attended tokens
            mask[n, ..., max(at - window, 0):at] = True
        key, value = kv[0] * case.k_scale, kv[1] * case.v_scale  # the values a kernel sees
        arguments = dict(query=data.query.to(torch.float64)[:, :, None], key=key, value=value,
                         attn_mask=mask, scale=case.softmax_scale, enable_gqa=True)
        out = sdpa(**arguments)[:, :, 0]
        attends = mask[:, 0, 0].any(-1)
        out = torch.where(attends[:, None, None], out, 0.0)  # declared: empty rows are 0
        inputs.state(kernel_call(sdpa, arguments, labels={
            "key": f"{case.kv_dtype} dequantised to float64, padded to the longest row",
            "value": f"{case.kv_dtype} dequantised to float64, padded to the longest row",
            "attn_mask": length_classes(
                (row.context_len for row in inputs.rows), case.block_size),
            "scale": "head_dim**-0.5" if math.isclose(case.softmax_scale, case.head_dim**-0.5)
                     else "another scale",
        }, fixed=FIXED, sizes={"head_dim": (case.head_dim, "query.shape[3]")}))
        return out.to(getattr(torch, case.query_dtype))


DIFFTEST_BACKENDS = [TorchSdpa()]
