"""``torch-ref``: the float64 reference, computed from the logical tokens.

It never reads the physical cache or its views: each query row gathers the stored K/V of the
tokens the framework's sparse table says it attends, straight from the generated per-block
data, dequantises them (``stored * scale`` in float64, the scale applied to the sums) and
runs a plain softmax.

All rows at once (in chunks of at most ``ELEMENTS_PER_CHUNK`` gathered values, which only
very large cases need): each row's segments (``data.segments``) are gathered as whole
128-token blocks, ``[rows, width * 128, D]``, and the tokens past a segment's length (or
outside the window) are masked, so there is no Python per row and no host synchronisation.
Everything stays float64: on an H200 float64 GEMMs run at float32's rate (tensor-core DGEMM),
and a float32 reference would use up the whole budget of a float32 backend (3.6e-7 of
``sum p|v|``). The old per-chunk, per-token formulation computes the same sums in another
order and scales every value before summing; how far the two may differ is derived in
``docs/performance.md`` and checked by ``tests/test_reference_fast.py``.

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

ELEMENTS_PER_CHUNK = 1 << 25  # gathered values of K (or V) per chunk: 256 MiB in float64


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
        case, data, device = inputs.case, inputs.data, inputs.device
        seg = data.segments
        f64 = torch.float64
        shape = (case.total_q, case.num_q_heads, case.head_dim)
        out = torch.zeros(shape, dtype=f64, device=device)
        abs_out = torch.zeros(shape, dtype=f64, device=device)
        magnitude = torch.zeros(shape[:2], dtype=f64, device=device)
        length = seg.width * case.block_size
        if length == 0:
            return Reference(out, abs_out, magnitude, seg.context_lens)
        k_stored, v_stored = data.k_stored[:, :, 0], data.v_stored[:, :, 0]  # [blocks, 128, D]
        query = data.query.to(f64)
        token = torch.arange(case.block_size, device=device)
        rows_per_chunk = max(1, ELEMENTS_PER_CHUNK // (length * case.head_dim))
        for start in range(0, case.total_q, rows_per_chunk):
            rows = slice(start, min(start + rows_per_chunk, case.total_q))
            slots = seg.slots[rows]
            n = slots.shape[0]
            mask = token < seg.tokens[rows, :, None]  # [R, width, 128]
            if case.sliding_window:
                ordinal = seg.starts[rows, :, None] + token
                mask &= ordinal >= seg.context_lens[rows, None, None] - case.sliding_window
            mask = mask.view(n, 1, length)
            # the scales multiply the sums, not every gathered value (docs/performance.md)
            k = k_stored[slots].to(f64).view(n, length, -1)  # [R, L, D] stored values
            q = query[rows]  # [R, H, D]
            scores = torch.einsum("rhd,rld->rhl", q, k) * (case.softmax_scale * case.k_scale)
            if case.softcap:
                scores = case.softcap * torch.tanh(scores / case.softcap)
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
            prod = torch.einsum("rhd,rld->rhl", q * q, k.square_()).sqrt()
            prod = prod * (case.softmax_scale * case.k_scale) + case.softcap
            magnitude[rows] = prod.masked_fill(~mask, 0).amax(dim=-1)
            v = v_stored[slots].to(f64).view(n, length, -1)
            out[rows] = torch.einsum("rhl,rld->rhd", probs, v) * case.v_scale
            abs_out[rows] = torch.einsum("rhl,rld->rhd", probs, v.abs_()) * case.v_scale
        return Reference(out, abs_out, magnitude, seg.context_lens)
