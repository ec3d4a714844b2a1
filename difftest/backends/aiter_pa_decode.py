"""``aiter-pa-decode``: AITER's Triton ``paged_attention_decode`` (``aiter.ops.triton.pa_decode``).

The other AITER decode path a MiniMax-M3 cache meets (in the PyPI wheel and every tag, from
sglang's and FLASHNN's kernel): one query token per sequence, so each query row is a
sequence of its own attending ``context_lens[row]`` tokens through the framework's page-16
sparse table, on the plain page views read as ``[pages, nkv, page, D]`` (the views
``[pages, page, nkv, D]`` transposed; K untrimmed, 2048 vs 2040 pages at 128 blocks: the
kernel addresses V with K's strides, so one page id reads both sides), per-tensor fp8
``k_scale`` and ``v_scale``, the queries' dtype as ``compute_type``.

The launcher picks the kernel: v1 (one pass) while ``max_seq_len`` is at most 8192 and fits
one 1024-token partition (or the batch has more than 512 query heads), else v2 (partitions,
then a reduction); the MHA kernels (``_wo_dot``: one query head per KV head, logits as
``sum(q * k)`` with products rounded to the compute type) or the GQA ones (``_w_dot``:
``tl.dot``). There is no softcap, sliding window or query descale.

Options: ``aiter=<path or name>`` (:mod:`difftest.backends.aiter_triton`: which AITER tree).
Native on a GPU (the kernels are plain Triton); on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from difftest.backends.aiter_triton import AiterSource, chosen_source, tree_availability
from difftest.backends.triton_unified import INTERPRETER_BF16_FINDING
from difftest.backends.vllm_arch import ARCHES
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.contract.kernel_call import (
    KernelCall,
    id_classes,
    kernel_call,
    length_classes,
    scale_class,
)
from difftest.inputs import serving_terms
from difftest.machine import devices

KERNEL_FILES = ("ops/triton/attention/pa_decode.py", "ops/triton/pa_decode.py")
SEQ_PARTITION = 1024  # AITER's _SEQ_PARTITION_SIZE
MAX_V1_SEQ_LEN = 8192
FIXED = {  # why a parameter of paged_attention_decode does not vary (values still shown)
    "num_seq_partitions": "unused by the launcher (it computes the partitions itself)",
}


def kernel_path(case: Case, max_seq_len: int) -> str:
    """The kernels AITER's launcher runs for ``case``: ``v1`` or ``v2`` (partitioned), MHA
    (one query head per KV head) or GQA."""
    partitions = -(-max_seq_len // SEQ_PARTITION)
    heads = case.total_q * case.num_q_heads
    v1 = max_seq_len <= MAX_V1_SEQ_LEN and (partitions == 1 or heads > 512)
    return f"{'v1' if v1 else 'v2'} {'MHA' if case.num_q_heads == case.num_kv_heads else 'GQA'}"


def compute_type(dtype: str) -> Any:
    """The Triton dtype of a query dtype: the ``compute_type`` passed."""
    import triton.language as tl

    return {"float16": tl.float16, "bfloat16": tl.bfloat16, "float32": tl.float32}[dtype]


class AiterPaDecode:
    """Adapter from a case to AITER's Triton ``paged_attention_decode``."""

    in_page_orders = ("plain",)
    releases = ("aiter",)  # the release kinds it runs (aiter=, $DIFFTEST_AITER)

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        options = dict(options or {})
        unknown = sorted(set(options) - {"aiter"})
        if unknown:
            raise ValueError(f"aiter-pa-decode: unknown option {unknown[0]!r} (options: aiter)")
        self.source, self.source_error = chosen_source(options.get("aiter"))
        self.name = (f"aiter-pa-decode[aiter={options['aiter']}]" if "aiter" in options
                     else "aiter-pa-decode")
        self._module: Any = None

    def with_options(self, options: Mapping[str, str]) -> AiterPaDecode:
        """``aiter=<path or name>``: the AITER tree whose kernel runs."""
        return AiterPaDecode(options)

    def availability(self) -> Availability:
        """Needs an AITER tree with Triton ``pa_decode``, and a GPU or the interpreter."""
        return tree_availability(self.source, self.source_error, KERNEL_FILES)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """bf16 queries under the interpreter (F1); the kernel modes and serving terms it has
        no parameter for (softcap, sliding window, fp8 queries, sinks, an fp8 output, scale
        caches: one ``k_scale``/``v_scale`` per tensor); an fp8 format the GPU does not
        have."""
        if device.type == "cpu" and case.query_dtype == "bfloat16":
            return INTERPRETER_BF16_FINDING
        missing = [name for name, on in (
            ("softcap", case.softcap), ("sliding_window", case.sliding_window),
            ("q_scale (fp8 queries)", case.q_scale), ("sinks", case.sinks),
            ("output_scale (an fp8 output)", case.output_scale),
            ("per-token-head scale caches", case.kv_quant == "per_token_head")) if on]
        if missing:
            return f"paged_attention_decode has no {' or '.join(missing)}"
        if device.type == "cuda" and case.is_fp8:
            if devices.gpu_vendor() == "nvidia" and case.kv_dtype == "float8_e4m3fnuz":
                return "float8_e4m3fnuz is an AMD format; Triton on NVIDIA GPUs has no such type"
            arch = ARCHES.get(devices.amd_arch(device) or "")
            if arch is not None and case.kv_dtype != arch.fp8:
                return f"{case.kv_dtype}: {arch.name}'s fp8 is {arch.fp8}"
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """q (times the softmax scale) and K/V (dequantised) rounded to the query dtype; the
        MHA kernels round each product ``q_i k_i`` to it and keep P in float32, the GQA
        kernels round P to it for ``tl.dot``; float32 dots use tf32 on GPUs."""
        q = case.query_dtype
        work = "tfloat32" if q == "float32" and device.type == "cuda" else q
        if case.num_q_heads == case.num_kv_heads:
            return Precision(q, "float32", q, rounded_products=True, scaled_query_rounded=True)
        return Precision(work, work, q, scaled_query_rounded=True)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """A row of context 0 runs no block: its output is ``0 / 0``."""
        return EmptyRowOutput.UNDEFINED

    def versions(self) -> dict[str, str]:
        """AITER's version and where it came from, Triton's."""
        import triton

        versions = {"triton": triton.__version__,
                    "triton_interpret": str(devices.interpreted())}
        if self.source is not None:
            versions |= {"amd-aiter": self.source.version,
                         "aiter_path": str(self.source.package),
                         "aiter_origin": self.source.origin,
                         "aiter_loading": "Triton ops modules executed from the tree under a "
                         "private name; aiter/__init__ and package re-exports skipped"}
        return versions

    def kernel(self) -> Callable[..., Any]:
        """The tree's ``paged_attention_decode``."""
        if self._module is None:
            source = self._require_source()
            path = source.find(*KERNEL_FILES)
            if path is None:
                raise RuntimeError(f"AITER {source.version} has no {' or '.join(KERNEL_FILES)}")
            self._module = source.load(path, None)  # it asks nothing about the device
        return self._module.paged_attention_decode

    def _require_source(self) -> AiterSource:
        if self.source is None:
            raise RuntimeError(self.source_error)
        return self.source

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``paged_attention_decode`` call, every query row a sequence."""
        case = inputs.case
        table, ctx = inputs.sparse_table
        views = inputs.cache("plain")
        k_scale, v_scale = inputs.scales()
        arguments = dict(
            output=inputs.output(inputs.data.query.dtype),
            query=inputs.data.query,
            key_cache=views.k.transpose(1, 2),
            value_cache=views.v.transpose(1, 2),
            seq_lens=ctx,
            block_tables=table,
            attn_scale=case.softmax_scale,
            max_seq_len=int(ctx.max()) if ctx.numel() else 0,
            compute_type=compute_type(case.query_dtype),
            k_scale=k_scale.reshape(1),
            v_scale=v_scale.reshape(1),
            alibi_slopes=serving_terms.alibi_slopes(case, inputs.device),
        )
        paged_attention_decode = self.kernel()
        paged_attention_decode(**arguments)
        inputs.state(self._statement(paged_attention_decode, arguments, case))
        return arguments["output"]

    def _statement(self, kernel: Callable[..., Any], arguments: dict[str, Any],
                   case: Case) -> KernelCall:
        """The statement of the call made with ``arguments``."""
        table, ctx = arguments["block_tables"], arguments["seq_lens"]
        valid = torch.arange(table.shape[1], device=table.device)[None] < (
            (ctx[:, None] + case.page_size - 1) // case.page_size)
        pages = f"{case.kv_dtype} {case.kv_layout} {{}} pages as [pages, nkv, page, D]"
        return kernel_call(kernel, arguments, labels={
            "key_cache": pages.format(arguments["key_cache"].shape[0]),
            "value_cache": pages.format(arguments["value_cache"].shape[0]),
            "seq_lens": length_classes(ctx.tolist()),
            "block_tables": id_classes(table, arguments["value_cache"].shape[0] - 1, valid),
            "max_seq_len": f"{arguments['max_seq_len']} "
                           f"({kernel_path(case, arguments['max_seq_len'])} kernels)",
            "compute_type": case.query_dtype,
            "k_scale": scale_class(case.k_scale if case.is_fp8 else None),
            "v_scale": scale_class(case.v_scale if case.is_fp8 else None),
            "alibi_slopes": "ALiBi slopes per query head" if case.alibi else "no ALiBi",
        }, fixed=FIXED, sizes={"head_dim": (case.head_dim, "query.shape[2]"),
                               "page_size": (case.page_size, "key_cache.shape[2]"),
                               "num_kv_heads": (case.num_kv_heads, "key_cache.shape[1]")})
