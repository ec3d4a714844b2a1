"""Parameter coverage: which values every argument of the kernel behind a backend took.

A blind spot is a kernel argument the cases never vary: a bug that lives on another value of it
cannot be caught. For each kernel a backend calls (``unified_attention``,
``minimax_m3_sparse_attn_decode``, ``minimax_m3_sparse_attn_decode_aiter``,
``pa_decode_gluon``), :data:`KERNELS` lists every parameter of the kernel's signature, in
order, either with the value class the adapter passes for a case (derived from the case by
the adapter's own rule, so no kernel has to run) or as **fixed**, with the value and the
reason. :data:`DIMENSIONS` adds the sizes a kernel reads from its tensors' shapes rather than
as parameters (head dim, page size, the 128-token block, KV heads), each mapped to the
arguments and shape entries that carry it and fixed by the case model (difftest/case.py
``validate``) with the reason. :func:`audit` collects the distinct values and boundary classes
over a set of cases; :func:`blind_spots` lists the arguments that are neither fixed nor varied;
:func:`audit_lines` renders both for a run's summary and :func:`audit_json` for a report.

Signatures: vLLM 0.33.0's ``vllm/v1/attention/ops/triton_unified_attention.py`` and
``vllm/models/minimax_m3/{common/ops/sparse_attn,amd/ops/sparse_pa}.py``; AITER's
``pa_decode_gluon`` as in ``aiter/ops/triton/gluon/pa_decode_gluon.py`` L5195-5216 (commit
37b5395e). tests/test_audit.py
checks the lists against the signatures installed. The shape facts of :data:`DIMENSIONS`:
MiniMax-M3's LBHNC cache (README.md) and the shapes ``pa_decode_gluon`` asserts.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from difftest.backend import Backend
from difftest.case import BLOCK_SIZE, HEAD_DIM, PAGE_SIZE, Case
from difftest.registry import parse_name
from difftest.sparse_table import (
    build_rows,
    kernel_sequences,
    selection_is_canonical,
    unified_query_blocks,
)

PAGE_ID_16_BITS = 1 << 16
TOPK_SPAN_TOKENS = 16 * 128  # MiniMax-M3's top-k 16 blocks of 128 tokens


@dataclass(frozen=True)
class Argument:
    """One kernel parameter: ``value(case)`` is what the adapter passes (a hashable label),
    and/or ``fixed`` is the reason the value does not change (``fixed_value``). Both: a mode
    MiniMax-M3 keeps off that the cases may still switch on (softcap, sliding window); its
    values are shown, and a single one is no blind spot. ``shape``: for a size the kernel
    reads from its tensors (:data:`DIMENSIONS`), where, e.g. ``"q.shape[2], k.shape[3]"``."""

    name: str
    value: Callable[[Case], Hashable] | None = None
    fixed: str = ""
    fixed_value: str = ""
    shape: str = ""


def _fixed(name: str, value: str, reason: str, shape: str = "") -> Argument:
    return Argument(name, fixed=reason, fixed_value=value, shape=shape)


# ----- value classes --------------------------------------------------------------------------
def length_classes(lengths: Iterable[int], block: int = 128) -> frozenset[str]:
    """Boundary classes of token counts: 0, 1, a 127 or 1 tail, exact blocks, past top-k."""
    out = set()
    for n in lengths:
        if n == 0:
            out.add("0")
        elif n % block == 0:
            out.add("multiple of 128")
        elif n % block in (1, block - 1):
            out.add(f"tail {n % block}")
        else:
            out.add("other tail")
        if n > TOPK_SPAN_TOKENS:
            out.add("> 16 x 128")
    return frozenset(out)


def _context_classes(case: Case) -> frozenset[str]:
    return length_classes(row.context_len for row in build_rows(case))


def _page_classes(case: Case) -> frozenset[str]:
    """Which page-table boundaries the attended pages reach."""
    attended = {seg.physical_block for row in build_rows(case) for seg in row.segments}
    out = {f"width {case.topk * case.pages_per_side}"}
    if 0 in attended:
        out.add("block 0")
    if case.num_blocks - 1 in attended:
        out.add("last block")
    if attended and max(attended) * case.block_page_stride >= PAGE_ID_16_BITS:
        out.add("page id >= 2**16")
    return frozenset(out)


def _selection_classes(case: Case) -> frozenset[str]:
    rows = build_rows(case)
    out = {f"top-k {case.topk}", "canonical" if selection_is_canonical(case) else "irregular"}
    if any(not row.segments for row in rows):
        out.add("empty row")
    if any(len(row.segments) == case.topk for row in rows):
        out.add("full row")
    return frozenset(out)


def _block_table_classes(case: Case) -> frozenset[str]:
    ids = [b for table in case.block_tables for b in table]
    out = {f"width {max(map(len, case.block_tables), default=0)}"}
    if 0 in ids:
        out.add("block 0")
    if case.num_blocks - 1 in ids:
        out.add("last block")
    if 0 in case.seq_lens:
        out.add("padded request")
    return frozenset(out)


def _query(case: Case) -> Hashable:
    return (case.query_dtype, f"{case.num_q_heads} q heads", f"head dim {case.head_dim}")


def _kv(case: Case) -> Hashable:
    return (case.kv_dtype, case.kv_layout, _cache_size(case))


def _cache_size(case: Case) -> str:
    if case.max_page_id >= PAGE_ID_16_BITS:
        return "pages past 2**16"
    return "128 blocks" if case.num_blocks == 128 else f"{'<' if case.num_blocks < 128 else '>'}" \
        " 128 blocks"


def _scale(which: str) -> Callable[[Case], Hashable]:
    def value(case: Case) -> Hashable:
        if not case.is_fp8:
            return "None"
        scale = getattr(case, which)
        return "1.0" if scale == 1.0 else ("< 1" if scale < 1 else "> 1")
    return value


def _query_length_class(case: Case) -> Hashable:
    longest = max(n for _, n in kernel_sequences(case))
    if longest <= 8:
        return str(longest) if longest == 1 else "2..8 (3-D still possible)"
    return "128" if longest == 128 else "9..127"


def _q_descale(case: Case) -> Hashable:
    if not case.q_scale:
        return "None"
    return "1.0" if case.q_scale == 1.0 else ("< 1" if case.q_scale < 1 else "> 1")


def _kernel_path(case: Case) -> Hashable:
    """vLLM 0.33.0's choice for the case (``triton-unified`` checks it on every run)."""
    if not case.split_k_segments:
        return "None: 2D"
    from difftest.backends.triton_unified import kernel_path

    relation = "<=" if unified_query_blocks(case) <= case.seq_threshold_3d else ">"
    return f"{kernel_path(case)} (query blocks {relation} threshold)"


def _scratch(case: Case) -> Hashable:
    return f"fp32 scratch, {case.split_k_segments} segments" if case.split_k_segments \
        else "None"


def _gluon_output(case: Case) -> Hashable:
    return "bfloat16" if case.is_fp8 else case.query_dtype


def _gluon_compute(case: Case) -> Hashable:
    return "fp8" if case.is_fp8 else case.query_dtype


# ----- the kernels ----------------------------------------------------------------------------
M3 = "MiniMax-M3's sparse decode"
NO_SOFTCAP_WINDOW = (f"{M3} has no softcap or window; the kernel modes "
                     "(difftest/cases/modes.py) switch them on for the backends that run them "
                     "(the others run the example with them off, "
                     "difftest/cases/capabilities.py)")
ONE_KV_HEAD = ("vLLM's MiniMax-M3 AITER sparse PA asserts num_kv_heads == 1 per rank, and "
               "MiniMax-M3's backends refuse other cases (difftest/case.py "
               "outside_model_geometry)")
TWO_D = ("None: the adapter calls the 2-D kernel (no split-K scratch), as vLLM's MiniMax-M3 "
         "decode with one query token per sequence; the split-K mode "
         "(difftest/cases/modes.py) hands over scratch so vLLM picks 2-D or 3-D by shape")

UNIFIED_ATTENTION: tuple[Argument, ...] = (
    Argument("q", _query),
    Argument("k", _kv),
    Argument("v", _kv),
    Argument("out", lambda c: c.query_dtype),
    Argument("cu_seqlens_q", lambda c: f"{len(kernel_sequences(c))} sequences"),
    Argument("max_seqlen_q", _query_length_class, fixed="each query row is its own length-1 "
             "sequence over its sparse table (the decode rows of MTP too); the query_lens "
             "mode passes a request as one causal sequence", fixed_value="1"),
    Argument("seqused_k", _context_classes),
    Argument("max_seqlen_k", lambda c: c.topk * c.block_size),
    Argument("softmax_scale", lambda c: c.softmax_scale),
    _fixed("causal", "True", "the sparse table already ends each row at its own token; "
           "causal over a length-1 query masks nothing more, over a query_lens sequence it "
           "is the causal mask within the request"),
    Argument("window_size", lambda c: (c.sliding_window - 1, 0) if c.sliding_window
             else (-1, -1), fixed=NO_SOFTCAP_WINDOW, fixed_value="(-1, -1)"),
    Argument("block_table", _page_classes),
    Argument("softcap", lambda c: c.softcap, fixed=NO_SOFTCAP_WINDOW, fixed_value="0"),
    Argument("q_descale", _q_descale, fixed=f"{M3} keeps queries in bf16/fp16 (no query "
             "quantisation); the q_scale mode stores them in fp8", fixed_value="None"),
    Argument("k_descale", _scale("k_scale")),
    Argument("v_descale", _scale("v_scale")),
    Argument("seq_threshold_3D", _kernel_path, fixed=TWO_D, fixed_value="None"),
    Argument("num_par_softmax_segments", lambda c: c.split_k_segments or "None", fixed=TWO_D,
             fixed_value="None"),
    Argument("softmax_segm_output", _scratch, fixed=TWO_D, fixed_value="None"),
    Argument("softmax_segm_max", _scratch, fixed=TWO_D, fixed_value="None"),
    Argument("softmax_segm_expsum", _scratch, fixed=TWO_D, fixed_value="None"),
    _fixed("alibi_slopes", "None", f"{M3} has no ALiBi"),
    _fixed("output_scale", "None", f"{M3} writes a bf16/fp16 output, not fp8"),
    _fixed("qq_bias", "None", f"{M3} has no query-query bias"),
    _fixed("sinks", "None", f"{M3} passes no attention sinks (sparse_pa.py: sinks=None)"),
    _fixed("mm_prefix_range", "None", f"{M3} decode has no multimodal prefix"),
    _fixed("rswa_prefix_lens", "None", f"{M3} has no R-SWA"),
    _fixed("rswa_window", "None", f"{M3} has no R-SWA"),
    _fixed("use_alibi_sqrt", "False", f"{M3} has no ALiBi"),
    Argument("kv_quant_mode", lambda c: "FP8_PER_TENSOR" if c.is_fp8 else "NONE"),
    _fixed("k_scale_cache", "None", "per-tensor fp8 scales only: vLLM's MiniMax-M3 layers "
           "register 0-d k/v scales"),
    _fixed("v_scale_cache", "None", "per-tensor fp8 scales only: vLLM's MiniMax-M3 layers "
           "register 0-d k/v scales"),
    _fixed("chunk_lookback", "-1", f"{M3} has no chunked attention"),
    _fixed("use_td", "False", "tensor descriptors are an Intel Xe path"),
    _fixed("mm_prefix_clamp_sliding_window", "False", "a Gemma4 switch"),
)

SPARSE_ATTN_DECODE: tuple[Argument, ...] = (
    Argument("q", _query),
    Argument("kv_cache", lambda c: (c.kv_dtype, _cache_size(c))),
    Argument("topk_idx", _selection_classes),
    Argument("block_table", _block_table_classes),
    Argument("seq_lens", lambda c: length_classes(c.seq_lens)),
    _fixed("num_kv_heads", "1", ONE_KV_HEAD),
    Argument("sm_scale", lambda c: c.softmax_scale),
    Argument("output", lambda c: c.query_dtype),
    Argument("decode_query_len", lambda c: c.decode_query_len),
    Argument("k_scale", _scale("k_scale")),
    Argument("v_scale", _scale("v_scale")),
)

SPARSE_ATTN_DECODE_AITER: tuple[Argument, ...] = (
    Argument("q", _query),
    Argument("k_cache", _kv),
    Argument("v_cache", _kv),
    Argument("topk_idx", _selection_classes),
    Argument("block_table", _block_table_classes),
    Argument("seq_lens", lambda c: length_classes(c.seq_lens)),
    _fixed("num_kv_heads", "1", ONE_KV_HEAD),
    Argument("sm_scale", lambda c: c.softmax_scale),
    Argument("output", lambda c: c.query_dtype),
    Argument("k_scale", _scale("k_scale")),
    Argument("v_scale", _scale("v_scale")),
    Argument("decode_query_len", lambda c: c.decode_query_len),
    _fixed("sparse_block_table", "None", "the adapter lets vLLM build the sparse table (what "
           "the model does); the framework's own table goes to pa_decode_gluon directly"),
    _fixed("sparse_context_lens", "None", "built with sparse_block_table, see there"),
)

PA_DECODE_GLUON: tuple[Argument, ...] = (
    Argument("output", _gluon_output),
    Argument("query", _query),
    Argument("key_cache", _kv),
    Argument("value_cache", _kv),
    Argument("context_lengths", _context_classes),
    Argument("block_tables", _page_classes),
    Argument("softmax_scale", lambda c: c.softmax_scale),
    _fixed("query_length", "1", "vLLM's MiniMax-M3 AITER path passes each query token as its "
           "own sequence (sparse_pa.py: query_length=1)"),
    _fixed("max_context_partition_num", "get_recommended_splits(rows, 1)", "the adapter's "
           "splits option picks it (auto: AITER's recommendation, 8 below 77 rows on 304 CUs); "
           "other values are backend options, e.g. aiter-gluon@emulated[splits=1]"),
    _fixed("context_partition_size", "256", "the only size AITER tests and vLLM passes"),
    Argument("compute_type", _gluon_compute),
    _fixed("query_scale", "None", f"{M3} keeps queries in bf16/fp16 (sparse_pa.py: "
           "query_scale=None)"),
    Argument("key_scale", _scale("k_scale")),
    Argument("value_scale", _scale("v_scale")),
    _fixed("exp_sums", "fp32 scratch", "scratch the adapter allocates, shaped by the call"),
    _fixed("max_logits", "fp32 scratch", "scratch the adapter allocates, shaped by the call"),
    _fixed("temporary_output", "output-dtype scratch", "scratch the adapter allocates"),
    _fixed("alibi_slopes", "None", "AITER accepts and ignores it (never forwarded)"),
    _fixed("sinks", "None", f"{M3} passes no sinks (sparse_pa.py: sinks=None)"),
    _fixed("sliding_window", "0", NO_SOFTCAP_WINDOW + "; both pa_decode_gluon callers refuse "
           "such cases"),
    _fixed("ps", "True", "vLLM's MiniMax-M3 path passes ps=True (forced by AITER when one "
           "partition)"),
)

# ----- sizes read from shapes, fixed by the case model -------------------------------------------
CASE_MODEL = ("the sparse family holds it, and MiniMax-M3's backends refuse cases that do "
              "not (difftest/case.py outside_model_geometry)")
DENSE_GEOMETRY = ("the dense family (difftest/cases/dense.py) draws head sizes 64-256, "
                  "16-128-token blocks and 48, pages of a block or of 16 tokens, 1-8 KV heads")
HEAD_DIM_WHY = (f"MiniMax-M3's head dim (sm_scale = {HEAD_DIM}**-0.5, amd/model.py:668); "
                f"{CASE_MODEL} so that every backend runs every case: vLLM's AITER sparse PA "
                f"raises for head_size != {HEAD_DIM} (sparse_pa.py:546-548)")
LBHNC = (f"MiniMax-M3's sparse-PA cache: a {BLOCK_SIZE}-token block stores its K side, then "
         f"its V side, each {BLOCK_SIZE // PAGE_SIZE} pages of {PAGE_SIZE} tokens (LBHNC; "
         f"page id {2 * BLOCK_SIZE // PAGE_SIZE}*block + j, minimax-m3-sparse-decode.md "
         "section 1)")
PAGE_WHY = f"{LBHNC}; {CASE_MODEL}, and every page id and sparse table is derived from it"
BLOCK_WHY = (f"the indexer's top-k selects {BLOCK_SIZE}-token blocks (SPARSE_BLOCK_SIZE, "
             f"common/ops/sparse_attn.py:26), the blocks of {LBHNC}; {CASE_MODEL}")
ONE_KV_HEAD_SHAPE = (f"{ONE_KV_HEAD}; this kernel accepts more (its GQA grouping is "
                     "num_q_heads // num_kv_heads), which no case reaches")

def _block_of_pages(kernel: str, table: str, more: str = "", more_where: str = "") -> Argument:
    """block_size of a kernel that sees pages only: the block is its consecutive page ids."""
    return _fixed("block_size", str(BLOCK_SIZE), f"no {kernel} parameter: it sees pages only; "
                  f"the {BLOCK_SIZE}-token block is the {BLOCK_SIZE // PAGE_SIZE} consecutive "
                  f"page ids per selected block in {table}{more}; {BLOCK_WHY}",
                  f"{table} width{more_where}")


DIMENSIONS: dict[str, tuple[Argument, ...]] = {
    "unified_attention": (
        Argument("head_dim", lambda c: c.head_dim, fixed="unified_attention accepts any head "
                 "size (padded to a power of 2 and masked, triton_unified_attention.py:1038); "
                 f"{HEAD_DIM_WHY}; {DENSE_GEOMETRY}", fixed_value=str(HEAD_DIM),
                 shape="q.shape[2], k.shape[3], v.shape[3], out.shape[2]"),
        Argument("page_size", lambda c: c.page_size, fixed="unified_attention takes its block "
                 "size from v.shape[1] and accepts others (it clamps its tiles to it, "
                 "triton_unified_attention.py:951, 1018-1022); the sparse family passes the "
                 f"plain page-{PAGE_SIZE} views of {PAGE_WHY}; {DENSE_GEOMETRY}",
                 fixed_value=str(PAGE_SIZE),
                 shape="k.shape[1], v.shape[1]; block_table holds page ids"),
        Argument("block_size", lambda c: c.block_size, fixed="no unified_attention parameter: "
                 f"it sees pages only; the {BLOCK_SIZE}-token block is the "
                 f"{BLOCK_SIZE // PAGE_SIZE} consecutive page ids per selected block in "
                 f"block_table and max_seqlen_k = topk * {BLOCK_SIZE}; {BLOCK_WHY}; "
                 f"{DENSE_GEOMETRY}", fixed_value=str(BLOCK_SIZE),
                 shape="block_table width, max_seqlen_k"),
        Argument("num_kv_heads", lambda c: c.num_kv_heads, fixed=f"{ONE_KV_HEAD}; this kernel "
                 "accepts more (its GQA grouping is num_q_heads // num_kv_heads); "
                 f"{DENSE_GEOMETRY}", fixed_value="1", shape="k.shape[2], v.shape[2]"),
    ),
    "minimax_m3_sparse_attn_decode": (
        _fixed("head_dim", str(HEAD_DIM), "the common Triton decode accepts any head_dim "
               f"(BLOCK_SIZE_D = next_power_of_2(head_dim)); {HEAD_DIM_WHY}",
               "q.shape[2], kv_cache.shape[3] // 2, output.shape[2]"),
        _fixed("block_size", str(BLOCK_SIZE), f"kv_cache is [blocks, nkv, {BLOCK_SIZE}, 2*D]: "
               f"the kernel's BLOCK_SIZE_K == SPARSE_BLOCK_SIZE == {BLOCK_SIZE}, one selected "
               f"block is one cache block, no other value is accepted; {BLOCK_WHY}",
               "kv_cache.shape[2]; topk_idx and block_table hold 128-token block ids"),
    ),
    "minimax_m3_sparse_attn_decode_aiter": (
        _fixed("head_dim", str(HEAD_DIM), f"no other value is accepted: MiniMax-M3's head dim, "
               f"and _run_gluon_decode raises ValueError for head_size != {HEAD_DIM} "
               f"(sparse_pa.py:546-548); {CASE_MODEL}",
               "q.shape[2], k_cache.shape[2] * x, v_cache.shape[3], output.shape[2]"),
        _fixed("page_size", str(PAGE_SIZE), f"ASM_PAGE_SIZE = {PAGE_SIZE} is a constant of "
               "sparse_pa.py (AITER's writer puts slot s at page s // 16); no other value is "
               f"accepted; {PAGE_WHY}", "k_cache.shape[3], v_cache.shape[2] * x"),
        _fixed("block_size", str(BLOCK_SIZE), "PAGES_PER_SPARSE_BLOCK = SPARSE_BLOCK_SIZE // "
               f"ASM_PAGE_SIZE = {BLOCK_SIZE // PAGE_SIZE} is a constant of sparse_pa.py; the "
               f"block page stride is {2 * BLOCK_SIZE // PAGE_SIZE} when K and V share a block "
               f"(LBHNC), {BLOCK_SIZE // PAGE_SIZE} otherwise; {BLOCK_WHY}",
               "topk_idx and block_table hold 128-token block ids; k_cache.shape[0] pages"),
    ),
    "pa_decode_gluon": (
        _fixed("head_dim", str(HEAD_DIM), "pa_decode_gluon takes D from query.shape[-1] "
               f"(the 16-byte interleave needs D % x == 0); {HEAD_DIM_WHY}",
               "query.shape[2], key_cache.shape[2] * x, value_cache.shape[3]"),
        _fixed("page_size", str(PAGE_SIZE), "bs = key_cache.shape[-2]: AITER's dot kernel "
               "static_asserts KV_BLOCK_SIZE in [16, 64] (the large-block kernel takes 1024, "
               "aiter-pa-decode-gluon.md section 2); vLLM's MiniMax-M3 sparse PA passes "
               f"{PAGE_SIZE}-token pages only, so 64 is not tested; {PAGE_WHY}",
               "key_cache.shape[3], value_cache.shape[2] * x"),
        _block_of_pages("pa_decode_gluon", "block_tables"),
        _fixed("num_kv_heads", "1", ONE_KV_HEAD_SHAPE + " (vLLM folds heads into pages, "
               "sparse_pa.py:567-572)", "key_cache.shape[1], value_cache.shape[1]"),
    ),
}

KERNELS: dict[str, tuple[Argument, ...]] = {
    "unified_attention": UNIFIED_ATTENTION,
    "minimax_m3_sparse_attn_decode": SPARSE_ATTN_DECODE,
    "minimax_m3_sparse_attn_decode_aiter": SPARSE_ATTN_DECODE_AITER,
    "pa_decode_gluon": PA_DECODE_GLUON,
}

BACKEND_KERNELS: dict[str, str] = {
    "triton-unified": "unified_attention",
    "vllm-triton-sparse": "minimax_m3_sparse_attn_decode",
    "aiter-gluon": "pa_decode_gluon",
    "aiter-gluon@emulated": "pa_decode_gluon",
    "vllm-aiter": "minimax_m3_sparse_attn_decode_aiter",
    "vllm-aiter@emulated": "minimax_m3_sparse_attn_decode_aiter",
}


def kernel_of(backend: str) -> str | None:
    """The kernel behind a backend name (options and a mutant's ``!bug`` stripped), if known."""
    base, _ = parse_name(backend.split("!", 1)[0])
    return BACKEND_KERNELS.get(base)


# ----- the audit ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Coverage:
    """One argument of one backend's kernel over a case set."""

    backend: str
    kernel: str
    argument: Argument
    values: tuple[Hashable, ...]  # distinct, in first-seen order (empty when fixed)
    cases: int  # the cases the backend ran

    @property
    def blind(self) -> bool:
        """Accepted, not documented as fixed, and a single value over the cases."""
        return not self.argument.fixed and len(self.values) < 2


RAN = frozenset({"agree", "disagree", "error", "crash"})  # the statuses of a kernel that ran
Runs = list[tuple[Case, dict[str, str] | None]]


def as_runs(items: Iterable[Case | Mapping[str, Any] | Any]) -> Runs:
    """``(case, status by backend)`` of cases (statuses unknown: ``None``) or run records: a
    report's case entries (``{"case": ..., "results": [{"backend", "status"}]}``) or record
    objects with ``case`` and ``results`` attributes."""
    out: Runs = []
    for item in items:
        if isinstance(item, Case):
            out.append((item, None))
            continue
        case = item["case"] if isinstance(item, Mapping) else item.case
        results = item.get("results") if isinstance(item, Mapping) else item.results
        statuses = None if results is None else {
            _field(r, "backend"): str(getattr(_field(r, "status"), "value", _field(r, "status")))
            for r in results}
        out.append((case if isinstance(case, Case) else Case.from_dict(case), statuses))
    return out


def _field(result: Any, name: str) -> Any:
    return result[name] if isinstance(result, Mapping) else getattr(result, name)


def _ran(runs: Runs, backend: str | Backend, device: torch.device | None) -> list[Case]:
    """The cases ``backend`` ran: per the records' statuses where known, else per its own
    support check where it is a backend object and ``device`` is given, else all."""
    name = backend if isinstance(backend, str) else backend.name
    out = []
    for case, statuses in runs:
        if statuses is not None:
            if statuses.get(name) in RAN:
                out.append(case)
        elif isinstance(backend, str) or device is None or backend.unsupported_reason(
                case, device) is None:
            out.append(case)
    return out


def audit(items: Iterable[Case | Mapping[str, Any] | Any], backends: Sequence[str | Backend],
          device: torch.device | None = None) -> list[Coverage]:
    """Every argument of every backend's kernel, then its :data:`DIMENSIONS`, with the distinct
    values each took on the cases that backend ran (see :func:`as_runs`; backends with no
    known kernel, such as the reference, are left out)."""
    runs = as_runs(items)
    out = []
    for backend in backends:
        name = backend if isinstance(backend, str) else backend.name
        kernel = kernel_of(name)
        if kernel is None:
            continue
        cases = _ran(runs, backend, device)
        for argument in KERNELS[kernel] + DIMENSIONS[kernel]:
            values: dict[Hashable, None] = {}
            if argument.value is not None:
                for case in cases:
                    values.setdefault(argument.value(case), None)
            out.append(Coverage(name, kernel, argument, tuple(values), len(cases)))
    return out


def blind_spots(items: Iterable[Case | Mapping[str, Any] | Any],
                backends: Sequence[str | Backend],
                device: torch.device | None = None) -> list[Coverage]:
    """The arguments that took one value (or none) though they are not documented as fixed."""
    return [c for c in audit(items, backends, device) if c.blind]


def _label(value: Hashable) -> str:
    if isinstance(value, frozenset):
        return "{" + ", ".join(sorted(value)) + "}"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def audit_lines(items: Iterable[Case | Mapping[str, Any] | Any],
                backends: Sequence[str | Backend], device: torch.device | None = None,
                max_values: int = 6) -> list[str]:
    """The audit as text: per backend and kernel argument, its values over the cases the
    backend ran (or why it is fixed), blind spots marked ``BLIND``; one line per backend with
    no known kernel."""
    items = list(items)
    lines = [f"parameter coverage over {len(items)} cases"]
    coverage = audit(items, backends, device)
    for backend in backends:
        name = backend if isinstance(backend, str) else backend.name
        rows = [c for c in coverage if c.backend == name]
        if not rows:
            lines.append(f"  {name}: no kernel signature known to the audit")
            continue
        if rows[0].cases == 0:
            lines.append(f"  {name} -> {rows[0].kernel}: ran no case, not audited")
            continue
        lines.append(f"  {name} -> {rows[0].kernel} ({rows[0].cases} cases ran)")
        width = max(len(c.argument.name) for c in rows)
        for c in rows:
            name = c.argument.name.ljust(width)
            where = f" ({c.argument.shape})" if c.argument.shape else ""
            fixed = f"fixed {c.argument.fixed_value}{where}: {c.argument.fixed}"
            if c.argument.value is None:
                lines.append(f"    {name}  {fixed}")
                continue
            shown = "; ".join(_label(v) for v in c.values[:max_values])
            more = f"; ... ({len(c.values)} in all)" if len(c.values) > max_values else ""
            flag = "BLIND " if c.blind else ""
            note = f" ({fixed})" if c.argument.fixed else ""
            lines.append(f"    {name}  {flag}{len(c.values)} value(s): {shown}{more}{note}")
    return lines


def audit_json(items: Iterable[Case | Mapping[str, Any] | Any],
               backends: Sequence[str | Backend],
               device: torch.device | None = None) -> dict[str, Any]:
    """The audit as JSON: per backend with a known kernel, the cases it ran and, per argument
    (then per size of :data:`DIMENSIONS`), its value labels, ``fixed`` (value, reason and
    where a size sits in the shapes, or ``None``) and whether it is blind."""
    items = list(items)
    out: dict[str, Any] = {"cases": len(items), "backends": {}}
    for c in audit(items, backends, device):
        entry = out["backends"].setdefault(c.backend, {"kernel": c.kernel, "cases": c.cases,
                                                       "arguments": []})
        a = c.argument
        fixed = {"value": a.fixed_value, "reason": a.fixed, "shape": a.shape} if a.fixed \
            else None
        entry["arguments"].append({"name": a.name, "values": [_label(v) for v in c.values],
                                   "fixed": fixed, "blind": c.blind})
    return out
