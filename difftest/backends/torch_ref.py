"""``torch-ref``: the float64 reference, computed from the logical tokens.

It never reads the physical cache or its views: each query row gathers the stored K/V of the
tokens the framework's sparse table says it attends, straight from the generated per-block
data, dequantises them (``stored * scale`` in float64, the scale applied to the sums) and
runs a plain softmax. With several KV heads (GQA) query head ``h`` reads KV head
``h // (Hq / Hkv)``: one pass per KV head over its group of query heads.

All rows at once (in chunks of at most ``ELEMENTS_PER_CHUNK`` gathered values, which only
very large cases need): each row's segments (``data.segments``) are gathered as whole
blocks, ``[rows, width * block_size, D]``, and the tokens past a segment's length (or
outside the window) are masked, so there is no Python per row and no host synchronisation.
The output (logits, softmax, ``P V``) is float64: on an H200 float64 GEMMs run at float32's
rate (tensor-core DGEMM), and a float32 reference would use up the whole budget of a float32
backend (3.6e-7 of ``sum p|v|``). The old per-chunk, per-token formulation computes the same
sums in another order and scales every value before summing; how far the two may differ is
derived in ``docs/performance.md`` and checked by ``tests/test_reference_fast.py``.
On a GPU the gathers and GEMMs are two fused Triton kernels instead
(:mod:`backends._reference_triton`, reading fp8 blocks as bytes and others as float32): the
same float64 and float32 sums in other orders, the same scale, softcap and softmax in torch;
``tests/test_reference_fast.py`` checks them against the old formulation within the same
bounds on the GPU and, under the interpreter, on the CPU.

The two magnitudes the tolerance needs, ``A = sum_i p_i |v_i|`` (``abs_output``) and
``M = max_i ||q o k_i||_2 * scale`` (``logit_magnitude``), are sums of nonnegative terms
computed in float32 (GEMMs in full float32: TF32 and oneDNN's reduced modes are switched off
around them) and returned as float64; they only size the tolerance. Their error against the
float64 formulation (kept as the oracle in ``tests/test_reference_magnitudes.py``), with
``u = 2^-24``, ``w = 2^-53`` and ``g(n, u) = n u / (1 - n u)``:

* ``A``: ``fl32(p_i) = p_i (1 + a)``, ``|a| <= u`` (or an absolute ``2^-150`` below float32's
  normal range); ``|v_i|`` of a bf16/fp16/fp8 value is exact in float32. Each cache
  block's sum is one float32 GEMM: the product and the at most ``B - 1`` additions (any
  order, with or without FMA) put every term within a factor ``(1 + u)^(B + 1)`` of its exact
  value (``B`` = block size, 128 for the model), and since all terms are nonnegative the
  block's sum is within ``g(B + 1, u)`` relatively; the blocks' sums are added in float64
  (``g(W, w)``, ``W`` blocks).
  The float64 formulation is within ``g(L, w)``, ``L = B W``, and both are scaled by
  ``v_scale`` in float64: ``|A32 - A64| <= (g(B + 1, u) + 2 g(L + 2, w)) A64
  + L 2^-126 max(1, max|v|) v_scale`` (the last term covers a GEMM that flushes subnormal
  weights or products): ``7.7e-6`` relatively at ``B = 128`` (``3.1e-5`` at the largest
  block, 512), at any length (one float32 GEMM over all
  2048 tokens of a production row would allow ``1.2e-4`` and moved the greatest
  error/tolerance of 4 of the 412 verdicts of ``tests/test_bit_identical.py`` by more than
  1e-6, up to 1.6e-6; per block, at most 6.6e-7).
* ``M``: ``q^2`` of a bf16/fp16 query and ``k^2`` of a bf16/fp16/fp8 value are exact in
  float32 (8-/11-bit significands squared; exact while ``2^-63 <= |x| < 2^64``, which generated
  data never leaves), float32 and fp8 (float64 ``stored * q_scale``) queries cost up to three
  roundings; the products and ``D - 1`` additions bring ``g(D + 3, u)`` on the sum ``S``, and
  ``sqrt`` halves it. ``sqrt``, the positive scale and the softcap are monotone, so the max
  over tokens is taken on the float32 sums and commutes with them exactly; the float64 side
  adds ``g(D + 6, w)``: ``|M32 - M64| <= (g(D + 3, u) + g(D + 6, w)) M64``, ``7.8e-6`` for
  ``D = 128``.

A tolerance is ``3 (e_w A + u_out |o| + eta)`` with ``e_w = u_p + u_kv + expm1(x)``,
``x = 2 r u_op 3 M``; with ``A`` and ``M`` off by relative ``rho_A`` and ``rho_M`` it moves by
at most ``(1 + rho_A) exp((1 + x) rho_M) - 1`` relatively (``log expm1`` has slope
``1 + 1 / expm1(x) <= 1 + 1 / x``), plus ``3 e_w`` times ``A``'s absolute term.

Kernel modes: a logit softcap ``c`` maps each scaled logit ``s`` to ``c * tanh(s / c)``
(float64 ``tanh``, which saturates at any ``|s / c|``); a sliding window ``W`` masks every
attended token but the row's last ``W``. A kernel that evaluates the softcap's ``tanh`` from
exponentials in its working precision loses about ``c * u`` absolutely on each logit, so the
logit magnitude handed to the tolerance grows by ``c``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch

from difftest.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.case import Case
from difftest.graphs import GraphCache
from difftest.inputs import Segments
from difftest.tolerance import Reference

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
