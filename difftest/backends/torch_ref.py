"""``torch-ref``: the float64 reference, computed from the logical tokens.

It never reads the physical cache or its views: each query row gathers the stored K/V of the
tokens the framework's sparse table says it attends, dequantises them and runs a plain
softmax, all rows at once, in float64 (with several KV heads, query head ``h`` reads KV
head ``h // (Hq / Hkv)``); on a GPU through two fused Triton kernels. It also
returns the two magnitudes the tolerance needs (``abs_output``, ``logit_magnitude``), summed
in float32. The formulation, the kernel modes and the error bounds: docs/reference.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch

from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.contract.tolerance import Reference
from difftest.inputs.case_data import Segments
from difftest.primitives.cuda_graphs import GraphCache

if TYPE_CHECKING:
    from difftest.backends._reference_triton import Stored

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

    def working_bytes(self, case: Case) -> int:
        """The float64 gathers of K and V (a chunk of at most :data:`ELEMENTS_PER_CHUNK`
        values each) and of the logits and weights (as many)."""
        width = max((sum(1 for b in row if b >= 0) for row in case.selections), default=0)
        gathered = min(case.total_q * width * case.block_size * case.head_dim, ELEMENTS_PER_CHUNK)
        logits = case.total_q * case.num_q_heads * width * case.block_size
        return 8 * (2 * gathered + 2 * min(logits, ELEMENTS_PER_CHUNK))

    def reference(self, inputs: RunInputs) -> Reference:
        """Output, ``sum p|v|`` and logit magnitudes of every row, float64 (the magnitudes
        computed in float32, within the module's bound); on a GPU through a CUDA graph once
        the case's shapes and mode repeat (the same kernels, so the same bits)."""
        case, data, device = inputs.case, inputs.data, inputs.device
        seg = data.segments
        length = seg.width * case.block_size
        if length == 0:
            shape = (case.total_q, case.num_q_heads, case.head_dim)
            zeros = torch.zeros(shape, dtype=torch.float64, device=device)
            return Reference(zeros, zeros.clone(), zeros[..., 0].clone(), seg.context_lens)
        mode = _Mode(case.block_size, case.softmax_scale * case.k_scale, case.v_scale,
                     case.softcap, case.sliding_window,
                     max(1, ELEMENTS_PER_CHUNK // (length * case.head_dim)))
        # GQA: query head h reads KV head h // (Hq / Hkv); one pass per KV head
        group = case.queries_per_kv
        parts = []
        for g in range(case.num_kv_heads):
            query = data.query[:, g * group:(g + 1) * group]
            if case.num_kv_heads > 1:  # contiguous operands (one head: the tensors as they are)
                query = query.contiguous()
            args = (query, data.k_stored[:, :, g].contiguous(),  # [blocks, B, D]
                    data.v_stored[:, :, g].contiguous(),
                    seg.slots, seg.tokens, seg.starts, seg.context_lens)
            parts.append(_GRAPHS(_sums, args, mode))
        out, abs_out, magnitude = (torch.cat(p, dim=1) if len(parts) > 1 else p[0]
                                   for p in zip(*parts, strict=True))
        return Reference(out, abs_out, magnitude, seg.context_lens)


class _Mode(NamedTuple):
    """What :func:`_sums` needs of a case besides its tensors (hashable: a graph's key)."""

    block_size: int
    logit_scale: float
    v_scale: float
    softcap: float
    sliding_window: int
    rows_per_chunk: int


_GRAPHS = GraphCache(capacity=2, copy_outputs=True)


def _sums(query: torch.Tensor, k_stored: torch.Tensor, v_stored: torch.Tensor,
          slots: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor,
          context_lens: torch.Tensor, mode: _Mode) -> tuple[torch.Tensor, ...]:
    """The reference's output, ``sum p|v| * v_scale`` and logit magnitudes, by chunks of
    rows; a pure function of its tensors and ``mode``, with no host synchronisation."""
    f64, f32 = torch.float64, torch.float32
    seg = Segments(slots, tokens, starts, context_lens)
    total_q = query.shape[0]
    out = torch.zeros(query.shape, dtype=f64, device=query.device)
    abs_out = torch.zeros(query.shape, dtype=f64, device=query.device)
    magnitude = torch.zeros(query.shape[:2], dtype=f64, device=query.device)
    query_sq = query.to(f32).square()  # exact but for float32 and fp8 (float64) q
    query = query.to(f64)
    chunk = _chunk_torch
    if _triton_reads(k_stored):  # the kernels' operands, once for every chunk (exact)
        from difftest.backends._reference_triton import readable

        chunk, k_stored, v_stored = _chunk_triton, readable(k_stored), readable(v_stored)
    for start in range(0, total_q, mode.rows_per_chunk):
        rows = slice(start, min(start + mode.rows_per_chunk, total_q))
        out[rows], abs_sum, sums = chunk(mode, seg, rows, query[rows], query_sq[rows],
                                         k_stored, v_stored)
        # max of the sums first: sqrt, the positive scale and the softcap are monotone,
        # so the max commutes with them exactly; -1 marks a row that attends nothing
        largest = sums.amax(dim=-1).to(f64)
        row_magnitude = largest.clamp(min=0).sqrt() * mode.logit_scale + mode.softcap
        magnitude[rows] = row_magnitude.masked_fill(largest < 0, 0.0)
        abs_out[rows] = abs_sum * mode.v_scale
    return out, abs_out, magnitude


Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _softcapped(mode: _Mode, scores: torch.Tensor) -> torch.Tensor:
    """``c * tanh(s / c)`` of the scaled logits (float64), or them if the case has no cap."""
    return mode.softcap * torch.tanh(scores / mode.softcap) if mode.softcap else scores


def _chunk_torch(mode: _Mode, seg: Segments, rows: slice, q: torch.Tensor,
                 q_sq: torch.Tensor, k_stored: torch.Tensor, v_stored: torch.Tensor) -> Chunk:
    """One chunk of rows: ``sum p v * v_scale``, ``sum p |v|`` and the float32 ``q^2 . k^2``
    sums (``-1`` where masked), from gathered blocks and torch GEMMs."""
    f64, f32 = torch.float64, torch.float32
    slots = seg.slots[rows]
    n, length = slots.shape[0], seg.width * mode.block_size
    token = torch.arange(mode.block_size, device=slots.device)
    mask = token < seg.tokens[rows, :, None]  # [R, width, B]
    if mode.sliding_window:
        ordinal = seg.starts[rows, :, None] + token
        mask &= ordinal >= seg.context_lens[rows, None, None] - mode.sliding_window
    mask = mask.view(n, 1, length)
    # the scales multiply the sums, not every gathered value (docs/performance.md)
    k_gathered = k_stored[slots].view(n, length, -1)  # [R, L, D] stored values
    k = k_gathered.to(f64)
    scores = _softcapped(mode, torch.einsum("rhd,rld->rhl", q, k) * mode.logit_scale)
    del k
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    v = v_stored[slots].view(n, length, -1)
    out = torch.einsum("rhl,rld->rhd", probs, v.to(f64)) * mode.v_scale
    with _full_float32_matmul():
        # nonnegative sums in float32, within the module docstring's bound
        k_sq = k_gathered.to(f32).square_()
        sums = torch.einsum("rhd,rld->rhl", q_sq, k_sq)
        del k_sq
        # per block, the blocks' sums added in float64
        weights = probs.to(f32).view(n, -1, seg.width, mode.block_size)
        sizes = v.to(f32).abs_().view(n, seg.width, mode.block_size, -1)
        abs_sum = torch.einsum("rhwt,rwtd->rhwd", weights, sizes).to(f64).sum(dim=2)
    return out, abs_sum, sums.masked_fill(~mask, -1.0)


def _triton_reads(k_stored: torch.Tensor) -> bool:
    """Whether :mod:`backends._reference_triton` computes this case: on a CUDA/ROCm GPU, for
    blocks and head sizes its tiles cover (``tl.arange`` needs powers of two, the head size
    whole chunks); other geometries (head sizes 80 and 96, 48-token blocks) run in torch."""
    _, block, dim = k_stored.shape
    return (k_stored.device.type == "cuda" and _power_of_two(block) and block >= 16
            and _power_of_two(dim) and dim >= 32)


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _chunk_triton(mode: _Mode, seg: Segments, rows: slice, q: torch.Tensor,
                  q_sq: torch.Tensor, k_stored: Stored, v_stored: Stored) -> Chunk:
    """:func:`_chunk_torch`'s three results from two fused kernels that read the blocks
    themselves (``k_stored``/``v_stored`` as the kernels read them; the same sums in other
    orders; the same softmax)."""
    from difftest.backends import _reference_triton as kernels

    slots = seg.slots[rows]
    scores, sums = kernels.scores_and_largest(
        q.contiguous(), q_sq.contiguous(), k_stored, slots, seg.tokens[rows], seg.starts[rows],
        seg.context_lens[rows], mode.sliding_window or 0)
    scores.mul_(mode.logit_scale)  # masked logits stay -inf
    if mode.softcap:
        scores = torch.where(scores == float("-inf"), scores, _softcapped(mode, scores))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    out, abs_sum = kernels.weighted_values(probs, v_stored, slots)
    return out.sum(dim=2) * mode.v_scale, abs_sum.to(torch.float64).sum(dim=2), sums


@contextmanager
def _full_float32_matmul() -> Iterator[None]:
    """float32 GEMMs in full float32 (no TF32 on CUDA, no bf16/TF32 in oneDNN on the CPU),
    whatever an imported library (vLLM) set; the settings are restored afterwards through
    the same (new) API, which keeps the legacy ``allow_tf32`` readable."""
    knobs = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [knob.fp32_precision for knob in knobs]
    try:
        for knob in knobs:
            knob.fp32_precision = "ieee"
        yield
    finally:
        for knob, value in zip(knobs, saved, strict=True):
            knob.fp32_precision = value
