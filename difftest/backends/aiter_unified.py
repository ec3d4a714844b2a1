"""``aiter-unified`` and ``aiter-unified@shuffled``: AITER's Triton ``unified_attention``.

The kernel behind vLLM's ``ROCM_AITER_UNIFIED_ATTN`` backend, fed as ``triton-unified`` feeds
vLLM's: each query row is a sequence of length 1 (or, with ``query_lens``, a request whose
rows select their causal blocks in order is one causal sequence) attending
``context_lens[row]`` tokens through the framework's page-16 sparse table, on the untrimmed K
and V views (2048 vs 2040 pages at 128 blocks), fp8 K/V with per-tensor ``k_descale`` and
``v_descale``, fp8 queries with ``q_descale`` (releases from v0.1.12), the logit softcap, and
the sliding window ``W`` as ``window_size=(W - 1, 0)``.

``aiter-unified`` reads the plain page-16 views ``[pages, 16, nkv, D]``;
``aiter-unified@shuffled`` reads AITER's pre-shuffled views, K ``[pages, nkv, D/x, 16, x]``
and V ``[pages, nkv, 16/x, D, x]`` with ``shuffled_kv_cache=True`` (releases from v0.1.16).

AITER picks its 2-D or 3-D kernel itself (:func:`kernel_path`): 3-D for decode batches whose
``max_seqlen_k`` exceeds 512 without a sliding window, while the 2-D grid is within four
programs per compute unit. vLLM's split-K launch fields of a case (``split_k_segments``,
``seq_threshold_3d``) are vLLM's own and not passed.

Options: ``aiter=<path or name>`` (:mod:`difftest.backends.aiter_triton`: which AITER tree);
``arch=gfx942|gfx950|gfx1201`` (CPU only: the GPU answered on AITER's behalf, so its config
selection and arch queries take that GPU's branches; default per case, the arch whose fp8
is the case's fp8 format, gfx950 for 16-bit caches). On the CPU the launches AITER chose
(kernel, tiles, warps, stages, ``waves_per_eu``) are counted for the run's reach.
Native on a ROCm GPU; on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from difftest.backends.aiter_triton import (
    ARCH_OF_FP8,
    COMPUTE_UNITS,
    AiterSource,
    DeviceAnswers,
    answering,
    chosen_source,
    load_aiter_kernel,
    tree_availability,
)
from difftest.backends.triton_unified import (
    INTERPRETER_BF16_FINDING,
    INTERPRETER_FP8_QUERY_FINDING,
    M3,
    MODE_OFF,
)
from difftest.backends.unified_call import real_output, unified_attention_arguments
from difftest.backends.vllm_arch import ARCHES, record_launches
from difftest.backends.vllm_imports import triton_precision
from difftest.case.selection import kernel_sequences
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.contract.exported_call import ExportedCall, KernelImport
from difftest.contract.kernel_call import (
    KernelCall,
    id_classes,
    kernel_call,
    length_classes,
    scale_class,
)
from difftest.machine import devices
from difftest.primitives.dtypes import torch_dtype

KERNEL_FILES = ("ops/triton/attention/unified_attention.py",
                "ops/triton/unified_attention.py")
IMPL_FILES = ("ops/triton/_triton_kernels/attention/unified_attention.py",
              "ops/triton/_triton_kernels/unified_attention.py")
TYPES_FILES = ("ops/triton/utils/types.py",)
LAUNCHED = ("kernel_unified_attention_2d", "kernel_unified_attention_3d", "reduce_segments")
CASTS_KV = "K = K_load.to(Q.dtype)"  # the kernels convert every K/V tile (v0.1.12 on)
MAX_2D_SEQLEN_K = 512  # AITER: max_seqlen_k <= 512 always takes the 2-D kernel


FIXED = {  # why a parameter of AITER's unified_attention does not vary (values still shown)
    "causal": "the sparse table ends each row at its own token; over a query_lens sequence "
              "it is the causal mask within the request",
    "softcap": MODE_OFF, "window_size": MODE_OFF, "q_descale": MODE_OFF,
    "max_seqlen_q": "1 per row; the query_lens mode passes a request as one sequence",
    "qq_bias": f"{M3} has no query-query bias",
    "q_scales": "per-block query scales are AITER's FP4 (A4W4) path",
    "skip_reduce": "the 3-D kernel's reduction is part of the call under test",
    "shuffled_kv_cache": "aiter-unified reads the plain views; aiter-unified@shuffled the "
                         "pre-shuffled ones",
}


def case_arch(case: Case) -> str:
    """The CDNA arch whose AITER fp8 type is the case's: gfx942 for e4m3fnuz, else gfx950."""
    return ARCH_OF_FP8.get(case.kv_dtype, "gfx950")


def max_seqlen_k(case: Case) -> int:
    """The ``max_seqlen_k`` passed: the longest sparse-table row, ``topk * block_size``."""
    return case.topk * case.block_size


def kernel_path(case: Case, compute_units: int) -> str:
    """``"2D"`` or ``"3D"``: AITER's ``use_2d_kernel`` for ``case`` on a GPU of that many
    compute units (2-D with a sliding window, ``max_seqlen_k <= 512``, or more 2-D programs
    than ``4 * compute_units``; decode sequences count one program per KV head)."""
    seqs = kernel_sequences(case)
    programs = len(seqs) * case.num_kv_heads
    if case.sliding_window or max_seqlen_k(case) <= MAX_2D_SEQLEN_K:
        return "2D"
    return "2D" if programs > 4 * compute_units else "3D"


class AiterUnified:
    """Adapter from a case to AITER's ``unified_attention`` (plain or shuffled views)."""

    releases = ("aiter",)  # the release kinds it runs (aiter=, $DIFFTEST_AITER)

    def __init__(self, shuffled: bool = False, options: Mapping[str, str] | None = None) -> None:
        self.shuffled = shuffled
        base = "aiter-unified@shuffled" if shuffled else "aiter-unified"
        options = dict(options or {})
        unknown = sorted(set(options) - {"aiter", "arch"})
        if unknown:
            raise ValueError(f"{base}: unknown option {unknown[0]!r} (options: aiter, arch)")
        self.arch = options.get("arch", "")
        if self.arch and self.arch not in COMPUTE_UNITS:
            raise ValueError(f"{base}: arch={self.arch!r} is not one of "
                             f"{', '.join(COMPUTE_UNITS)}")
        self.source, self.source_error = chosen_source(options.get("aiter"))
        changed = [f"{key}={options[key]}" for key in sorted(options)]
        self.name = f"{base}[{','.join(changed)}]" if changed else base
        self.in_page_orders = ("shuffled",) if shuffled else ("plain",)
        self._modules: dict[str, Any] = {}

    def with_options(self, options: Mapping[str, str]) -> AiterUnified:
        """``aiter=<path or name>``, ``arch=gfx942|gfx950|gfx1201``."""
        return AiterUnified(self.shuffled, options)

    def availability(self) -> Availability:
        """Needs an AITER tree with Triton ``unified_attention`` and a GPU or the Triton
        interpreter (a release without the shuffled views reports each case
        ``unsupported``)."""
        found = tree_availability(self.source, self.source_error, KERNEL_FILES)
        if not found.available:
            return found
        if devices.visible_gpu_count() and devices.gpu_vendor() != "amd" and (
                not devices.interpreted()):
            return Availability(False, "AITER's Triton unified_attention targets AMD GPUs: it "
                                "launches with waves_per_eu, an AMD-only option that Triton's "
                                "CUDA backend rejects ('Keyword argument waves_per_eu was "
                                "specified but unrecognised'), and reads a gfx arch from "
                                "Triton's target; this GPU is not AMD")
        return Availability(True)

    def unsupported_in_every_release(self, case: Case, device: torch.device) -> str | None:
        """bf16 and fp8 queries under the interpreter (F1, F12); a layout without the views
        it reads; an fp8 format that is not the arch's own (AITER's kernels read the arch's
        fp8 type); fp8 queries on shuffled page-16 views; per-token-head scale caches."""
        if device.type == "cpu" and case.query_dtype == "bfloat16":
            return INTERPRETER_BF16_FINDING
        if self.in_page_orders[0] not in case.layout.in_page_orders:
            return (f"kv_layout {case.kv_layout} has no {self.in_page_orders[0]} pages (AITER's "
                    f"pre-shuffled views exist for the LBHNC and LHBNC caches)")
        arch = self._answers(case).arch if device.type == "cpu" else devices.amd_arch(device)
        if case.is_fp8 and arch in ARCHES and case.kv_dtype != ARCHES[arch].fp8:
            return (f"{case.kv_dtype}: {arch}'s fp8 is {ARCHES[arch].fp8}, the type AITER's "
                    "kernels read the cache as (aiter.ops.triton.utils.types.e4m3_dtype)")
        if case.q_scale:
            if device.type == "cpu":
                return INTERPRETER_FP8_QUERY_FINDING
            if self.shuffled:
                return ("fp8 queries on shuffled fp8 views: AITER asserts block_size >= 32 "
                        "for A8W8 with a pre-shuffled cache; these views have 16-token pages")
        if case.kv_quant == "per_token_head":
            return ("AITER's unified_attention has no per-token-head scale caches (one "
                    "k_descale and v_descale per tensor)")
        return None

    def unsupported_in_some_release(self, case: Case, device: torch.device) -> str | None:
        """What releases before v0.1.12 (the wheel included) lack: the cast of 16/32-bit K/V
        to the query dtype, and q descale (the shuffled views, v0.1.16 on, have both)."""
        if self.shuffled:
            return None
        if not case.is_fp8 and case.query_dtype != case.kv_dtype:
            return ("a 16/32-bit cache of another dtype than the query: releases before "
                    "v0.1.12 cast only fp8 K/V to the query dtype")
        if case.q_scale:
            return "fp8 queries: releases before v0.1.12 assert q_descale is None"
        return None

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """What it refuses in every release (:meth:`unsupported_in_every_release`); then what
        the loaded release lacks: the shuffled views before v0.1.16, fp8 queries before
        ``q_descale``, a release whose fp8 type on the arch is another format (of the cache or
        of an fp8 output), before v0.1.12 mixed 16/32-bit dtypes (no cast of 16/32-bit K/V)."""
        reason = self.unsupported_in_every_release(case, device)
        if reason is not None:
            return reason
        if self.shuffled and "shuffled_kv_cache" not in self._kernel_source():
            return (f"AITER {self._version()}'s unified_attention has no shuffled_kv_cache "
                    "(AITER v0.1.16 on)")
        if case.is_fp8:
            arch = self._answers(case).arch if device.type == "cpu" else "this GPU's arch"
            fp8 = self._fp8_type(case, device)
            if torch_dtype(case.kv_dtype) != fp8:
                return (f"{case.kv_dtype}: AITER {self._version()}'s fp8 type on {arch} is "
                        f"{fp8} (aiter.ops.triton.utils.types.e4m3_dtype); the kernel asserts "
                        "or misreads other formats")
        if case.q_scale and "assert q_descale is None" in self._kernel_source():
            return (f"fp8 queries: AITER {self._version()}'s unified_attention asserts "
                    "q_descale is None (q descale from v0.1.12)")
        if case.output_scale and torch_dtype(case.output_dtype) != self._fp8_type(case, device):
            return (f"an fp8 output in {case.output_dtype}: AITER saturates it at its fp8 "
                    f"type's maximum, {self._fp8_type(case, device)}'s")
        if not case.is_fp8 and case.query_dtype != case.kv_dtype and (
                CASTS_KV not in self._kernel_source(IMPL_FILES)):
            return (f"AITER {self._version()}'s unified_attention converts only fp8 K/V to "
                    f"the query dtype (every K/V from v0.1.12): a "
                    f"{case.kv_dtype} cache needs {case.kv_dtype} queries (tl.dot rejects "
                    f"{case.query_dtype} x {case.kv_dtype})")
        return None

    def precision(self, case: Case, device: torch.device) -> Precision:
        """K/V dequantised to (or converted into) the query dtype, P in it; fp8 queries: q,
        K, V and P in fp8, the output in the query dtype."""
        if case.q_scale:
            return Precision(case.kv_dtype, case.kv_dtype, case.output_dtype)
        return triton_precision(case, device)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """The 2-D kernel writes 0 on rows with no context; the 3-D kernel's reduction
        divides its segments' empty sums (undefined)."""
        units = COMPUTE_UNITS[self._answers(case).arch]
        return EmptyRowOutput.ZERO if kernel_path(case, units) == "2D" else (
            EmptyRowOutput.UNDEFINED)

    def versions(self) -> dict[str, str]:
        """AITER's version and where it came from, Triton's, and what was answered on
        AITER's behalf without a GPU."""
        import triton

        versions = {"triton": triton.__version__,
                    "triton_interpret": str(devices.interpreted())}
        if self.source is None:
            return versions
        versions |= {"amd-aiter": self.source.version, "aiter_path": str(self.source.package),
                     "aiter_origin": self.source.origin,
                     "aiter_loading": "Triton ops modules executed from the tree under a "
                     "private name; aiter/__init__ and package re-exports skipped"}
        if devices.interpreted():
            versions["aiter_answered"] = (
                DeviceAnswers.for_arch(self.arch).describe() if self.arch else
                "per case: gfx942 for float8_e4m3fnuz, else gfx950 (Triton's active driver "
                "reports hip/<arch>, warp 64; get_num_sms() -> "
                f"{', '.join(f'{a}: {n}' for a, n in COMPUTE_UNITS.items())})")
        return versions

    def _version(self) -> str:
        return self.source.version if self.source else "unknown"

    def _answers(self, case: Case) -> DeviceAnswers:
        """What the CPU run tells AITER about the device for ``case``."""
        return DeviceAnswers.for_arch(self.arch or case_arch(case))

    def _kernel_source(self, files: tuple[str, ...] = KERNEL_FILES) -> str:
        """The text of the tree's ``unified_attention`` host file (or of ``files``)."""
        source = self._require_source()
        path = source.find(*files)
        return path.read_text() if path else ""

    def _require_source(self) -> AiterSource:
        if self.source is None:
            raise RuntimeError(self.source_error)
        return self.source

    def _module(self, file: tuple[str, ...], answers: DeviceAnswers | None) -> Any:
        """One of the tree's modules, loaded once per answers (``None`` on a GPU)."""
        key = f"{file[0]}@{answers.arch if answers else 'gpu'}"
        if key not in self._modules:
            source = self._require_source()
            path = source.find(*file)
            if path is None:
                raise RuntimeError(f"AITER {source.version} has no {' or '.join(file)}")
            module = source.load(path, answers)
            if answers is not None and file == KERNEL_FILES:
                record_launches(module, LAUNCHED)
            self._modules[key] = module
        return self._modules[key]

    def _fp8_type(self, case: Case, device: torch.device) -> torch.dtype:
        """AITER's ``e4m3_dtype`` for ``case`` here."""
        answers = self._answers(case) if device.type == "cpu" else None
        return self._module(TYPES_FILES, answers).e4m3_dtype

    def kernel(self, case: Case, device: torch.device) -> Callable[..., Any]:
        """The tree's ``unified_attention`` as loaded for ``case`` on ``device``."""
        answers = self._answers(case) if device.type == "cpu" else None
        return self._module(KERNEL_FILES, answers).unified_attention

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``unified_attention`` call over all query rows."""
        case = inputs.case
        device = inputs.device
        answers = self._answers(case) if device.type == "cpu" else None
        unified_attention = self.kernel(case, device)
        arguments = unified_attention_arguments(inputs, inputs.cache(self.in_page_orders[0]))
        out = arguments["out"]
        if case.is_fp8:  # AITER's descales are 1-element tensors
            arguments["k_descale"] = arguments["k_descale"].reshape(1)
            arguments["v_descale"] = arguments["v_descale"].reshape(1)
        if self.shuffled:
            arguments["shuffled_kv_cache"] = True
        parameters = inspect.signature(unified_attention).parameters
        missing = sorted(set(arguments) - set(parameters))
        if missing:
            raise RuntimeError(f"AITER {self._version()}'s unified_attention takes no "
                               f"{', '.join(missing)}")
        inputs.export_call(ExportedCall(self._kernel_import(case), "unified_attention",
                                        arguments, output="out"))
        with answering(answers):
            result = unified_attention(**arguments)
        inputs.state(self._statement(unified_attention, arguments, case, device))
        # Releases whose single-segment 3-D path writes `out` in place return it too.
        return real_output(case, out if result is None else result)

    def _kernel_import(self, case: Case) -> KernelImport:
        """How a script outside difftest gets this ``unified_attention``: from the
        installed ``aiter``, or from a tree given to it (the recorded one is this source's),
        the same device answers on the CPU (stated whatever device recorded it)."""
        source = self._require_source()
        answers = self._answers(case)
        found = source.find(*KERNEL_FILES)
        files = sorted(KERNEL_FILES, key=lambda f: found is None or source.package / f != found)
        modules = [".".join(("aiter", *Path(f).with_suffix("").parts)) for f in files]
        return KernelImport("amd-aiter", load_aiter_kernel, {
            "modules": modules, "name": "unified_attention",
            "arch": answers.arch, "compute_units": answers.compute_units},
            str(source.package.parent))

    def _statement(self, kernel: Callable[..., Any], arguments: dict[str, Any], case: Case,
                   device: torch.device) -> KernelCall:
        """The statement of the ``unified_attention`` call made with ``arguments``."""
        table, ctx, views = arguments["block_table"], arguments["seqused_k"], arguments["v"]
        valid = torch.arange(table.shape[1], device=table.device)[None] < (
            (ctx[:, None] + case.page_size - 1) // case.page_size)
        units = COMPUTE_UNITS[self._answers(case).arch] if device.type == "cpu" else (
            torch.cuda.get_device_properties(device).multi_processor_count)
        order = self.in_page_orders[0]
        pages = f"{case.kv_dtype} {case.kv_layout} {order} {{}} pages"
        return kernel_call(kernel, arguments, labels={
            "k": pages.format(arguments["k"].shape[0]), "v": pages.format(views.shape[0]),
            "cu_seqlens_q": "one sequence per row" if arguments["max_seqlen_q"] == 1
            else "requests as causal sequences",
            "seqused_k": length_classes(ctx.tolist()),
            "max_seqlen_k": f"{arguments['max_seqlen_k']} ({kernel_path(case, units)} kernel)",
            "block_table": id_classes(table, views.shape[0] - 1, valid),
            "q_descale": scale_class(case.q_scale or None),
            "k_descale": scale_class(case.k_scale if case.is_fp8 else None),
            "v_descale": scale_class(case.v_scale if case.is_fp8 else None),
        }, fixed=FIXED, sizes={"head_dim": (case.head_dim, "q.shape[2]"),
                               "page_size": (case.page_size, "the views' page dimension"),
                               "num_kv_heads": (case.num_kv_heads, "the views' head dimension")})


def default_backends() -> list[AiterUnified]:
    """The registered names: ``aiter-unified`` and ``aiter-unified@shuffled``."""
    return [AiterUnified(), AiterUnified(shuffled=True)]
