"""``triton-unified``: vLLM's Triton ``unified_attention`` on the plain LBHNC/LHBNC views.

Each query row is its own sequence of length 1 attending ``context_lens[row]`` tokens through
the framework's page-16 sparse table; K and V are the untrimmed plain views (2048 vs 2040
pages at 128 blocks), which ``unified_attention`` addresses through strides alone. fp8 KV runs
with ``KVQuantMode.FP8_PER_TENSOR``. Native on a GPU; on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
from difftest.backends.vllm_imports import triton_availability, triton_precision

from difftest import devices
from difftest.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.case import Case
from difftest.dtypes import torch_dtype

INTERPRETER_BF16_FINDING = (
    "bfloat16 queries under TRITON_INTERPRET=1 are miscomputed by Triton's interpreter "
    "(pinned finding F1, tests/test_findings.py::test_interpreter_miscomputes_bf16); "
    "bfloat16 runs on GPUs"
)


class TritonUnifiedAttention:
    """Adapter from a case to ``vllm.v1.attention.ops.triton_unified_attention``."""

    name = "triton-unified"
    in_page_orders = ("plain",)

    def __init__(self, allow_interpreter_bf16: bool = False) -> None:
        self.allow_interpreter_bf16 = allow_interpreter_bf16

    def availability(self) -> Availability:
        """Needs vLLM; on a machine without GPUs also the Triton interpreter."""
        return triton_availability()

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """bf16 queries under the interpreter; e4m3fnuz on NVIDIA GPUs."""
        if device.type == "cpu" and not self.allow_interpreter_bf16 and (
            case.query_dtype == "bfloat16"
        ):
            return INTERPRETER_BF16_FINDING
        if device.type == "cuda" and case.kv_dtype == "float8_e4m3fnuz" and (
            devices.gpu_vendor() == "nvidia"
        ):
            return "float8_e4m3fnuz is an AMD format; Triton on NVIDIA GPUs has no such type"
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """K/V dequantised to the query dtype; fp32 dots use tf32 on GPUs."""
        return triton_precision(case, device)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """The 2-D kernel writes 0 on rows with no context."""
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        """vLLM and Triton versions, and whether Triton is interpreted."""
        import triton
        from difftest.backends.vllm_imports import vllm_version

        return {"vllm": vllm_version(), "triton": triton.__version__,
                "triton_interpret": str(devices.interpreted())}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``unified_attention`` call over all query rows."""
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode

        case = inputs.case
        views = inputs.cache("plain")
        table, ctx = inputs.sparse_table
        query = inputs.data.query
        out = inputs.output(torch_dtype(case.query_dtype))
        k_scale, v_scale = inputs.scales()
        fp8 = case.is_fp8
        unified_attention(
            q=query,
            k=views.k,
            v=views.v,
            out=out,
            cu_seqlens_q=torch.arange(case.total_q + 1, dtype=torch.int32, device=inputs.device),
            max_seqlen_q=1,
            seqused_k=ctx,
            max_seqlen_k=case.topk * case.block_size,
            softmax_scale=case.softmax_scale,
            causal=True,
            window_size=(-1, -1),
            block_table=table,
            softcap=0,
            q_descale=None,
            k_descale=k_scale if fp8 else None,
            v_descale=v_scale if fp8 else None,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE,
        )
        return out
