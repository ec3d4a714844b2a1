"""``triton-unified``: vLLM's Triton ``unified_attention`` on the plain views of any layout.

Each query row is its own sequence of length 1 attending ``context_lens[row]`` tokens through
the framework's sparse page table; K and V are the untrimmed plain views (2048 vs 2040
pages at 128 LBHNC blocks), which ``unified_attention`` addresses through strides alone. A
dense case (``Case.dense``) runs each request as one sequence of its query tokens over its
block table, as vLLM's attention layers call it, at the case's geometry: vLLM's split K/V
cache or the LBHNC/LHBNC pages, any head size (padded to a power of two inside the kernel),
several KV heads (GQA) and blocks of any multiple of 16 tokens. fp8 KV runs
with ``KVQuantMode.FP8_PER_TENSOR`` where the release has ``kv_quant_mode`` (older releases
detect fp8 from the cache dtype). The case's logit softcap is passed as ``softcap`` and its
sliding window ``W`` as ``window_size=(W - 1, 0)``: the row's query sits at the end of its
attended sequence, so the window is the last ``W`` attended tokens. Native on a GPU; on the
CPU under ``TRITON_INTERPRET=1``.

The other kernel modes (docs/kernel-modes.md):

* fp8 queries (``q_scale``): the stored fp8 query and ``q_descale = q_scale`` (vLLM applies
  it with fp8 K/V in ``FP8_PER_TENSOR`` mode, for its platform's fp8 dtype);
* ``query_lens``: a request whose rows all select their causal blocks in order is passed as
  one sequence of ``query_lens[r]`` query tokens over the request's blocks (causal within
  it: the prefill path, ``max_seqlen_q > 1``); other rows stay sequences of their own;
* split-K (``split_k_segments``): fp32 scratch for that many segments and
  ``seq_threshold_3D = seq_threshold_3d``; vLLM then picks its 3-D kernel or the 2-D one by
  shape (:func:`kernel_path`, also the audit's label), and the run checks from the scratch
  which one really ran (a mismatch is an error, so a reported agreement names its path).

``triton-unified[vllm=0.30.0]`` (or ``vllm=/path/to/tree``, or ``$DIFFTEST_VLLM``) runs that
release's kernel files instead of the venv's (:mod:`difftest.backends.vllm_release`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from difftest.backends.unified_call import real_output, unified_attention_arguments
from difftest.backends.vllm_adapter import INTERPRETER_BF16_FINDING, VllmAdapter
from difftest.backends.vllm_imports import triton_precision
from difftest.case.selection import kernel_sequences, unified_query_blocks
from difftest.case.spec import Case
from difftest.contract.backend import EmptyRowOutput, Precision, RunInputs
from difftest.contract.kernel_call import id_classes, kernel_call, length_classes, scale_class
from difftest.inputs import serving_terms
from difftest.primitives.dtypes import dtype_name

INTERPRETER_FP8_QUERY_FINDING = (
    "fp8 queries under TRITON_INTERPRET=1: Triton's interpreter converts float32 subnormals "
    "to nonzero fp8 (1e-40 -> 0.00195), so the P * 256 -> fp8 step of the fp8-query path "
    "turns weights below ~1e-36 into spurious ones (finding F12, "
    "tests/test_kernel_modes.py::test_f12_interpreter_turns_fp32_subnormals_into_fp8_values); "
    "fp8 queries run on GPUs"
)
MAX_3D_QUERY_LEN = 8  # vLLM 0.33.0's bound on max_seqlen_q for the 3-D kernel
M3 = "MiniMax-M3's sparse decode"
MODE_OFF = (f"{M3} keeps this mode off; the kernel modes (difftest/generation/modes.py) switch it "
            "on")
TWO_D = ("None without split-K scratch (the 2-D kernel, as MiniMax-M3's decode); the split-K "
         "mode hands over scratch so vLLM picks 2-D or 3-D by shape")
SPARSE_GEOMETRY = ("the sparse family keeps MiniMax-M3's geometry (head dim 128, 16-token pages, "
                   "one KV head); the dense family (difftest/generation/dense.py, one example per "
                   "five) varies it")
FIXED = {  # why a parameter of unified_attention does not vary (values still shown)
    "causal": "the sparse table ends each row at its own token; over a query_lens sequence "
              "it is the causal mask within the request",
    "softcap": MODE_OFF, "window_size": MODE_OFF, "q_descale": MODE_OFF,
    "max_seqlen_q": "1 per row; the query_lens mode passes a request as one sequence",
    "seq_threshold_3D": TWO_D, "num_par_softmax_segments": TWO_D,
    "softmax_segm_output": TWO_D, "softmax_segm_max": TWO_D, "softmax_segm_expsum": TWO_D,
    "use_alibi_sqrt": "the ALiBi of the serving terms is the linear one (Press et al.)",
    "qq_bias": f"{M3} has no query-query bias",
    "mm_prefix_range": f"{M3} has no multimodal prefix",
    "rswa_prefix_lens": f"{M3} has no R-SWA", "rswa_window": f"{M3} has no R-SWA",
    "chunk_lookback": f"{M3} has no chunked attention",
    "use_td": "tensor descriptors are an Intel Xe path",
    "mm_prefix_clamp_sliding_window": "a Gemma4 switch",
    "head_dim": SPARSE_GEOMETRY, "page_size": SPARSE_GEOMETRY, "num_kv_heads": SPARSE_GEOMETRY,
}


def kernel_path(case: Case, old_rule: bool = False) -> str:
    """Which ``unified_attention`` kernel runs the case: ``"2D"`` or ``"3D"``.

    vLLM 0.33.0: 3-D iff split-K scratch is given, ``max_seqlen_q <= 8``, and
    ``num_seqs * cdiv(max_seqlen_q, BLOCK_Q) <= seq_threshold_3D`` (scratch rows = query
    rows here; no batch invariance). ``old_rule`` (releases before ``MAX_3D_QUERY_LEN``,
    e.g. 0.31.0): 3-D iff scratch, ``max_seqlen_q == 1`` and ``num_seqs <= threshold``.
    """
    if not case.split_k_segments:
        return "2D"
    seqs = kernel_sequences(case)
    longest = max(n for _, n in seqs)
    if old_rule:
        return "3D" if longest == 1 and len(seqs) <= case.seq_threshold_3d else "2D"
    blocks = unified_query_blocks(case)
    return "3D" if longest <= MAX_3D_QUERY_LEN and blocks <= case.seq_threshold_3d else "2D"


class TritonUnifiedAttention(VllmAdapter):
    """Adapter from a case to ``vllm.v1.attention.ops.triton_unified_attention``."""

    base = "triton-unified"
    kernel_files = ("v1/attention/ops/triton_unified_attention.py",
                    "attention/ops/triton_unified_attention.py")
    kernel_module_name = "vllm.v1.attention.ops.triton_unified_attention"
    free_options = ("vllm", "arch")
    arch_launches = ("kernel_unified_attention", "reduce_segments")
    interpreter_bf16_finding = INTERPRETER_BF16_FINDING
    in_page_orders = ("plain",)

    def __init__(self, allow_interpreter_bf16: bool = False, vllm: str | None = None,
                 allow_interpreter_fp8_query: bool = False, arch: str | None = None) -> None:
        super().__init__(vllm, arch, allow_interpreter_bf16=allow_interpreter_bf16)
        self.allow_interpreter_fp8_query = allow_interpreter_fp8_query
        self._facts: dict[str, Any] = {}  # the kernel file's source, its signature check

    def with_options(self, options: Mapping[str, str]) -> TritonUnifiedAttention:
        """``vllm=<version or path>``: the vLLM release whose kernel runs; ``arch=<gfx...>``:
        its launchers make that AMD architecture's choices (:mod:`~.vllm_arch`)."""
        free, _ = self.split_options(options)
        return TritonUnifiedAttention(self.allow_interpreter_bf16, free.get("vllm"),
                                      self.allow_interpreter_fp8_query, free.get("arch"))

    def unsupported_in_every_release(self, case: Case, device: torch.device) -> str | None:
        """bf16 and fp8 queries under the interpreter (F1, F12); e4m3fnuz on NVIDIA GPUs;
        fp8 queries, or an fp8 output, of another fp8 dtype than the platform's."""
        reason = self.interpreter_bf16_reason(case, device) or self.fnuz_reason(case, device)
        if reason:
            return reason
        if case.q_scale:
            if device.type == "cpu" and not self.allow_interpreter_fp8_query:
                return INTERPRETER_FP8_QUERY_FINDING
            if case.kv_dtype != self._platform_fp8():
                return (f"fp8 queries in {case.kv_dtype}: vLLM applies q_descale only to "
                        f"queries of its platform's fp8 dtype, {self._platform_fp8()}")
        if case.output_scale and case.output_dtype != self._platform_fp8():
            return (f"an fp8 output in {case.output_dtype}: vLLM saturates it at its "
                    f"platform's fp8 maximum, {self._platform_fp8()}'s")
        return None

    def _platform_fp8(self) -> str:
        """The fp8 dtype vLLM's platform (or the emulated arch) quantises to."""
        from vllm.platforms import current_platform

        return self.arch.fp8 if self.arch else dtype_name(current_platform.fp8_dtype())

    def unsupported_in_some_release(self, case: Case, device: torch.device) -> str | None:
        """What older releases lack: ``kv_quant_mode`` (they cast only fp8 K/V to the query
        dtype), the query descale and per-token-head scale caches."""
        if not case.is_fp8 and case.query_dtype != case.kv_dtype:
            return ("a 16/32-bit cache of another dtype than the query: releases without "
                    "kv_quant_mode cast only fp8 K/V to the query dtype")
        if case.q_scale:
            return "fp8 queries: older releases assert q_descale is None"
        if case.kv_quant == "per_token_head":
            return "per-token-head scale caches: older releases have no FP8_PER_TOKEN_HEAD"
        return None

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """What it refuses in every release (:meth:`unsupported_in_every_release`); then fp8
        queries on a release without q descale, a serving term the release lacks, and on
        releases before ``kv_quant_mode`` (which cast only fp8 K/V to the query dtype) mixed
        16/32-bit dtypes."""
        reason = self.unsupported_in_every_release(case, device)
        if reason is not None:
            return reason
        if case.q_scale and "Q_IS_FP8" not in self._source():
            return (f"fp8 queries: vLLM {self.version()}'s unified_attention has no q descale "
                    "(it asserts q_descale is None)")
        reason = self._serving_terms_reason(case)
        if reason:
            return reason
        if not case.is_fp8 and case.query_dtype != case.kv_dtype and not self._casts_kv():
            return (f"vLLM {self.version()}'s unified_attention has no kv_quant_mode and casts "
                    f"only fp8 K/V to the query dtype: a {case.kv_dtype} cache needs "
                    f"{case.kv_dtype} queries (tl.dot rejects {case.query_dtype} x "
                    f"{case.kv_dtype})")
        return None

    def _serving_terms_reason(self, case: Case) -> str | None:
        """Why this release cannot run the case's serving terms, if it cannot: a parameter
        it lacks; per-token-head scales without ``FP8_PER_TOKEN_HEAD``."""
        if not case.serving_terms:
            return None
        parameters = inspect.signature(self._kernel()).parameters
        wanted = {"sinks": "sinks", "alibi": "alibi_slopes", "output_scale": "output_scale",
                  "kv_quant": "k_scale_cache"}
        lacking = [wanted[t] for t in case.serving_terms if wanted[t] not in parameters]
        if lacking:
            return (f"vLLM {self.version()}'s unified_attention has no "
                    f"{', '.join(lacking)}")
        if case.kv_quant == "per_token_head" and not hasattr(
                self._kernel().__globals__.get("KVQuantMode"), "FP8_PER_TOKEN_HEAD"):
            return (f"vLLM {self.version()}'s KVQuantMode has no FP8_PER_TOKEN_HEAD "
                    "(per-token-head scale caches)")
        return None

    def _source(self) -> str:
        """The text of the chosen release's kernel file (read once per backend)."""
        if "source" not in self._facts:
            self._facts["source"] = Path(self.kernel_module().__file__ or "").read_text()
        return self._facts["source"]

    def _casts_kv(self) -> bool:
        """Whether the kernel casts every K/V tile to the query dtype (``kv_quant_mode``)."""
        if "casts_kv" not in self._facts:
            self._facts["casts_kv"] = (
                "kv_quant_mode" in inspect.signature(self._kernel()).parameters)
        return self._facts["casts_kv"]

    def precision(self, case: Case, device: torch.device) -> Precision:
        """K/V dequantised to the query dtype; fp32 dots use tf32 on GPUs. fp8 queries: q,
        K and V stay fp8 and the probabilities are rounded to fp8 (``P * 256`` for the
        fp8 ``P @ V`` dot), the output in the query dtype."""
        if case.q_scale:
            return Precision(case.kv_dtype, case.kv_dtype, case.output_dtype)
        return triton_precision(case, device)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """The 2-D kernel writes 0 on rows with no context (no tile, ``acc / L`` is 0 / 1);
        the 3-D kernel writes no segment for them and its reduction returns before it
        reads or stores one (``seq_len <= 0``), so the row keeps what the output held:
        undefined (NaN in the buffer each run fills, checked natively on an H100)."""
        old_rule = "MAX_3D_QUERY_LEN" not in self._source()
        if kernel_path(case, old_rule=old_rule) == "3D":
            return EmptyRowOutput.UNDEFINED
        return EmptyRowOutput.ZERO

    def versions(self) -> dict[str, str]:
        """vLLM and Triton versions, whether Triton is interpreted, and the kernel path."""
        return {**self.vllm_versions(),
                "kernel_path": "2-D; 3-D where a case's split_k_segments and "
                "seq_threshold_3d make vLLM choose it (the audit's seq_threshold_3D "
                "label per case; checked from the scratch after each run)"}

    def _kernel(self) -> Callable[..., Any]:
        """The ``unified_attention`` function of the chosen release (or the venv's)."""
        return self.kernel_module().unified_attention

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``unified_attention`` call over all query rows."""
        unified_attention = self._kernel()
        case = inputs.case
        device = inputs.device
        arguments = unified_attention_arguments(inputs, inputs.cache("plain"))
        out, ctx = arguments["out"], inputs.sparse_table[1]
        scratch = self._split_k_scratch(case, device)
        arguments |= scratch
        if self._casts_kv():
            modes = unified_attention.__globals__["KVQuantMode"]
            arguments["kv_quant_mode"] = modes.FP8_PER_TENSOR if case.is_fp8 else modes.NONE
        if case.kv_quant == "per_token_head":
            arguments |= self._scale_caches(inputs, arguments["k"].shape[0])
        unified_attention(**arguments)
        ran = "2D"
        if scratch and bool((ctx > 0).any()):
            ran = "2D" if bool(scratch["softmax_segm_max"].isnan().all()) else "3D"
            expected = kernel_path(case, old_rule="MAX_3D_QUERY_LEN" not in self._source())
            # an emulated arch may move a 3-D batch to 2-D (gfx1201 halves the threshold
            # for 16-bit decode; gfx1100 runs sliding-window batches as 2-D), never back
            if ran != expected and not (self.arch is not None and ran == "2D"):
                raise RuntimeError(f"unified_attention ran its {ran} kernel where vLLM's rule "
                                   f"says {expected} (split_k_segments "
                                   f"{case.split_k_segments}, seq_threshold_3d "
                                   f"{case.seq_threshold_3d}, "
                                   f"{len(arguments['seqused_k'])} sequences)")
        inputs.state(self._statement(arguments, case, ran))
        return real_output(case, out)

    def _scale_caches(self, inputs: RunInputs, pages: int) -> dict[str, Any]:
        """``FP8_PER_TOKEN_HEAD`` and its scale caches over the views' page ids (the
        per-tensor descales stay, unread in this mode)."""
        case, data = inputs.case, inputs.data
        modes = self._kernel().__globals__["KVQuantMode"]
        caches = {f"{side}_scale_cache": serving_terms.scale_cache(
            case, scales, data.block_ids, pages)
            for side, scales in (("k", data.k_token_scales), ("v", data.v_token_scales))
            if scales is not None}
        return {"kv_quant_mode": modes.FP8_PER_TOKEN_HEAD, **caches}

    def _statement(self, arguments: dict[str, Any], case: Case, ran: str) -> Any:
        """The statement of the ``unified_attention`` call made with ``arguments``."""
        table, ctx, views = arguments["block_table"], arguments["seqused_k"], arguments["v"]
        valid = torch.arange(table.shape[1], device=table.device)[None] < (
            (ctx[:, None] + case.page_size - 1) // case.page_size)
        scratch = (f"fp32 scratch, {case.split_k_segments} segments"
                   if case.split_k_segments else "None")
        threshold = arguments.get("seq_threshold_3D")
        relation = "" if threshold is None else (
            " (query blocks <= threshold)" if unified_query_blocks(case) <= threshold
            else " (query blocks > threshold)")
        pages = f"{case.kv_dtype} {case.kv_layout} {{}} pages"
        return kernel_call(self._kernel(), arguments, labels={
            "k": pages.format(arguments["k"].shape[0]), "v": pages.format(views.shape[0]),
            "cu_seqlens_q": "one sequence per row" if arguments["max_seqlen_q"] == 1
            else "requests as causal sequences",
            "seqused_k": length_classes(ctx.tolist()),
            "block_table": id_classes(table, views.shape[0] - 1, valid),
            "q_descale": scale_class(case.q_scale or None),
            "k_descale": scale_class(case.k_scale if case.is_fp8 else None),
            "v_descale": scale_class(case.v_scale if case.is_fp8 else None),
            "seq_threshold_3D": f"{ran} ran{relation}" if threshold is not None else "None",
            "softmax_segm_output": scratch, "softmax_segm_max": scratch,
            "softmax_segm_expsum": scratch,
        }, fixed=FIXED, sizes={"head_dim": (case.head_dim, "q.shape[2], k.shape[3]"),
                               "page_size": (case.page_size, "k.shape[1], v.shape[1]"),
                               "num_kv_heads": (case.num_kv_heads, "k.shape[2]")})

    @staticmethod
    def _split_k_scratch(case: Case, device: torch.device) -> dict[str, Any]:
        """vLLM's split-K arguments for ``case`` (none without ``split_k_segments``); the
        segment maxima start NaN, so a 3-D run shows in them."""
        if not case.split_k_segments:
            return {}
        rows = (case.total_q, case.num_q_heads, case.split_k_segments)
        padded = 1 << (case.head_dim - 1).bit_length()
        f32 = torch.float32
        return {"seq_threshold_3D": case.seq_threshold_3d,
                "num_par_softmax_segments": case.split_k_segments,
                "softmax_segm_output": torch.zeros((*rows, padded), dtype=f32, device=device),
                "softmax_segm_max": torch.full(rows, float("nan"), dtype=f32, device=device),
                "softmax_segm_expsum": torch.zeros(rows, dtype=f32, device=device)}
