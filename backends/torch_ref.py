"""``torch-ref``: the float64 reference, computed from the logical tokens.

It never reads the physical cache or its views: each query row gathers the stored K/V of the
tokens the framework's sparse table says it attends, straight from the generated per-block
data, dequantises them exactly (``stored * scale`` in float64) and runs a plain softmax.

Kernel modes: a logit softcap ``c`` maps each scaled logit ``s`` to ``c * tanh(s / c)``
(float64 ``tanh``, which saturates at any ``|s / c|``); a sliding window ``W`` masks every
attended token but the row's last ``W``. A kernel that evaluates the softcap's ``tanh`` from
exponentials in its working precision loses about ``c * u`` absolutely on each logit, so the
logit magnitude handed to the tolerance grows by ``c``.
"""

from __future__ import annotations

import torch

from difftest.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.case import Case
from difftest.tolerance import Reference

ROWS_PER_CHUNK = 64


class TorchReference:
    """The reference backend (float64, any device)."""

    name = "torch-ref"
    in_page_orders: tuple[str, ...] = ()

    def availability(self) -> Availability:
        """Always available."""
        return Availability(True)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """Supports every valid case."""
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """float64 throughout."""
        return Precision("float64", "float64", "float64")

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """Empty rows are 0."""
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        """torch's version."""
        return {"torch": torch.__version__}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The reference output."""
        return self.reference(inputs).output

    def reference(self, inputs: RunInputs) -> Reference:
        """Output, ``sum p|v|`` and logit magnitudes of every row, float64."""
        case, data = inputs.case, inputs.data
        device = inputs.device
        f64 = torch.float64
        keys = data.k_stored.to(f64).flatten(0, 1)[:, 0] * case.k_scale  # [blocks*128, D]
        values = data.v_stored.to(f64).flatten(0, 1)[:, 0] * case.v_scale
        query = data.query.to(f64)
        ctx = torch.tensor([r.context_len for r in inputs.rows], dtype=torch.int64)
        shape = (case.total_q, case.num_q_heads, case.head_dim)
        out = torch.zeros(shape, dtype=f64, device=device)
        abs_out = torch.zeros(shape, dtype=f64, device=device)
        magnitude = torch.zeros(shape[:2], dtype=f64, device=device)
        index_all = _token_index(inputs, ctx)
        for start in range(0, case.total_q, ROWS_PER_CHUNK):
            stop = min(start + ROWS_PER_CHUNK, case.total_q)
            length = int(ctx[start:stop].max())
            if length == 0:
                continue
            index = index_all[start:stop, :length].to(device)
            ordinal = torch.arange(length)[None]
            mask = ordinal < ctx[start:stop, None]
            if case.sliding_window:
                mask &= ordinal >= ctx[start:stop, None] - case.sliding_window
            mask = mask.to(device)
            k = keys[index]  # [R, L, D]
            v = values[index]
            q = query[start:stop]  # [R, H, D]
            scores = torch.einsum("rhd,rld->rhl", q, k) * case.softmax_scale
            if case.softcap:
                scores = case.softcap * torch.tanh(scores / case.softcap)
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            out[start:stop] = torch.einsum("rhl,rld->rhd", probs, v)
            abs_out[start:stop] = torch.einsum("rhl,rld->rhd", probs, v.abs())
            prod = torch.einsum("rhd,rld->rhl", q * q, k * k).sqrt() * case.softmax_scale
            prod = prod + case.softcap
            magnitude[start:stop] = prod.masked_fill(~mask[:, None, :], 0).amax(dim=-1)
        return Reference(out, abs_out, magnitude, ctx.to(device))


def _token_index(inputs: RunInputs, ctx: torch.Tensor) -> torch.Tensor:
    """``[total_q, max_ctx]`` row-major token indices into the flattened per-block data."""
    case, data = inputs.case, inputs.data
    width = max((len(r.segments) for r in inputs.rows), default=0)
    length = int(ctx.max()) if ctx.numel() else 0
    if width == 0 or length == 0:
        return torch.zeros((case.total_q, max(length, 1)), dtype=torch.int64)
    slots = torch.zeros((case.total_q, width), dtype=torch.int64)
    ends = torch.full((case.total_q, width), length + 1, dtype=torch.int64)
    for n, row in enumerate(inputs.rows):
        if row.segments:
            slots[n, : len(row.segments)] = torch.tensor(
                [data.slot_of[s.physical_block] for s in row.segments])
            ends[n, : len(row.segments)] = torch.tensor([s.tokens for s in row.segments]).cumsum(0)
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
    pos = torch.arange(length).expand(case.total_q, length).contiguous()
    seg = torch.searchsorted(ends, pos, right=True).clamp(max=width - 1)
    index = slots.gather(1, seg) * case.block_size + pos - starts.gather(1, seg)
    return torch.where(pos < ctx[:, None], index, 0)
