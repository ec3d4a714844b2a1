"""``vllm-decode-attention``: vLLM's Triton ``decode_attention_fwd`` (split-KV decode).

``decode_attention_fwd`` (``vllm/v1/attention/ops/triton_decode_attention.py``) is a two-stage
decode: stage 1 splits each sequence's tokens into ``num_kv_splits`` parts and writes a
partial output and log-sum-exp per part into ``attn_logits [rows, heads, splits, D + 1]``;
stage 2 merges them into ``o`` and ``lse``. With one KV head per 16 query heads it runs the
grouped stage-1 kernel (``_fwd_grouped_kernel_stage1``, ``tl.dot``); with as many KV heads as
query heads the per-head one. It reads K and V as page views ``[pages, 16, nkv, D]`` and
takes the page stride from each view itself (``_page_stride``), so the plain LBHNC views,
K 8 pages longer than V, are passed untrimmed and one page id addresses both.

Each query row is its own sequence over the framework's page-16 sparse table
(``req_to_token``). The case's softcap is ``logit_cap``; ``num_kv_splits`` is the case's
``split_k_segments`` where set, else 4; the case's sliding window ``W`` is ``sliding_window``
(the last ``W`` keys, vLLM 0.34.0 and later; earlier releases refuse windows). The kernel has
no query descale. A row of context 0 writes ``0 / 0``: its output is undefined (NaN). Native on a
GPU; on the CPU under ``TRITON_INTERPRET=1`` (bf16 queries and bf16 caches excluded there:
finding F1).

``vllm-decode-attention[vllm=0.30.0]`` (or a path, or ``$DIFFTEST_VLLM``) runs that release's
kernel file (:mod:`difftest.backends.vllm_release`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from difftest.backends.vllm_adapter import VllmAdapter
from difftest.case.spec import Case
from difftest.contract.backend import EmptyRowOutput, Precision, RunInputs
from difftest.contract.kernel_call import id_classes, kernel_call, length_classes, scale_class
from difftest.primitives.dtypes import torch_dtype

DEFAULT_SPLITS = 4
INTERPRETER_BF16_FINDING = (
    "bfloat16 queries or caches under TRITON_INTERPRET=1 are miscomputed by Triton's interpreter "
    "(pinned finding F1, tests/test_findings.py::test_interpreter_miscomputes_bf16); "
    "bfloat16 runs on GPUs")
FIXED = {
    "page_size": "the framework's page-16 views (difftest/case/spec.py validate holds the page "
                 "size)",
    "is_mla": "MiniMax-M3 is not MLA: K and V are separate views (left at its default)",
    "lse": "float32 [rows, heads] scratch the adapter allocates (an output of the kernel)",
}


class VllmDecodeAttention(VllmAdapter):
    """Adapter from a case to ``vllm.v1.attention.ops.triton_decode_attention``."""

    base = "vllm-decode-attention"
    kernel_files = ("v1/attention/ops/triton_decode_attention.py",)
    kernel_module_name = "vllm.v1.attention.ops.triton_decode_attention"
    bf16_dots = ("query_dtype", "kv_dtype")  # P @ V is a dot in V's dtype
    interpreter_bf16_finding = INTERPRETER_BF16_FINDING
    in_page_orders = ("plain",)

    def __init__(self, vllm: str | None = None) -> None:
        super().__init__(vllm)

    def with_options(self, options: Mapping[str, str]) -> VllmDecodeAttention:
        """``vllm=<version or path>``: the vLLM release whose kernel runs."""
        free, _ = self.split_options(options)
        return VllmDecodeAttention(**free)

    def unsupported_in_every_release(self, case: Case, device: torch.device) -> str | None:
        """bf16 queries or a bf16 cache under the interpreter (F1); fp8 queries and the
        serving terms (no such parameters); e4m3fnuz on NVIDIA GPUs."""
        reason = self.interpreter_bf16_reason(case, device)
        if reason:
            return reason
        if case.q_scale:
            return "decode_attention_fwd has no query descale (fp8 queries)"
        if case.serving_terms:
            return (f"decode_attention_fwd has no {' and '.join(case.serving_terms)} "
                    "(no sinks, ALiBi slopes, fp8 output or per-token-head scale caches)")
        return self.fnuz_reason(case, device)

    def unsupported_in_some_release(self, case: Case, device: torch.device) -> str | None:
        """What older releases lack: the sliding window (before 0.34.0) and fp8 caches
        (``k_scale``)."""
        if case.sliding_window:
            return "releases before 0.34.0 have no sliding window"
        if case.is_fp8:
            return "older releases have no k_scale/v_scale (fp8 caches)"
        return None

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """What it refuses in every release (:meth:`unsupported_in_every_release`); then
        sliding windows before 0.34.0 and fp8 caches on releases without ``k_scale``."""
        reason = self.unsupported_in_every_release(case, device)
        if reason is not None:
            return reason
        if case.sliding_window and "sliding_window" not in self._parameters():
            return f"vLLM {self.version()}'s decode_attention_fwd has no sliding window"
        if case.is_fp8 and "k_scale" not in self._parameters():
            return (f"vLLM {self.version()}'s decode_attention_fwd has no k_scale/v_scale "
                    "(fp8 caches)")
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """q @ K in the query dtype (K cast to it), P rounded to V's dtype (the query dtype
        for fp8 V, dequantised to it), the output in the query dtype; fp32 dots tf32 on
        GPUs. With one query head per KV head the MHA kernel forms each logit as
        ``tl.sum(q * k)``: every product is rounded to the query dtype (F29)."""
        q = case.query_dtype
        work = "tfloat32" if q == "float32" and device.type == "cuda" else q
        probabilities = work if case.is_fp8 else case.kv_dtype
        if probabilities == "float32" and device.type == "cuda":
            probabilities = "tfloat32"
        return Precision(work, probabilities, q,
                         rounded_products=case.num_q_heads == case.num_kv_heads)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """Stage 2 writes ``0 / 0`` (NaN) on a row of context 0."""
        return EmptyRowOutput.UNDEFINED

    def _parameters(self) -> tuple[str, ...]:
        return tuple(inspect.signature(self.kernel_module().decode_attention_fwd).parameters)

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``decode_attention_fwd`` call over all query rows."""
        decode_attention_fwd = self.kernel_module().decode_attention_fwd
        case = inputs.case
        views = inputs.cache("plain")
        table, ctx = inputs.sparse_table
        out = inputs.output(torch_dtype(case.query_dtype))
        splits = case.split_k_segments or DEFAULT_SPLITS
        heads = (case.total_q, case.num_q_heads)
        f32 = dict(dtype=torch.float32, device=inputs.device)
        arguments: dict[str, Any] = dict(
            q=inputs.data.query, k_buffer=views.k, v_buffer=views.v, o=out,
            lse=torch.empty(heads, **f32), req_to_token=table, b_seq_len=ctx,
            attn_logits=torch.empty((*heads, splits, case.head_dim + 1), **f32),
            num_kv_splits=splits, sm_scale=case.softmax_scale, page_size=case.page_size,
            logit_cap=case.softcap)
        if case.sliding_window:  # the last W keys of the row (0.34.0 and later)
            arguments["sliding_window"] = case.sliding_window
        if case.is_fp8:  # left out otherwise: 0.14.0's kernel has no scale parameters
            arguments["k_scale"], arguments["v_scale"] = inputs.scales()
        decode_attention_fwd(**arguments)
        valid = torch.arange(table.shape[1], device=table.device)[None] < (
            (ctx[:, None] + case.page_size - 1) // case.page_size)
        inputs.state(kernel_call(decode_attention_fwd, arguments, labels={
            "k_buffer": f"{case.kv_dtype} {case.kv_layout} {views.k.shape[0]} pages",
            "v_buffer": f"{case.kv_dtype} {case.kv_layout} {views.v.shape[0]} pages",
            "req_to_token": id_classes(table, views.v.shape[0] - 1, valid),
            "b_seq_len": length_classes(ctx.tolist()),
            "attn_logits": f"float32 scratch, {splits} splits",
            "k_scale": scale_class(case.k_scale if case.is_fp8 else None),
            "v_scale": scale_class(case.v_scale if case.is_fp8 else None),
            "logit_cap": "0 (off)" if not case.softcap else "softcap",
        }, fixed=FIXED, sizes={"head_dim": (case.head_dim, "q.shape[2], k_buffer.shape[3]"),
                               "num_kv_heads": (case.num_kv_heads, "k_buffer.shape[2]")}))
        return out
