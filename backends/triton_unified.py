"""``triton-unified``: vLLM's Triton ``unified_attention`` on the plain LBHNC/LHBNC views.

Each query row is its own sequence of length 1 attending ``context_lens[row]`` tokens through
the framework's page-16 sparse table; K and V are the untrimmed plain views (2048 vs 2040
pages at 128 blocks), which ``unified_attention`` addresses through strides alone. fp8 KV runs
with ``KVQuantMode.FP8_PER_TENSOR`` where the release has ``kv_quant_mode`` (older releases
detect fp8 from the cache dtype). The case's logit softcap is passed as ``softcap`` and its
sliding window ``W`` as ``window_size=(W - 1, 0)``: the row's query sits at the end of its
attended sequence, so the window is the last ``W`` attended tokens. Native on a GPU; on the
CPU under ``TRITON_INTERPRET=1``.

``triton-unified[vllm=0.30.0]`` (or ``vllm=/path/to/tree``, or ``$DIFFTEST_VLLM``) runs that
release's kernel files instead of the venv's (:mod:`difftest.backends.vllm_release`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from difftest.backends.vllm_imports import triton_availability, triton_precision, vllm_version
from difftest.backends.vllm_release import chosen_release

from difftest import devices
from difftest.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.case import Case
from difftest.dtypes import torch_dtype

KERNEL_FILES = ("v1/attention/ops/triton_unified_attention.py",
                "attention/ops/triton_unified_attention.py")

INTERPRETER_BF16_FINDING = (
    "bfloat16 queries under TRITON_INTERPRET=1 are miscomputed by Triton's interpreter "
    "(pinned finding F1, tests/test_findings.py::test_interpreter_miscomputes_bf16); "
    "bfloat16 runs on GPUs"
)


class TritonUnifiedAttention:
    """Adapter from a case to ``vllm.v1.attention.ops.triton_unified_attention``."""

    in_page_orders = ("plain",)

    def __init__(self, allow_interpreter_bf16: bool = False, vllm: str | None = None) -> None:
        self.allow_interpreter_bf16 = allow_interpreter_bf16
        self.release, self.release_error = chosen_release(vllm)
        self.name = f"triton-unified[vllm={vllm}]" if vllm else "triton-unified"

    def with_options(self, options: Mapping[str, str]) -> TritonUnifiedAttention:
        """``vllm=<version or path>``: the vLLM release whose kernel runs."""
        unknown = sorted(set(options) - {"vllm"})
        if unknown:
            raise ValueError(f"triton-unified: unknown option {unknown[0]!r} (options: vllm)")
        return TritonUnifiedAttention(self.allow_interpreter_bf16, options.get("vllm"))

    def availability(self) -> Availability:
        """Needs vLLM (the chosen release's kernel file where one is named), and a GPU or
        the Triton interpreter."""
        if self.release_error:
            return Availability(False, self.release_error)
        if self.release is not None and self.release.find(*KERNEL_FILES) is None:
            return Availability(False, f"vLLM {self.release.version} at {self.release.package} "
                                f"has no {' or '.join(KERNEL_FILES)}")
        return triton_availability()

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """bf16 queries under the interpreter; e4m3fnuz on NVIDIA GPUs; on releases before
        ``kv_quant_mode`` (which cast only fp8 K/V to the query dtype), mixed 16/32-bit
        dtypes."""
        if device.type == "cpu" and not self.allow_interpreter_bf16 and (
            case.query_dtype == "bfloat16"
        ):
            return INTERPRETER_BF16_FINDING
        if device.type == "cuda" and case.kv_dtype == "float8_e4m3fnuz" and (
            devices.gpu_vendor() == "nvidia"
        ):
            return "float8_e4m3fnuz is an AMD format; Triton on NVIDIA GPUs has no such type"
        if not case.is_fp8 and case.query_dtype != case.kv_dtype and not self._casts_kv():
            version = self.release.version if self.release else vllm_version()
            return (f"vLLM {version}'s unified_attention has no kv_quant_mode and casts only "
                    f"fp8 K/V to the query dtype: a {case.kv_dtype} cache needs "
                    f"{case.kv_dtype} queries (tl.dot rejects {case.query_dtype} x "
                    f"{case.kv_dtype})")
        return None

    def _casts_kv(self) -> bool:
        """Whether the kernel casts every K/V tile to the query dtype (``kv_quant_mode``)."""
        return "kv_quant_mode" in inspect.signature(self._kernel()).parameters

    def precision(self, case: Case, device: torch.device) -> Precision:
        """K/V dequantised to the query dtype; fp32 dots use tf32 on GPUs."""
        return triton_precision(case, device)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """The 2-D kernel writes 0 on rows with no context."""
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        """vLLM and Triton versions, and whether Triton is interpreted."""
        import triton

        versions = {"vllm": vllm_version(), "triton": triton.__version__,
                    "triton_interpret": str(devices.interpreted())}
        if self.release is not None:
            kernel = self.release.find(*KERNEL_FILES)
            versions.update(vllm=self.release.version, vllm_path=str(self.release.package),
                            vllm_loading=f"{kernel} and its sibling kernel modules executed "
                            f"under {self.release.module_prefix}; vllm.platforms, envs and "
                            f"triton_utils from the venv's vLLM {vllm_version()}")
        return versions

    def _kernel(self) -> Callable[..., Any]:
        """The ``unified_attention`` function of the chosen release (or the venv's)."""
        if self.release is None:
            from vllm.v1.attention.ops import triton_unified_attention as module
        else:
            kernel = self.release.find(*KERNEL_FILES)
            if kernel is None:
                raise RuntimeError(self.availability().reason)
            module = self.release.load(kernel)
        return module.unified_attention

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``unified_attention`` call over all query rows."""
        unified_attention = self._kernel()
        case = inputs.case
        views = inputs.cache("plain")
        table, ctx = inputs.sparse_table
        query = inputs.data.query
        out = inputs.output(torch_dtype(case.query_dtype))
        k_scale, v_scale = inputs.scales()
        fp8 = case.is_fp8
        window = (case.sliding_window - 1, 0) if case.sliding_window else (-1, -1)
        arguments: dict[str, Any] = dict(
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
            window_size=window,
            block_table=table,
            softcap=case.softcap,
            q_descale=None,
            k_descale=k_scale if fp8 else None,
            v_descale=v_scale if fp8 else None,
        )
        if self._casts_kv():
            modes = unified_attention.__globals__["KVQuantMode"]
            arguments["kv_quant_mode"] = modes.FP8_PER_TENSOR if fp8 else modes.NONE
        unified_attention(**arguments)
        return out
