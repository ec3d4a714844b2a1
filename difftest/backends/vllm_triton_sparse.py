"""``vllm-triton-sparse``: vLLM's portable Triton MiniMax-M3 sparse decode.

``minimax_m3_sparse_attn_decode`` (``vllm/models/minimax_m3/common/ops/sparse_attn.py``) is
the path vLLM takes without AITER. It reads ``kv_cache [blocks, nkv, 128, 2*D]`` with V at
``+D`` from K, which no view of the two-slot LBHNC/LHBNC cache gives, so the plain cache's K
and V sides are gathered per physical block (through the framework's page-16 views and block
page stride) and repacked as ``cat([K, V], -1).transpose(1, 2)``. It takes the logical block
table, ``topk_idx [nkv, total_q, topk]``, ``seq_lens`` and ``decode_query_len`` and derives
each row's context itself, so it is also an independent check of the framework's table
builder. Native on a GPU; interpreted on the CPU.

Its documented quirks are declared, never hidden (docs/findings.md F3-F6):

* non-canonical selections (``-1`` before valid lanes, duplicates, blocks past the causal
  limit) run and are judged against the declared semantics (:mod:`difftest.case.selection`),
  except where its reading of the lanes is known to differ from it: it scans only the first
  ``min(topk, cdiv(kv_len, 128))`` lanes (a valid entry after a -1 or a future block can
  fall outside them) and counts a duplicated tail twice (finding F4). A case where that
  changes what some row attends (:func:`~difftest.case.selection.portable_reading_differs`)
  is unsupported unless the option ``irregular=accept`` forces it through
  (``vllm-triton-sparse[irregular=accept]``, which then disagrees);
* bfloat16 queries are miscomputed by Triton's interpreter: unsupported on the CPU unless
  ``interpreter_bf16=accept``;
* for a bf16/fp16 cache the query must have the cache's dtype (``tl.dot`` of q and K; only
  fp8 K/V are cast to the query dtype);
* rows that attend nothing are NaN ("All-empty padded rows may still produce NaNs in merge"):
  declared undefined;
* it has none of the kernel modes (softcap, sliding window, fp8 queries, per-request query
  lengths, split-K scratch): cases with one are unsupported.

``vllm-triton-sparse[vllm=0.31.0]`` (or ``vllm=/path/to/tree``, or ``$DIFFTEST_VLLM``) runs
that release's ``sparse_attn.py`` instead of the venv's (:mod:`difftest.backends.vllm_release`);
releases without the MiniMax-M3 decode are unavailable, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from difftest.backends.vllm_adapter import VllmAdapter
from difftest.backends.vllm_imports import triton_precision
from difftest.case.selection import portable_reading_differs, selection_is_canonical
from difftest.case.spec import Case
from difftest.contract.backend import EmptyRowOutput, Precision, RunInputs
from difftest.contract.kernel_call import id_classes, kernel_call, length_classes, scale_class
from difftest.contract.registry import OptionSpec
from difftest.primitives.dtypes import torch_dtype

IRREGULAR_FINDING = (
    "non-canonical selection that minimax_m3_sparse_attn_decode reads differently from the "
    "declared semantics: it scans only the first min(topk, cdiv(kv_len, 128)) "
    "lanes and counts a duplicated tail twice (pinned finding F4, "
    "tests/test_vllm_triton_sparse.py); vllm-triton-sparse[irregular=accept] runs it anyway"
)
INTERPRETER_BF16_FINDING = (
    "bfloat16 queries under TRITON_INTERPRET=1 are miscomputed by Triton's interpreter in "
    "minimax_m3_sparse_attn_decode (pinned finding F3, tests/test_vllm_triton_sparse.py); "
    "bfloat16 runs on GPUs"
)
OPTIONS = OptionSpec("vllm-triton-sparse", {"irregular": ("refuse", "accept"),
                                            "interpreter_bf16": ("refuse", "accept")})


def block_sides(view: torch.Tensor, block_page_stride: int, num_blocks: int,
                block_size: int) -> torch.Tensor:
    """``[blocks, block_size, nkv, D]``: one side (K or V) of every physical block, as a
    view of a plain page-16 view ``[pages, 16, nkv, D]`` whose page ``b * stride + j`` holds
    tokens ``16j..16j+15`` of block ``b``."""
    page_stride, token_stride = view.stride(0), view.stride(1)
    if page_stride != view.shape[1] * token_stride:
        raise ValueError(f"plain pages must be token-major and contiguous, got strides "
                         f"{view.stride()}")
    size = (num_blocks, block_size, *view.shape[2:])
    stride = (block_page_stride * page_stride, token_stride, *view.stride()[2:])
    return view.as_strided(size, stride, view.storage_offset())


class VllmTritonSparse(VllmAdapter):
    """Adapter from a case to vLLM's ``minimax_m3_sparse_attn_decode``."""

    base = OPTIONS.base
    kernel_files = ("models/minimax_m3/common/ops/sparse_attn.py",)
    kernel_module_name = "vllm.models.minimax_m3.common.ops.sparse_attn"
    kernel_what = "MiniMax-M3 sparse decode"
    interpreter_bf16_finding = INTERPRETER_BF16_FINDING
    in_page_orders = ("plain",)
    releases = ("vllm",)  # the release kinds it runs (vllm=, $DIFFTEST_VLLM)

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        free, own = self.split_options(options or {}, own=True)
        self.options = OPTIONS.parse(own)
        super().__init__(**free, name=OPTIONS.name(self.options),
                         allow_interpreter_bf16=self.options["interpreter_bf16"] == "accept")

    def with_options(self, options: Mapping[str, str]) -> VllmTritonSparse:
        """The same backend configured by ``options`` (relative to the defaults);
        ``vllm=<version or path>`` names the vLLM release whose decode runs."""
        return VllmTritonSparse(options)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """Kernel modes, irregular selections it reads differently (F4), interpreted bf16,
        mixed non-fp8 dtypes, fnuz on NVIDIA; geometry other than MiniMax-M3's."""
        geometry = case.outside_model_geometry()
        if geometry:
            return (f"{geometry}: minimax_m3_sparse_attn_decode reads MiniMax-M3's cache "
                    "(head_dim 128, 128-token blocks of 16-token pages, one KV head), which "
                    "this adapter repacks from an LBHNC or LHBNC cache only")
        if case.kernel_modes:
            return (f"{' and '.join(case.kernel_modes)}: minimax_m3_sparse_attn_decode has no "
                    "such mode")
        if self.options["irregular"] == "refuse" and not selection_is_canonical(case):
            if portable_reading_differs(case):
                return IRREGULAR_FINDING
        reason = self.interpreter_bf16_reason(case, device)
        if reason:
            return reason
        if not case.is_fp8 and case.query_dtype != case.kv_dtype:
            return (f"a {case.kv_dtype} cache needs {case.kv_dtype} queries: only fp8 K/V are "
                    f"cast to the query dtype, and tl.dot rejects {case.query_dtype} x "
                    f"{case.kv_dtype} (pinned finding F5)")
        return self.fnuz_reason(case, device)

    def precision(self, case: Case, device: torch.device) -> Precision:
        """K/V (dequantised) and P in the query dtype, partials and output in the query dtype;
        float32 dots use tf32 on GPUs."""
        return triton_precision(case, device)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """The merge of all-empty rows produces NaN (pinned finding F6)."""
        return EmptyRowOutput.UNDEFINED

    def versions(self) -> dict[str, str]:
        """vLLM's version, path and loading; Triton's, and whether it is interpreted; the
        options."""
        return {**self.vllm_versions(), **self.options}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``minimax_m3_sparse_attn_decode`` call over every query row."""
        sparse_attn = self.kernel_module()
        case = inputs.case
        cache = inputs.cache("plain")
        sides = [block_sides(view, cache.block_page_stride, case.num_blocks, case.block_size)
                 for view in (cache.k, cache.v)]
        kv_cache = torch.cat(sides, dim=-1).transpose(1, 2)  # [blocks, nkv, 128, 2D]
        output = inputs.output(torch_dtype(case.query_dtype))
        k_scale, v_scale = inputs.scales() if case.is_fp8 else (None, None)
        arguments = dict(q=inputs.data.query, kv_cache=kv_cache, topk_idx=inputs.selections(),
                         block_table=inputs.block_table(), seq_lens=inputs.seq_lens(),
                         num_kv_heads=case.num_kv_heads, sm_scale=case.softmax_scale,
                         output=output, decode_query_len=case.decode_query_len,
                         k_scale=k_scale, v_scale=v_scale)
        decode = sparse_attn.minimax_m3_sparse_attn_decode
        decode(**arguments)
        inputs.state(kernel_call(decode, arguments, labels=sparse_decode_labels(case, arguments),
                                 fixed={"num_kv_heads": ONE_KV_HEAD, "head_dim": CASE_MODEL},
                                 sizes={"head_dim": (case.head_dim, "q.shape[2]")}))
        return output


ONE_KV_HEAD = ("MiniMax-M3's one KV head: other geometry is refused (unsupported_reason, "
               "Case.outside_model_geometry)")
CASE_MODEL = ("MiniMax-M3's: other geometry is refused (unsupported_reason, "
              "Case.outside_model_geometry)")


def sparse_decode_labels(case: Case, arguments: Mapping[str, Any]) -> dict[str, str]:
    """The value classes of a MiniMax-M3 sparse decode call's selection, block table, lengths
    and scales (shared by the portable decode and vLLM's AITER path)."""
    selections = arguments["topk_idx"]
    rows = selections.shape[-1]
    kinds = {f"top-k {rows}", "canonical" if selection_is_canonical(case) else "irregular"}
    lanes = (selections >= 0).sum(-1)
    if bool((lanes == 0).any()):
        kinds.add("empty row")
    if bool((lanes == rows).any()):
        kinds.add("full row")
    return {"topk_idx": "{" + ", ".join(sorted(kinds)) + "}",
            "block_table": id_classes(arguments["block_table"], case.num_blocks - 1),
            "seq_lens": length_classes(arguments["seq_lens"].tolist()),
            "k_scale": scale_class(case.k_scale if case.is_fp8 else None),
            "v_scale": scale_class(case.v_scale if case.is_fp8 else None)}
