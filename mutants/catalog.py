"""The mutant catalog: one fault-injected backend per real bug class of this kernel family.

Each mutant is named ``<correct backend>!<bug>`` and plants its bug at the layer where that
class of bug really lives: page-table bugs in the sparse table, view bugs in the cache views,
scale bugs in the scale arguments, configuration bugs in the adapter's options. Load them
with ``python -m difftest.cli run --plugin mutants.catalog --backends <mutant>`` or
``pytest --difftest-plugin mutants.catalog``.

``output-bf16`` is the control: it rounds the output to bf16 and declares it (a backend that
stores a lower-precision output says so, and its tolerance follows), so it must never be
reported.

Each harmful mutation declares the :mod:`difftest.judgement.diagnosis` hypothesis that names its bug
(``diagnosis``); the K-trim mismatch has none: AITER's assertion leaves no output to diagnose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from difftest import Backend, CacheViews, Case, Precision, SparseRow
from difftest.backends.aiter_gluon import AiterGluon, renumber_pages
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.case.selection import build_rows
from mutants.injection import MutantBackend, Mutation, Table

PAGE_ID_MASK_16_BITS = 0xFFFF


# ----- which rows and cases a bug can touch ------------------------------------------------
def _has_tail(case: Case, row: SparseRow) -> bool:
    """Whether the row's last segment is its own (causally truncated) block."""
    return bool(row.segments) and row.segments[-1].block == row.abs_pos // case.block_size


def _tail_rows(case: Case) -> list[int]:
    return [n for n, row in enumerate(build_rows(case)) if _has_tail(case, row)]


def _mtp_rows(case: Case) -> list[int]:
    """Rows with a tail whose query token is not the request's last one."""
    dql = case.decode_query_len
    return [n for n in _tail_rows(case) if n % dql < dql - 1]


def _packed(case: Case) -> bool:
    return case.kv_layout == "LBHNC"


def _unselected_page(case: Case) -> tuple[int, int] | None:
    """``(row, page id)``: the first attending row and a page of a block no row selected.

    A block of that row's own request the indexer left out is preferred (the realistic stale
    id); otherwise the highest physical block nobody attends. ``None`` if every block is
    attended or no row attends anything.
    """
    rows = build_rows(case)
    active = [n for n, row in enumerate(rows) if row.segments]
    attended = {seg.physical_block for row in rows for seg in row.segments}
    if not active or len(attended) >= case.num_blocks:
        return None
    row = active[0]
    own = [b for b in case.block_tables[rows[row].request] if b not in attended]
    block = max(own) if own else next(
        b for b in range(case.num_blocks - 1, -1, -1) if b not in attended)
    return row, block * case.block_page_stride


def _window_cuts(case: Case) -> bool:
    """Whether the sliding window leaves out a token some row attends."""
    return bool(case.sliding_window) and any(
        row.context_len > case.sliding_window for row in build_rows(case))


# ----- page-table bugs ---------------------------------------------------------------------
def _stride_8(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    if not _packed(case):
        return sparse
    return renumber_pages(table, case.block_page_stride, case.pages_per_side), ctx


def _truncate_16_bits(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    return table & PAGE_ID_MASK_16_BITS, ctx


def _tail_short_by_one(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    ctx[_tail_rows(case)] -= 1
    return table, ctx


def _drop_last_block(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    for n, row in enumerate(build_rows(case)):
        if row.segments:
            ctx[n] -= row.segments[-1].tokens
    return table, ctx


def _causal_limit_plus_one(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    ctx[_mtp_rows(case)] += 1
    return table, ctx


def _read_unselected_page(case: Case, sparse: Table) -> Table:
    table, ctx = sparse
    target = _unselected_page(case)
    if target is not None:
        row, page = target
        table[row, 0] = page
    return table, ctx


# ----- cache-view bugs ---------------------------------------------------------------------
def _v_offset(pages: int) -> Callable[[Case, CacheViews], CacheViews]:
    """The packed V view re-sliced ``pages`` pages into the block instead of 8."""

    def hook(case: Case, views: CacheViews) -> CacheViews:
        if not _packed(case):
            return views
        v = views.v
        shift = (pages - views.v_page_offset) * v.stride(0)
        flat = views.raw.reshape(-1)
        if shift > 0:  # the view now ends past the cache: a NaN guard page, as unread pages are
            flat = torch.cat([flat, flat.new_full((shift,), float("nan"))])
        shifted = flat.as_strided(v.shape, v.stride(), v.storage_offset() + shift)
        return dataclasses.replace(views, v=shifted, v_page_offset=pages)

    return hook


def _e4m3fn_as_fnuz(case: Case, views: CacheViews) -> CacheViews:
    if views.k.dtype != torch.float8_e4m3fn:
        return views
    fnuz = torch.float8_e4m3fnuz
    return dataclasses.replace(views, raw=views.raw.view(fnuz), k=views.k.view(fnuz),
                               v=views.v.view(fnuz))


# ----- scale bugs --------------------------------------------------------------------------
def _swap_scales(case: Case, scales: Table) -> Table:
    k_scale, v_scale = scales
    return v_scale, k_scale


def _skip_scales(case: Case, scales: Table) -> Table:
    k_scale, v_scale = scales
    return torch.ones_like(k_scale), torch.ones_like(v_scale)


# ----- the harmless control ----------------------------------------------------------------
# Only a float32 output is rounded: a float16 one rounded again to bf16 would pass two output
# stages (fp16's underflow below 6e-8, then bf16's 2^-8), which one declared dtype cannot
# state, so the control would be a mis-declared backend, not a harmless one.
def _round_to_bf16(case: Case, out: torch.Tensor) -> torch.Tensor:
    return out.to(torch.bfloat16) if out.dtype == torch.float32 else out


def _declare_bf16_output(precision: Precision) -> Precision:
    if precision.output != "float32":
        return precision
    return dataclasses.replace(precision, output="bfloat16")


def _drop_k_scale(case: Case, scales: Table) -> Table:
    k_scale, v_scale = scales
    return torch.ones_like(k_scale), v_scale


def _heads_shifted(case: Case, out: torch.Tensor) -> torch.Tensor:
    return out.roll(-1, dims=1)


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("v-offset-7", "packed V view starts 7 pages into the block instead of 8",
             cache=_v_offset(7), applies_to=_packed, diagnosis="v-view-offset-7"),
    Mutation("v-offset-9", "packed V view starts 9 pages into the block instead of 8",
             cache=_v_offset(9), applies_to=_packed, diagnosis="v-view-offset-9"),
    Mutation("page-stride-8", "block page stride 8 for packed sides (ids block*8+j, not *16)",
             sparse_table=_stride_8, applies_to=_packed, diagnosis="page-stride-8"),
    Mutation("tail-short-by-one", "the tail block's length is one token short",
             sparse_table=_tail_short_by_one, applies_to=lambda c: bool(_tail_rows(c)),
             diagnosis="context-minus-1"),
    Mutation("drop-last-block", "the last selected block of every row is dropped",
             sparse_table=_drop_last_block,
             applies_to=lambda c: any(r.segments for r in build_rows(c)),
             diagnosis="last-block-dropped"),
    Mutation("swap-kv-scales", "K and V scales swapped", scales=_swap_scales,
             applies_to=lambda c: c.is_fp8 and c.k_scale != c.v_scale,
             diagnosis="kv-scales-swapped"),
    Mutation("skip-scales", "fp8 K/V used without their scales (KVQuantMode.NONE)",
             scales=_skip_scales,
             applies_to=lambda c: c.is_fp8 and (c.k_scale != 1.0 or c.v_scale != 1.0),
             diagnosis="kv-scales-missing"),
    Mutation("e4m3fn-as-fnuz", "e4m3fn cache bytes read as e4m3fnuz", cache=_e4m3fn_as_fnuz,
             applies_to=lambda c: c.kv_dtype == "float8_e4m3fn",
             diagnosis="fp8-read-as-float8_e4m3fnuz"),
    Mutation("page-id-16-bit", "page ids truncated to 16 bits", sparse_table=_truncate_16_bits,
             applies_to=lambda c: c.max_page_id > PAGE_ID_MASK_16_BITS,
             diagnosis="page-id-mod-2**16"),
    Mutation("causal-limit-plus-one", "with several query tokens, each but the last sees the "
             "next token (causal limit off by one)", sparse_table=_causal_limit_plus_one,
             applies_to=lambda c: bool(_mtp_rows(c)), diagnosis="context-plus-1"),
    Mutation("read-unselected-page", "one attended page id replaced by a page of a block no "
             "row selected", sparse_table=_read_unselected_page,
             applies_to=lambda c: _unselected_page(c) is not None,
             diagnosis="page-from-unattended-block"),
    # kernel modes, scales and heads (the classes the page-table bugs lack)
    Mutation("softcap-ignored", "the logit softcap is not applied",
             case=lambda c: c.replace(softcap=0.0), applies_to=lambda c: c.softcap != 0,
             diagnosis="softcap-ignored"),
    Mutation("sliding-window-ignored", "the sliding window is not applied (full context)",
             case=lambda c: c.replace(sliding_window=0), applies_to=_window_cuts,
             diagnosis="sliding-window-ignored"),
    Mutation("softmax-scale-default", "the default softmax scale 1/sqrt(head_dim) instead of "
             "the case's", case=lambda c: c.replace(softmax_scale=c.head_dim ** -0.5),
             applies_to=lambda c: c.softmax_scale != c.head_dim ** -0.5,
             diagnosis="softmax-scale-default"),
    Mutation("k-scale-missing", "the fp8 K scale is not applied (V's is)", scales=_drop_k_scale,
             applies_to=lambda c: c.is_fp8 and c.k_scale != 1.0, diagnosis="k-scale-missing"),
    Mutation("query-heads-shifted", "query head h reads head h+1's query (a head stride off by "
             "one)", output=_heads_shifted, applies_to=lambda c: c.num_q_heads > 1,
             diagnosis="query-heads-shifted"),
    Mutation("output-bf16", "output rounded to bf16, declared as such (harmless)",
             harmful=False, output=_round_to_bf16, precision=_declare_bf16_output),
)

K_TRIM_OFF = Mutation(
    "kv-page-count-mismatch", "the report's bug: K passed untrimmed, so pa_decode_gluon gets "
    "2048 K pages and 2040 V pages at 128 blocks (the emulator's newest contract asserts "
    "equal counts)", applies_to=_packed)


def build_catalog() -> list[MutantBackend]:
    """Every mutant: the K/V page-count mismatch on the emulated AITER adapter, the rest on
    ``triton-unified``."""
    triton: Backend = TritonUnifiedAttention()
    aiter = AiterGluon(emulated=True)
    mutants = [MutantBackend(aiter.with_options({"k_trim": "off"}), K_TRIM_OFF, origin=aiter)]
    mutants.extend(MutantBackend(triton, m) for m in MUTATIONS)
    return mutants


DIFFTEST_BACKENDS = build_catalog()
