"""Faults inside a kernel's computation: a paged decode kernel written in torch, with bugs.

The catalogue (:mod:`mutants.catalog`) plants its bugs in what a real kernel reads (tables,
views, scales, options). These faults live where a kernel's author writes them, in the
kernel's own loop: ``paged-torch`` reads the plain page views through the framework's page
table as a page-``P`` decode kernel does (per row: its pages, its context, the window, each
query head's KV head) and computes in float32; ``paged-torch!<fault>`` is the same kernel
with one line wrong. Each fault declares the :mod:`difftest.judgement.diagnosis` hypothesis
that names it. They run on every case of both families (every layout, KV heads, head size);
load them with ``--plugin mutants.kernel_faults``; ``python -m benchmarks.mutation_benchmark
--catalog mutants.kernel_faults --diagnosis 5`` measures how often the diagnosis names them
(docs/mutation-benchmark.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from difftest.case.selection import before_window, build_rows, window_start
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from mutants.injection import MutantBackend, Mutation

FLOAT32_OVERFLOW_EXP = math.log(torch.finfo(torch.float32).max)  # 88.72
FLOAT32_SUBNORMAL_EXP = -math.log(torch.finfo(torch.float32).tiny)  # 87.34


@dataclass(frozen=True)
class Fault:
    """The lines of :class:`PagedTorch` a fault changes (every field off: the correct kernel)."""

    window_extra: int = 0  # the window's lower bound off by this many tokens (one more read)
    kv_heads_interleaved: bool = False  # query head h reads KV head h % Hkv, not h // G
    heads_page_major: bool = False  # a page read as [Hkv, P, D] (HND) though it is [P, Hkv, D]
    whole_pages_only: bool = False  # the context rounded down to whole pages
    scale_twice: bool = False  # the softmax scale applied to q and again to the logits
    unshifted_softmax: bool = False  # exp(s) without subtracting the row's maximum


class PagedTorch:
    """``paged-torch``: a paged decode kernel in torch, float32, on the plain page views."""

    name = "paged-torch"
    in_page_orders: tuple[str, ...] = ("plain",)

    def __init__(self, fault: Fault = Fault()) -> None:
        self.fault = fault

    def availability(self) -> Availability:
        """Always available."""
        return Availability(True)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """Runs every valid case."""
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """float32 throughout."""
        return Precision("float32", "float32", "float32")

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """Rows without context are 0."""
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        """torch's version."""
        return {"torch": torch.__version__}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """Each row over its pages of the sparse table, in float32."""
        case, views = inputs.case, inputs.cache("plain")
        table, ctx = (t.cpu() for t in inputs.sparse_table)
        out = torch.zeros((case.total_q, case.num_q_heads, case.head_dim), dtype=torch.float32)
        query = inputs.data.query.to(device="cpu", dtype=torch.float32)
        for n, length in enumerate(ctx.tolist()):
            if self.fault.whole_pages_only:
                length -= length % case.page_size
            if length > 0:
                out[n] = self._row(case, views.k, views.v, table[n], length, query[n])
        return out.to(inputs.device)

    def _row(self, case: Case, k_view: torch.Tensor, v_view: torch.Tensor,
             pages: torch.Tensor, length: int, q: torch.Tensor) -> torch.Tensor:
        """``[Hq, D]``: one row of ``length`` context tokens over ``pages``."""
        fault, ps = self.fault, case.page_size
        used = pages[: -(-length // ps)].long()
        k, v = (self._tokens(view, used)[:length].float() for view in (k_view, v_view))
        k, v = k * case.k_scale, v * case.v_scale  # [L, Hkv, D]
        first = window_start(length, case.sliding_window + fault.window_extra
                             if case.sliding_window else 0)
        k, v = k[first:], v[first:]
        scale = case.softmax_scale
        if fault.scale_twice:
            q = q * scale
        group = case.queries_per_kv
        heads = torch.arange(case.num_q_heads)
        kv_of = heads % case.num_kv_heads if fault.kv_heads_interleaved else heads // group
        scores = torch.einsum("hd,lhd->hl", q, k[:, kv_of]) * scale  # [Hq, L]
        if case.softcap:
            scores = case.softcap * torch.tanh(scores / case.softcap)
        if fault.unshifted_softmax:
            weights = scores.exp()
            probs = weights / weights.sum(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hl,lhd->hd", probs, v[:, kv_of])

    def _tokens(self, view: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """``[len(pages) * P, Hkv, D]``: the pages' tokens (a page ``[P, Hkv, D]``, or read
        as ``[Hkv, P, D]`` under the head-stride fault)."""
        tokens = view[pages]  # [n, P, Hkv, D]
        if self.fault.heads_page_major:
            n, ps, hkv, d = tokens.shape
            tokens = tokens.reshape(n, hkv, ps, d).transpose(1, 2)
        return tokens.flatten(0, 1)


def _window_cuts(case: Case) -> bool:
    """Whether the sliding window leaves out a token of some row's context (its bound
    matters)."""
    return any(before_window(case, row) for row in build_rows(case))


def _partial_page(case: Case) -> bool:
    """Whether some row's context ends inside a page."""
    return any(row.context_len % case.page_size for row in build_rows(case))


def _grouped(case: Case) -> bool:
    """Whether interleaving the head groups changes a KV head: several KV heads, each read by
    several query heads."""
    return case.num_kv_heads > 1 and case.queries_per_kv > 1


def _large_logit(case: Case) -> bool:
    """Whether some logit may leave the range where an unshifted float32 softmax is exact up
    to rounding: a row's sum of ``exp(s)`` overflows past ``log(FLT_MAX) - log(n)`` for ``n``
    tokens, and a row whose every weight is below 2^-126 loses its precision. Tested on the
    largest ``|s|`` over every row and every token of the attended blocks (a superset of what
    each row attends), softcapped."""
    data = RunInputs(case, torch.device("cpu")).data
    if not data.physical_blocks:
        return False
    keys = data.k_stored.to(torch.float64).flatten(0, 1) * case.k_scale  # [tokens, Hkv, D]
    query = data.query.to(torch.float64)  # [rows, Hq, D]
    group = case.queries_per_kv
    largest = max(float((query[:, g * group:(g + 1) * group].flatten(0, 1)
                         @ keys[:, g].T).abs().max()) for g in range(case.num_kv_heads))
    logit = largest * case.softmax_scale
    if case.softcap:
        logit = case.softcap * math.tanh(logit / case.softcap)
    longest = max(row.context_len for row in build_rows(case))
    return logit > min(FLOAT32_SUBNORMAL_EXP, FLOAT32_OVERFLOW_EXP - math.log(longest))


FAULTS: tuple[tuple[Mutation, Fault], ...] = (
    (Mutation("window-off-by-one", "the window's lower bound off by one: the last W + 1 tokens",
              applies_to=_window_cuts, diagnosis="sliding-window-plus-1"),
     Fault(window_extra=1)),
    (Mutation("kv-heads-interleaved", "query head h reads KV head h % Hkv instead of "
              "h // (Hq / Hkv) (GQA groups interleaved)", applies_to=_grouped,
              diagnosis="kv-heads-interleaved"),
     Fault(kv_heads_interleaved=True)),
    (Mutation("kv-head-stride", "pages addressed as [Hkv, P, D] (the KV head stride of an HND "
              "cache) though they are [P, Hkv, D]", applies_to=lambda c: c.num_kv_heads > 1,
              diagnosis="kv-heads-page-major"),
     Fault(heads_page_major=True)),
    (Mutation("partial-page-dropped", "the loop over pages stops at the last whole page: a "
              "context's partial last page is dropped", applies_to=_partial_page,
              diagnosis="last-partial-page-dropped"),
     Fault(whole_pages_only=True)),
    (Mutation("softmax-scale-twice", "the softmax scale applied to q and again to the logits",
              applies_to=lambda c: c.softmax_scale != 1.0,
              diagnosis="softmax-scale-applied-twice"),
     Fault(scale_twice=True)),
    (Mutation("softmax-unshifted", "exp(s) without subtracting the row's maximum (float32 "
              "overflow past s = 88.7)", applies_to=_large_logit,
              diagnosis="softmax-unshifted"),
     Fault(unshifted_softmax=True)),
)


def build_faults() -> list[MutantBackend]:
    """``paged-torch!<fault>`` for every fault, each named after the correct kernel."""
    return [MutantBackend(PagedTorch(fault), mutation) for mutation, fault in FAULTS]


DIFFTEST_BACKENDS = [PagedTorch(), *build_faults()]
