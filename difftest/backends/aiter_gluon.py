"""``aiter-gluon`` and ``aiter-gluon@emulated``: the project's adapter from a case to AITER's
``pa_decode_gluon``, with vLLM 0.33's K-trim.

The adapter makes the call vLLM's ``_run_gluon_decode`` makes, on the framework's own page-16
table: the shuffled page-16 K/V views (LBHNC: K ``[16B, 1, D/x, 16, x]``, V the same bytes 8
pages in, so 8 pages shorter; LHBNC: two planes of equal length), ``query_length=1`` with
every query row its own sequence, compute type fp8 for fp8 KV (the bf16/fp16 query is cast to
fp8 without a scale) and the query dtype otherwise, 0-d fp32 KV scales, partition buffers in
the output dtype, and the K-trim:

* whether the sides are packed (``V.shape[0] != K.shape[0]``) and the block page stride
  (16 packed, 8 for dense planes) are read from the *untrimmed* views;
* a packed V view longer than K is refused (``RuntimeError`` naming both page counts);
* K is trimmed to V's page count only when the sides are packed, and the scale arguments are
  sized from the trimmed count.

``aiter-gluon`` calls the real kernel (ROCm GPU with AITER only); ``aiter-gluon@emulated``
calls :mod:`difftest.backends.pa_decode_gluon_emulator` on any machine, emulating gfx942 for
e4m3fnuz KV and gfx950 otherwise; ``aiter-gluon@compiled``
(:mod:`difftest.backends.aiter_gluon_compiled`) calls an AITER tree's own launcher with its
kernels compiled instead of run. Options, given in the name as ``base[key=value,...]``
(see :class:`difftest.contract.registry.OptionSpec`; docs/rocm.md):

* ``k_trim``: ``on`` (default); ``off`` (K passed untrimmed); ``before-stride`` (the pitfall:
  K trimmed before the packing test, so the stride silently becomes 8 and wrong pages are
  read);
* ``scales``: ``tensor`` (default, 0-d as vLLM's layers) or ``token`` (``[pages, 1, 16, 1]``
  per-token scales, each side sized from the page count of the view it is passed with);
* ``splits``: ``auto`` (default, ``get_recommended_splits``) or 1..8 (1 is AITER's one-shot
  path, which leaves rows with no context untouched);
* ``revision`` (emulated only): a contract revision of the emulator (default the newest).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from difftest.backends.pa_decode_gluon_emulator import (
    DEFAULT_NUM_CUS,
    DEFAULT_REVISION,
    REVISIONS,
    GluonEmulator,
    make_emulator,
)
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.contract.kernel_call import (
    KernelCall,
    id_classes,
    kernel_call,
    length_classes,
    scale_class,
)
from difftest.contract.registry import OptionSpec
from difftest.machine import gpus
from difftest.machine.fingerprint import aiter_commit
from difftest.primitives.dtypes import torch_dtype

GLUON_MODULE = "aiter.ops.triton.gluon.pa_decode_gluon"
PAGES_PER_SIDE = 8
CONTEXT_PARTITION_SIZE = 256
K_TRIM_MODES = ("on", "off", "before-stride")
SPLITS = ("auto", *(str(s) for s in range(1, 9)))
EMULATED_ARCH = "gfx942 for float8_e4m3fnuz KV, gfx950 otherwise"


@lru_cache(maxsize=1)
def aiter_availability() -> Availability:
    """Real AITER: a ROCm build of torch, a visible AMD GPU and an importable
    ``aiter.ops.triton.gluon.pa_decode_gluon``. No GPU runtime is initialised, and AITER is
    imported only where the ROCm requirements hold; the reason names everything missing."""
    missing = []
    if getattr(torch.version, "hip", None) is None:
        missing.append(f"a ROCm build of torch (torch {torch.__version__} has no "
                       "torch.version.hip)")
    if gpus.gpu_vendor() != "amd" or gpus.visible_gpu_count() == 0:
        missing.append("a visible AMD GPU (no GPU node under /sys/class/kfd, or a visibility "
                       "mask hides every GPU)")
    aiter = importlib.util.find_spec("aiter")
    gluon_file = Path(*GLUON_MODULE.split(".")[1:]).with_suffix(".py")
    if aiter is None:
        missing.append("AITER (no module 'aiter'; ROCm vLLM images preinstall it, and "
                       "`pip install aiter` is an unrelated PyPI package: see docs/rocm.md)")
    elif not any((Path(d) / gluon_file).is_file() for d in aiter.submodule_search_locations or ()):
        missing.append(f"an AITER with gluon (the 'aiter' at "
                       f"{', '.join(aiter.submodule_search_locations or ['?'])} has no "
                       f"{gluon_file})")
    elif not missing:
        try:
            importlib.import_module(GLUON_MODULE)
        except Exception as exc:  # any import failure means the kernel cannot run
            missing.append(f"an importable {GLUON_MODULE} ({type(exc).__name__}: {exc})")
    if missing:
        return Availability(False, "real AITER pa_decode_gluon needs " + "; ".join(missing))
    return Availability(True)


def aiter_versions() -> dict[str, str]:
    """AITER's distribution version and, where the install has one, its git commit."""
    versions = {"aiter": "unknown"}
    for dist in ("amd-aiter", "aiter"):
        try:
            versions["aiter"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    commit = aiter_commit()
    if commit:
        versions["aiter_commit"] = commit
    return versions


def emulated_arch(case: Case) -> str:
    """The AMD arch whose fp8 flavour is the case's: gfx942 for e4m3fnuz, gfx950 otherwise."""
    return "gfx942" if case.kv_dtype == "float8_e4m3fnuz" else "gfx950"


def gluon_unsupported(case: Case, device: torch.device, emulated: bool) -> str | None:
    """What ``pa_decode_gluon`` refuses; the real kernel also needs its GPU's fp8 flavour."""
    geometry = case.outside_model_geometry()
    if geometry:
        return (f"{geometry}: the MiniMax-M3 pa_decode_gluon callers (the adapter's K-trim "
                "and page-16 table, vLLM's builder, the emulator) address MiniMax-M3's "
                "geometry only (head_dim 128, 128-token blocks of 16-token pages, one KV "
                "head, an LBHNC or LHBNC cache)")
    if case.kernel_modes:
        return (f"{' and '.join(case.kernel_modes)}: the MiniMax-M3 sparse decode has no such "
                "mode, so neither pa_decode_gluon caller passes one")
    if case.query_dtype == "float32":
        return ("AITER pa_decode_gluon asserts a query dtype in [fp8, bfloat16, float16]; "
                "float32 queries are not supported")
    if emulated:
        return None
    from aiter import dtypes

    native_fp8 = dtypes.fp8
    if device.type != "cuda":
        return f"real AITER runs on ROCm GPUs only; this run's device is {device.type}"
    if case.is_fp8 and torch_dtype(case.kv_dtype) != native_fp8:
        return (f"{case.kv_dtype} is not this GPU's fp8 (aiter.dtypes.fp8 = {native_fp8}); "
                "AITER asserts the arch-native flavour (gfx942: e4m3fnuz, gfx950: e4m3fn)")
    return None


def gluon_precision(case: Case) -> Precision:
    """fp8 KV: compute fp8 (q cast to fp8 without a scale, P rounded to fp8), bf16 output;
    bf16/fp16 KV: the query dtype throughout."""
    if case.is_fp8:
        return Precision(case.kv_dtype, case.kv_dtype, "bfloat16")
    return Precision(case.query_dtype, case.query_dtype, case.query_dtype)


def gluon_empty_rows(splits: int, emulated: bool) -> EmptyRowOutput:
    """Rows with context 0: one-shot (splits <= 1) returns early, leaving them untouched; with
    partitions the emulator's C++-style reduce writes 0, while real AITER's result depends on
    the reducer present (C++/FlyDSL: 0, Triton fallback: NaN)."""
    if splits <= 1:
        return EmptyRowOutput.UNTOUCHED
    return EmptyRowOutput.ZERO if emulated else EmptyRowOutput.UNDEFINED


@dataclass(frozen=True)
class GluonViews:
    """The K/V views handed to ``pa_decode_gluon`` and the stride the page ids use."""

    key: torch.Tensor
    value: torch.Tensor
    sides_packed: bool
    block_page_stride: int


def prepare_views(key: torch.Tensor, value: torch.Tensor, k_trim: str) -> GluonViews:
    """Apply the ``k_trim`` mode to the untrimmed page-16 views (see the module docstring)."""
    trim = k_trim in ("on", "before-stride")
    if trim and value.shape[0] > key.shape[0]:
        raise RuntimeError("MiniMax-M3 AITER sparse PA packed V view is longer than K "
                           f"({value.shape[0]} > {key.shape[0]} pages)")
    if k_trim == "before-stride":
        key = key[: value.shape[0]]  # the pitfall: the packing test now sees equal shapes
    sides_packed = value.shape[0] != key.shape[0]
    stride = PAGES_PER_SIDE * (2 if sides_packed else 1)
    if trim and sides_packed:
        key = key[: value.shape[0]]
    return GluonViews(key, value, sides_packed, stride)


def renumber_pages(table: torch.Tensor, from_stride: int, to_stride: int) -> torch.Tensor:
    """Page ids ``block * from_stride + j`` (j < 8) rewritten as ``block * to_stride + j``."""
    if from_stride == to_stride:
        return table
    return table // from_stride * to_stride + table % from_stride


def gluon_arguments(
    inputs: RunInputs,
    k_trim: str,
    scales: str,
    splits: int | None,
    fp8: torch.dtype,
    recommended_splits: Callable[[int, int], int],
) -> dict[str, Any]:
    """The keyword arguments of one ``pa_decode_gluon`` call for ``inputs`` (output included).

    ``fp8`` is ``aiter.dtypes.fp8`` of the (real or emulated) build; ``splits`` None asks
    ``recommended_splits(num_seqs, num_kv_heads)``.
    """
    case = inputs.case
    cache = inputs.cache("shuffled")
    kv = prepare_views(cache.k, cache.v, k_trim)
    table, ctx = inputs.sparse_table
    table = renumber_pages(table, case.block_page_stride, kv.block_page_stride)
    group = case.num_q_heads // case.num_kv_heads
    seqs = case.total_q * case.num_kv_heads
    compute = fp8 if case.is_fp8 else torch_dtype(case.query_dtype)
    output = inputs.output(torch.bfloat16 if case.is_fp8 else compute)
    partitions = splits if splits is not None else recommended_splits(seqs, 1)
    scratch = (seqs, 1, partitions, group)
    key_scale = value_scale = None
    if case.is_fp8:
        key_scale, value_scale = inputs.scales()
        if scales == "token":
            page_token = (case.num_kv_heads, case.page_size, 1)
            key_scale = key_scale.expand(kv.key.shape[0], *page_token).contiguous()
            value_scale = value_scale.expand(kv.value.shape[0], *page_token).contiguous()
    return dict(
        output=output,
        query=inputs.data.query,
        key_cache=kv.key,
        value_cache=kv.value,
        context_lengths=ctx,
        block_tables=table,
        softmax_scale=case.softmax_scale,
        query_length=1,
        max_context_partition_num=partitions,
        context_partition_size=CONTEXT_PARTITION_SIZE,
        compute_type=compute,
        query_scale=None,
        key_scale=key_scale,
        value_scale=value_scale,
        exp_sums=torch.empty(scratch, dtype=torch.float32, device=inputs.device),
        max_logits=torch.empty(scratch, dtype=torch.float32, device=inputs.device),
        temporary_output=torch.empty((*scratch, case.head_dim), dtype=output.dtype,
                                     device=inputs.device),
        alibi_slopes=None,
        sinks=None,
        sliding_window=0,
        ps=True,
    )


REAL_OPTIONS = OptionSpec("aiter-gluon", {"k_trim": K_TRIM_MODES, "scales": ("tensor", "token"),
                                          "splits": SPLITS})
EMULATED_OPTIONS = OptionSpec("aiter-gluon@emulated", {
    **REAL_OPTIONS.choices,
    "revision": (DEFAULT_REVISION, *(r for r in REVISIONS if r != DEFAULT_REVISION)),
})


class GluonCaller:
    """What every caller of ``pa_decode_gluon`` shares: the real kernel or, ``emulated``, the
    emulator; the options in its name; the capabilities and precision AITER's kernel has."""

    in_page_orders = ("shuffled",)
    real_options: OptionSpec
    emulated_options: OptionSpec

    def __init__(self, emulated: bool = False, options: Mapping[str, str] | None = None) -> None:
        self.emulated = emulated
        spec = self.emulated_options if emulated else self.real_options
        self.options = spec.parse(options or {})
        self.name = spec.name(self.options)

    def with_options(self, options: Mapping[str, str]) -> GluonCaller:
        """The same backend configured by ``options`` (relative to the defaults)."""
        return type(self)(self.emulated, options)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """fp32 queries; on real AITER also a CPU device or a non-native fp8 flavour."""
        return gluon_unsupported(case, device, self.emulated)

    def precision(self, case: Case, device: torch.device) -> Precision:
        """See :func:`gluon_precision` (the output buffer is bf16 for fp8, else the query's)."""
        return gluon_precision(case)

    def _emulator(self, case: Case) -> GluonEmulator:
        return make_emulator(self.options["revision"], emulated_arch(case))

    def _recommended_splits(self, case: Case) -> Callable[[int, int], int]:
        if self.emulated:
            return self._emulator(case).get_recommended_splits
        from aiter.ops.triton.gluon.pa_decode_gluon import get_recommended_splits

        return get_recommended_splits

    def _kernel_versions(self) -> dict[str, str]:
        """What ran: AITER's version and commit, or the emulator's revision."""
        if not self.emulated:
            return {"kernel": "AITER pa_decode_gluon", **aiter_versions()}
        revision = REVISIONS[self.options["revision"]]
        return {"kernel": "pa_decode_gluon contract emulator (pure torch), not AITER",
                "emulator_revision": revision.name, "emulated_aiter": revision.aiter_versions,
                "emulated_arch": EMULATED_ARCH}


class AiterGluon(GluonCaller):
    """The adapter to the real ``pa_decode_gluon`` or, ``emulated``, to the emulator."""

    real_options = REAL_OPTIONS
    emulated_options = EMULATED_OPTIONS

    @property
    def _splits(self) -> int | None:
        value = self.options["splits"]
        return None if value == "auto" else int(value)

    def availability(self) -> Availability:
        """Emulated: always. Real: see :func:`aiter_availability`."""
        return Availability(True) if self.emulated else aiter_availability()

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """From the partition count this adapter passes (see :func:`gluon_empty_rows`)."""
        splits = self._splits
        if splits is None:
            seqs = case.total_q * case.num_kv_heads
            splits = self._recommended_splits(case)(seqs, 1)
        return gluon_empty_rows(splits, self.emulated)

    def versions(self) -> dict[str, str]:
        """The exact configuration, and what ran: AITER's version and commit, or the
        emulator's revision."""
        import triton

        versions = {"k_trim": self.options["k_trim"], "scales": self.options["scales"],
                    "splits": self.options["splits"], "torch": torch.__version__,
                    "triton": triton.__version__}
        emulated = {"emulated_cus": str(DEFAULT_NUM_CUS)} if self.emulated else {}
        return {**self._kernel_versions(), **emulated, **versions}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``pa_decode_gluon`` call over every query row."""
        case = inputs.case
        if self.emulated:
            emulator = self._emulator(case)
            kernel, fp8 = emulator.pa_decode_gluon, emulator.fp8
        else:
            from aiter import dtypes
            from aiter.ops.triton.gluon.pa_decode_gluon import pa_decode_gluon

            kernel, fp8 = pa_decode_gluon, dtypes.fp8
        args = gluon_arguments(inputs, self.options["k_trim"], self.options["scales"],
                               self._splits, fp8, self._recommended_splits(case))
        kernel(**args)
        inputs.state(gluon_statement(kernel, args, case, self.options["splits"]))
        return args["output"]


GLUON_FIXED = {
    "query_length": "vLLM's MiniMax-M3 AITER path passes each query token as its own sequence "
                    "(sparse_pa.py: query_length=1)",
    "max_context_partition_num": "the splits option picks it (auto: AITER's recommendation); "
                                 "other values are backend options, e.g. [splits=1]",
    "context_partition_size": "256, the only size AITER tests and vLLM passes",
    "query_scale": "MiniMax-M3 keeps queries in bf16/fp16 (sparse_pa.py: query_scale=None)",
    "exp_sums": "fp32 scratch the adapter allocates, shaped by the call",
    "max_logits": "fp32 scratch the adapter allocates, shaped by the call",
    "temporary_output": "output-dtype scratch the adapter allocates",
    "alibi_slopes": "AITER accepts and ignores it (never forwarded)",
    "sinks": "MiniMax-M3 passes no sinks (sparse_pa.py: sinks=None)",
    "sliding_window": "MiniMax-M3 has no window; both pa_decode_gluon callers refuse such cases",
    "ps": "vLLM's MiniMax-M3 path passes ps=True (forced by AITER when one partition)",
    "head_dim": "MiniMax-M3's: other geometry is refused (gluon_unsupported)",
    "page_size": "vLLM's MiniMax-M3 sparse PA passes 16-token pages only; other geometry is "
                 "refused (gluon_unsupported)",
    "num_kv_heads": "MiniMax-M3's one KV head: other geometry is refused (gluon_unsupported)",
}


def gluon_statement(kernel: Callable[..., Any], args: Mapping[str, Any], case: Case,
                    splits: str) -> KernelCall:
    """The statement of the ``pa_decode_gluon`` call made with ``args``."""
    table, ctx, value = args["block_tables"], args["context_lengths"], args["value_cache"]
    valid = torch.arange(table.shape[1], device=table.device)[None] < (
        (ctx[:, None] + case.page_size - 1) // case.page_size)
    pages = f"{case.kv_dtype} {case.kv_layout} {{}} pages"
    return kernel_call(kernel, args, labels={
        "key_cache": pages.format(args["key_cache"].shape[0]),
        "value_cache": pages.format(value.shape[0]),
        "context_lengths": length_classes(ctx.tolist()),
        "block_tables": id_classes(table, value.shape[0] - 1, valid),
        "max_context_partition_num": f"{args['max_context_partition_num']} ({splits})",
        "key_scale": scale_class(case.k_scale if case.is_fp8 else None),
        "value_scale": scale_class(case.v_scale if case.is_fp8 else None),
    }, fixed=GLUON_FIXED, sizes={
        "head_dim": (case.head_dim, "query.shape[2], value_cache.shape[3]"),
        "page_size": (case.page_size, "key_cache.shape[3]"),
        "num_kv_heads": (case.num_kv_heads, "key_cache.shape[1]")})


def default_backends() -> list[AiterGluon]:
    """The registered names: ``aiter-gluon`` and ``aiter-gluon@emulated`` (default options)."""
    return [AiterGluon(), AiterGluon(emulated=True)]
