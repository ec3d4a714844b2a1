"""``vllm-paged-decode``: vLLM's ``kernel_paged_attention_2d``, the ``ROCM_ATTN`` decode.

``chunked_prefill_paged_decode`` (``vllm/v1/attention/ops/chunked_prefill_paged_decode.py``)
is what vLLM's ``ROCM_ATTN`` backend calls. For decode rows (``max_query_len == 1``) it runs
no prefill kernel (``context_attention_fwd`` runs only for ``max_query_len > 1``), asks
``use_rocm_custom_paged_attention`` whether the HIP ``paged_attention_rocm`` takes the shape,
and otherwise launches the Triton ``kernel_paged_attention_2d``. This backend launches that
Triton kernel itself with the arguments the wrapper's Triton branch computes (vLLM 0.33.0),
because the wrapper imports ``vllm.platforms.rocm`` inside the call, which needs a GPU build
of torch: so the same kernel runs on every machine, and the HIP kernel is not tested here.

The cache is AITER's shuffled LBHNC/LHBNC cache, as the ``ROCM_ATTN`` backend reads it when
AITER's fused writer emits the shuffled layout (``set_interleaved_v_cache``): K is the 5-D
page view ``[pages, nkv, D/x, 16, x]``, V the same bytes as vLLM's 4-D view
``[pages, nkv, D, 16]`` read through ``INTERLEAVED_V_PACK_FACTOR = 16 // itemsize``; K and V
are the untrimmed views (2048 vs 2040 pages at 128 blocks), addressed by one page id. Each
query row is its own sequence of one query token over the framework's page-16 sparse table.
The case's sliding window ``W`` is the kernel's ``SLIDING_WINDOW``; the kernel has no
softcap and no query descale. Native on a GPU; on the CPU under ``TRITON_INTERPRET=1``
(bf16 queries excluded there: finding F1).

``vllm-paged-decode[vllm=0.30.0]`` (or a path, or ``$DIFFTEST_VLLM``) runs that release's
kernel file (:mod:`difftest.backends.vllm_release`). A release without the interleaved-V mode
(0.31.0 and earlier) reads the plain cache instead, through strided views of the same shapes
(K ``[pages, nkv, D/x, 16, x]``, V ``[pages, nkv, D, 16]``), which its kernel addresses by
strides alone. ``arch=<gfx...>`` (:mod:`~.vllm_arch`) answers the wrapper's
``vllm.platforms.rocm`` imports as that GPU, so the release's ``chunked_prefill_paged_decode``
itself runs (its Triton branch, with the launch choices it makes for that architecture:
vLLM 0.34.0's RDNA warps and stages) and the backend states the arguments it passed.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from difftest.backends.vllm_adapter import INTERPRETER_BF16_FINDING, VllmAdapter
from difftest.backends.vllm_arch import OnceLogger
from difftest.backends.vllm_imports import load_vllm_kernel, triton_precision
from difftest.case.selection import build_rows
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.contract.exported_call import ExportedCall, KernelImport
from difftest.contract.kernel_call import id_classes, kernel_call, length_classes, scale_class
from difftest.machine import devices
from difftest.primitives.dtypes import torch_dtype

MAX_TRITON_BLOCK_SIZE = 128  # the wrapper's cap on the Triton tile
NON_POW2_TILE = 32  # the wrapper's tile for page sizes that are not a power of 2
M3 = "MiniMax-M3's decode"
SHAPES = ("follows from the cache's shapes (head size, KV heads, page size): one value "
          "over cases of one geometry, such as the sparse family's MiniMax-M3 pages")
FIXED = {
    "sink_ptr": f"{M3} passes no attention sinks",
    "alibi_slopes_ptr": f"{M3} has no ALiBi",
    "out_scale_inv": f"{M3} writes a bf16/fp16 output, not fp8 (output_scale None -> 1.0)",
    "USE_ALIBI_SLOPES": f"{M3} has no ALiBi",
    "USE_SINKS": f"{M3} passes no attention sinks",
    "USE_FP8": f"{M3} writes a bf16/fp16 output, not fp8",
    "filter_by_query_len": "the wrapper always passes True (decode rows only; rows of longer "
                           "sequences are the prefill kernel's)",
    "query_start_len_ptr": "each query row is its own sequence of one query token over its "
                           "sparse table (the decode rows of MTP too)",
    "num_queries_per_kv_padded": "max(next_power_of_2(num_queries_per_kv), 16): 16 for every "
                                 "GQA group of at most 16 heads; " + SHAPES,
    "BLOCK_SIZE": "min(page size, 128), 32 for a page size not a power of 2; " + SHAPES,
    "PHYSICAL_BLOCK_SIZE": "the page size (value_cache.shape[3]); " + SHAPES,
    "HEAD_SIZE": SHAPES, "HEAD_SIZE_PADDED": SHAPES, "x": "16 // itemsize of the cache",
    "INTERLEAVED_V_PACK_FACTOR": "16 // itemsize of the cache: the shuffled V is always "
                                 "interleaved (releases without the mode read the plain "
                                 "cache)",
    "query_stride_1": SHAPES, "output_stride_1": SHAPES,
    "stride_k_cache_0": SHAPES, "stride_k_cache_1": SHAPES, "stride_k_cache_2": SHAPES,
    "stride_k_cache_3": SHAPES, "stride_k_cache_4": "the x innermost elements are contiguous",
    "stride_v_cache_0": SHAPES, "stride_v_cache_1": SHAPES, "stride_v_cache_2": SHAPES,
    "stride_v_cache_3": "1 in the interleaved-V mode (unused there), the token stride of the "
                        "plain cache otherwise; " + SHAPES,
    "num_kv_heads": SHAPES,
    "FP8_MIN": "a default of the kernel: the platform fp8 range",
    "FP8_MAX": "a default of the kernel: the platform fp8 range",
}
# the wrapper's kv_cache_dtype per cache dtype: "fp8" views the cache as the platform's fp8
KV_CACHE_DTYPES = {"float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2": "fp8_e5m2"}


class VllmPagedDecode(VllmAdapter):
    """Adapter from a case to vLLM's Triton ``kernel_paged_attention_2d``."""

    base = "vllm-paged-decode"
    kernel_files = ("v1/attention/ops/chunked_prefill_paged_decode.py",)
    kernel_module_name = "vllm.v1.attention.ops.chunked_prefill_paged_decode"
    free_options = ("vllm", "arch")
    arch_launches = ("kernel_paged_attention_2d",)
    interpreter_bf16_finding = INTERPRETER_BF16_FINDING

    def __init__(self, vllm: str | None = None, arch: str | None = None) -> None:
        super().__init__(vllm, arch)

    def with_options(self, options: Mapping[str, str]) -> VllmPagedDecode:
        """``vllm=<version or path>``: the vLLM release whose kernel runs; ``arch=<gfx...>``:
        its ``chunked_prefill_paged_decode`` runs, launching as for that AMD GPU."""
        free, _ = self.split_options(options)
        return VllmPagedDecode(**free)

    def kernel_availability(self) -> Availability:
        """The release's kernel file must load here, and its kernel take a 5-D K cache."""
        try:
            params = self._parameters()
        except Exception as err:  # a release whose kernel file does not load here
            return Availability(False, f"vLLM {self.version()}'s {self.kernel_files[0]} does "
                                f"not load: {type(err).__name__}: {err}")
        if "stride_k_cache_4" not in params:
            return Availability(False, f"vLLM {self.version()}'s kernel_paged_attention_2d "
                                "has no 5-D K cache")
        return Availability(True)

    def on_arch_loaded(self, module: types.ModuleType) -> None:
        """The launch hook (the arguments the wrapper passed), and a logger with vLLM's
        ``*_once`` methods that needs no serving stack."""
        super().on_arch_loaded(module)
        module.logger = OnceLogger(module.__name__)  # type: ignore[attr-defined]

    @property
    def in_page_orders(self) -> tuple[str, ...]:
        """The shuffled cache where the release has the interleaved-V mode, else the plain
        one through strided 5-D K and 4-D V views."""
        try:
            return ("shuffled",) if self._interleaved() else ("plain",)
        except Exception:  # a kernel file that does not load: availability says why
            return ("shuffled",)

    def _interleaved(self) -> bool:
        return "INTERLEAVED_V_PACK_FACTOR" in self._parameters()

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """bf16 queries under the interpreter (F1); softcap and fp8 queries (no such
        parameter); a 16/32-bit cache of another dtype than the query (``tl.dot`` of q and
        K); e4m3fnuz on NVIDIA GPUs."""
        reason = self.interpreter_bf16_reason(case, device)
        if reason:
            return reason
        if case.softcap:
            return "kernel_paged_attention_2d has no logit softcap"
        if self.in_page_orders[0] not in case.layout.in_page_orders:
            return (f"the {case.kv_layout} layout has no {self.in_page_orders[0]} pages: "
                    f"vLLM {self.version()}'s ROCM_ATTN decode reads AITER's shuffled cache "
                    "through its interleaved-V mode (the standard-V mode over plain pages runs "
                    "on releases without it)")
        if case.q_scale:
            return "kernel_paged_attention_2d has no query descale (fp8 queries)"
        if not case.is_fp8 and case.query_dtype != case.kv_dtype:
            return (f"kernel_paged_attention_2d dequantises only fp8 K/V to the query dtype: "
                    f"a {case.kv_dtype} cache needs {case.kv_dtype} queries (tl.dot)")
        reason = self.fnuz_reason(case, device)
        if reason:
            return reason
        if (self.arch is not None and KV_CACHE_DTYPES.get(case.kv_dtype) == "fp8"
                and case.kv_dtype != self.arch.fp8):
            return (f"a {case.kv_dtype} cache under arch={self.arch.name}: "
                    "chunked_prefill_paged_decode views an fp8 cache as the platform's fp8, "
                    f"{self.arch.fp8} on {self.arch.name}")
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """K/V dequantised to the query dtype, P rounded to it; fp32 dots tf32 on GPUs."""
        return triton_precision(case, device)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """A row of context 0 runs no tile: ``0 / (0 + 1e-10)`` writes 0."""
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        """vLLM and Triton versions, and what runs."""
        kernel = ("kernel_paged_attention_2d (Triton), launched by the release's "
                  "chunked_prefill_paged_decode" if self.arch is not None else
                  "kernel_paged_attention_2d (Triton), launched as "
                  "chunked_prefill_paged_decode's Triton branch launches it")
        return {**self.vllm_versions(), "kernel": kernel}

    def _parameters(self) -> tuple[str, ...]:
        return tuple(self._load().arg_names)

    def _load(self) -> Any:
        """The chosen release's ``kernel_paged_attention_2d`` (under ``arch=``, its launch
        recorder)."""
        return self.kernel_module().kernel_paged_attention_2d

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One launch over all query rows (grid: rows x KV heads)."""
        import triton

        kernel = self._load()
        case = inputs.case
        nkv, dim, page = case.num_kv_heads, case.head_dim, case.page_size
        interleaved = self._interleaved()
        views = inputs.cache(self.in_page_orders[0])
        pages, x = views.v.shape[0], 16 // views.v.element_size()
        if interleaved:  # K [pages, nkv, D/x, 16, x]; V as vLLM's 4-D view of its bytes
            key, value = views.k, views.v.view(pages, nkv, dim, page)
        else:  # the same shapes over the token-major pages, through strides
            key = views.k.view(-1, page, nkv, dim // x, x).permute(0, 2, 3, 1, 4)
            value = views.v.permute(0, 2, 3, 1)
        table, ctx = inputs.sparse_table
        query = inputs.data.query
        out = inputs.output(torch_dtype(case.query_dtype))
        k_scale, v_scale = inputs.scales()
        group = case.num_q_heads // nkv
        starts = devices.to_device(torch.arange(case.total_q + 1, dtype=torch.int32),
                                   inputs.device)
        arguments: dict[str, Any] = dict(
            output_ptr=out, query_ptr=query, key_cache_ptr=key, value_cache_ptr=value,
            sink_ptr=None, block_tables_ptr=table, seq_lens_ptr=ctx, alibi_slopes_ptr=None,
            scale=case.softmax_scale, k_scale=k_scale, v_scale=v_scale, out_scale_inv=1.0,
            num_query_heads=case.num_q_heads, num_queries_per_kv=group,
            num_queries_per_kv_padded=max(triton.next_power_of_2(group), 16),
            block_table_stride=table.stride(0),
            query_stride_0=query.stride(0), query_stride_1=query.stride(1),
            output_stride_0=out.stride(0), output_stride_1=out.stride(1),
            BLOCK_SIZE=(min(page, MAX_TRITON_BLOCK_SIZE) if page & (page - 1) == 0
                        else NON_POW2_TILE),
            PHYSICAL_BLOCK_SIZE=value.shape[3], HEAD_SIZE=case.head_dim,
            HEAD_SIZE_PADDED=triton.next_power_of_2(case.head_dim),
            USE_ALIBI_SLOPES=False, SLIDING_WINDOW=case.sliding_window, x=key.shape[4],
            **{f"stride_k_cache_{i}": key.stride(i) for i in range(5)},
            **{f"stride_v_cache_{i}": value.stride(i) for i in range(4)},
            filter_by_query_len=True, query_start_len_ptr=starts, USE_SINKS=False,
            USE_FP8=False,
        )
        if interleaved:
            arguments["INTERLEAVED_V_PACK_FACTOR"] = x
        if self.arch is None:
            inputs.export_call(ExportedCall(self._kernel_import(), "kernel_paged_attention_2d",
                                            arguments, (case.total_q, nkv), "output_ptr"))
            kernel[(case.total_q, nkv)](**arguments)
        else:
            arguments = self._through_the_wrapper(inputs, arguments)
        valid = torch.arange(table.shape[1], device=table.device)[None] < (
            (ctx[:, None] + case.page_size - 1) // case.page_size)
        inputs.state(kernel_call(kernel, arguments, labels={
            "block_tables_ptr": id_classes(table, pages - 1, valid),
            "seq_lens_ptr": length_classes(ctx.tolist()),
            "query_start_len_ptr": "one query per sequence",
            "k_scale": scale_class(case.k_scale if case.is_fp8 else None),
            "v_scale": scale_class(case.v_scale if case.is_fp8 else None),
        }, fixed=FIXED, sizes={"num_kv_heads": (nkv, "key_cache.shape[1], grid[1]")}))
        return out

    def _kernel_import(self) -> KernelImport:
        """How a script outside difftest gets this ``kernel_paged_attention_2d``: from the
        installed vLLM, or from a tree given to it (the recorded one: this release's)."""
        tree = str(self.release.package.parent) if self.release is not None else ""
        options = {"module": self.kernel_module_name, "name": "kernel_paged_attention_2d"}
        return KernelImport("vllm", load_vllm_kernel, options, tree)

    def _through_the_wrapper(self, inputs: RunInputs, arguments: dict[str, Any]
                             ) -> dict[str, Any]:
        """Call the release's ``chunked_prefill_paged_decode`` on the tensors of
        ``arguments`` and return the kernel arguments its Triton branch passed (the launch
        parameters it chose are the reach record's)."""
        case = inputs.case
        ctx = arguments["seq_lens_ptr"]
        extra = {"use_interleaved_v_cache": True} if self._interleaved() else {}
        self.kernel_module().chunked_prefill_paged_decode(
            query=arguments["query_ptr"], key=None, value=None, output=arguments["output_ptr"],
            kv_cache_dtype=KV_CACHE_DTYPES.get(case.kv_dtype, "auto"),
            key_cache=arguments["key_cache_ptr"], value_cache=arguments["value_cache_ptr"],
            block_table=arguments["block_tables_ptr"],
            query_start_loc=arguments["query_start_len_ptr"], seq_lens=ctx,
            max_seq_len=int(ctx.max()), max_query_len=1, k_scale=arguments["k_scale"],
            v_scale=arguments["v_scale"], sliding_window=case.sliding_window,
            sm_scale=case.softmax_scale, **extra)
        kernel = self._load()
        return {name: value for name, value in kernel.last.items() if name in kernel.arg_names}


def loads_unread_slots_outside_the_window(case: Case, versions: Mapping[str, str]) -> bool:
    """The trigger of finding F28: with ``canary`` (NaN in every slot no row reads) and a
    sliding window, some row's tokens before its window (which the kernel loads and weights
    by ``exp(-10000 - m) = 0``) include a slot no row reads. Not with an fp8 cache under
    Triton's interpreter, which reads fp8 NaN bytes as finite values."""
    if not (case.canary and case.sliding_window):
        return False
    if case.is_fp8 and versions.get("triton_interpret") == "True":
        return False
    read, outside = [], []
    for row in build_rows(case):
        ids = np.concatenate([seg.physical_block * case.block_size + np.arange(seg.tokens)
                              for seg in row.segments] or [np.zeros(0, dtype=np.int64)])
        cut = max(len(ids) - case.sliding_window, 0)
        outside.append(ids[:cut])
        read.append(ids[cut:])
    return bool(np.isin(np.concatenate(outside), np.concatenate(read), invert=True).any())
