"""``aiter-gluon@compiled`` and ``vllm-aiter@compiled``: AITER's own ``pa_decode_gluon``
launcher from an AITER tree, its kernels compiled for a gfx arch instead of run.

:class:`CompiledGluon` is one tree's ``aiter/ops/triton/gluon/pa_decode_gluon.py`` for one arch,
loaded without ROCm (:mod:`difftest.backends.aiter_triton`: AITER's device questions answered
for the arch) and called as AITER ships it: every assertion and shape/dtype check, the split
recommendation, the dispatch, the grid and the strides. Each kernel it launches compiles for
the arch instead of running (:mod:`difftest.backends.aiter_compile`). A call's result is

* the launcher's exception when it raises (an error compared like any other);
* otherwise the launches it made, checked against those the contract emulator decodes from
  the same call (:meth:`~difftest.backends.pa_decode_gluon_contract.GluonEmulator.decode_call`:
  the kernel, the grid and every argument the emulator states): a difference raises
  :class:`LaunchMismatch`, a disagreement of the emulator with AITER; so does a different
  split recommendation;
* then the emulator's numerics on that launch write the output, which the run compares with
  ``torch-ref`` like every backend's. Numerics of the gluon kernels themselves need a ROCm GPU.

Each compiled kernel's fingerprint for the arch (:class:`~difftest.contract.kernel_call.DeviceCode`)
is stated with the ``pa_decode_gluon`` call.

The launcher's partition reduce is AITER's C++ ``launch_pa_decode_ps_reduce`` where the install
has it: a ROCm install of AITER does (its ``aiter_meta/csrc`` is on ``sys.path`` once AITER is
imported), and ``install=full`` (the default) stands it in: its call is recorded and checked,
with the C++ launcher's own refusals (1..64 partitions, fp32/fp16/bf16 tensors, as
``ImportError`` so the launcher falls back), not compiled (``hipcc``). ``install=triton-only``
is ``AITER_TRITON_ONLY=1`` (or Windows) without FlyDSL: no C++ reduce, and the launcher's own
fallback runs (finding F32 on v0.1.19.post1 to v0.1.20.post1).

Options: ``aiter=<tag, version or directory>`` (which tree, :func:`~.aiter_triton.chosen_source`),
``arch=gfx942|gfx950`` (default per case: the arch whose AITER fp8 type is the case's, gfx950
for 16-bit caches), ``install=full|triton-only``, and for ``aiter-gluon@compiled`` the adapter's
``k_trim``, ``scales``, ``splits`` (:mod:`difftest.backends.aiter_gluon`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import torch

from difftest.backends.aiter_compile import (
    LaunchRecorder,
    RecordedLaunch,
    compiling,
    device_code,
)
from difftest.backends.aiter_gluon import (
    EMULATED_OPTIONS,
    GLUON_MODULE,
    emulated_arch,
    gluon_arguments,
    gluon_precision,
    gluon_statement,
    gluon_unsupported,
)
from difftest.backends.aiter_triton import (
    COMPUTE_UNITS,
    AiterSource,
    DeviceAnswers,
    answering,
    chosen_source,
)
from difftest.backends.pa_decode_gluon_contract import (
    CXX_PS_REDUCE,
    GluonEmulator,
    KernelLaunch,
    Operand,
    make_emulator,
)
from difftest.backends.pa_decode_gluon_fake_aiter import installed_modules
from difftest.backends.pa_decode_gluon_numerics import emulate
from difftest.backends.vllm_aiter import IRREGULAR, VllmAiter
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, Precision, RunInputs
from difftest.contract.kernel_call import DeviceCode, KernelCall
from difftest.contract.registry import OptionSpec
from difftest.primitives.dtypes import torch_dtype

GLUON_FILE = "ops/triton/gluon/pa_decode_gluon.py"
INSTALLS = ("full", "triton-only")
EMULATOR_REVISION = "v0.1.20"  # the public contract (no equal-block assertion)
TRITON_ONLY_KEY = "amd-aiter-triton-only"  # the versions key of a Triton-only install
CXX_REDUCE_PARAMETERS = (
    "output_ptr", "exp_sums_ptr", "max_logits_ptr", "logits_ptr", "sink_token_ptr",
    "stride_output_bs", "stride_output_len", "stride_output_kv_head", "stride_output_group_size",
    "stride_exp_sums_seq", "stride_exp_sums_head", "stride_exp_sums_part", "stride_logits_seq",
    "stride_logits_head", "stride_logits_part", "stride_logits_group", "query_seq_len",
    "query_group_size", "head_size", "context_partition_num",
)
_REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LaunchMismatch(RuntimeError):
    """The contract emulator decodes another launch (or split count) from a call than AITER's
    launcher made: a finding about the emulator."""


@dataclass
class CompiledCall:
    """One ``pa_decode_gluon`` call: its arguments by name and the launches it made."""

    arguments: dict[str, Any]
    launches: list[RecordedLaunch]

    def device_code(self) -> list[DeviceCode]:
        """The fingerprints of the kernels it compiled, in launch order."""
        return [_fingerprint(launch.compiled) for launch in self.launches if launch.compiled]


_FINGERPRINTS: dict[str, DeviceCode] = {}  # Triton's cache key -> the kernel's fingerprint


def _fingerprint(compiled: Any) -> DeviceCode:
    if compiled.hash not in _FINGERPRINTS:
        _FINGERPRINTS[compiled.hash] = device_code(compiled)
    return _FINGERPRINTS[compiled.hash]


def _normalised(value: Any) -> Any:
    """A recorded argument as :class:`KernelLaunch` states it (Triton dtypes by name)."""
    from triton.language import dtype as triton_dtype

    return value.name if isinstance(value, triton_dtype) else value


def _operands(tensor: torch.Tensor, call: Mapping[str, Any]) -> list[Operand]:
    """What a tensor passed to a kernel is: the call's arguments it is a view of (same data
    pointer and dtype), else scratch the launcher allocated."""
    names = [name for name, value in call.items() if isinstance(value, torch.Tensor)
             and value.data_ptr() == tensor.data_ptr() and value.dtype == tensor.dtype]
    return [Operand(name, tensor.dtype) for name in names or ["allocated"]]


def launch_differences(expected: list[KernelLaunch], made: list[RecordedLaunch],
                       call: Mapping[str, Any]) -> list[str]:
    """Where the launches AITER's launcher ``made`` for ``call`` differ from the
    ``expected`` ones (the emulator's): one line per difference, none when they agree."""
    names = [launch.kernel for launch in made]
    if names != [launch.kernel for launch in expected]:
        return [f"AITER launched {', '.join(names) or 'nothing'}; the emulator expects "
                f"{', '.join(k.kernel for k in expected) or 'nothing'}"]
    out = []
    for want, got in zip(expected, made, strict=True):
        if want.grid != got.grid:
            out.append(f"{got.kernel}: grid {got.grid}, the emulator's {want.grid}")
        for name, value in want.arguments.items():
            if name not in got.arguments:
                out.append(f"{got.kernel} has no parameter {name} (the emulator states "
                           f"{value!r})")
                continue
            actual = got.arguments[name]
            if isinstance(actual, torch.Tensor):
                candidates = _operands(actual, call)
                if value not in candidates:
                    out.append(f"{got.kernel}: {name} is "
                               f"{' or '.join(f'{c.name} ({c.dtype})' for c in candidates)}, "
                               f"the emulator's {value!r}")
            elif _normalised(actual) != value or isinstance(value, Operand):
                out.append(f"{got.kernel}: {name} = {_normalised(actual)!r}, the emulator's "
                           f"{value!r}")
    return out


class CompiledGluon:
    """One tree's ``pa_decode_gluon`` launcher for one arch and install (see the module
    docstring); :meth:`pa_decode_gluon` and :meth:`get_recommended_splits` have AITER's
    interface, and :attr:`calls` collects the calls made since it was last cleared."""

    def __init__(self, source: AiterSource, arch: str, install: str) -> None:
        self.source, self.install = source, install
        self.answers = DeviceAnswers.for_arch(arch)
        self.emulator: GluonEmulator = make_emulator(EMULATOR_REVISION, arch,
                                                     self.answers.compute_units)
        self.calls: list[CompiledCall] = []

    @cached_property
    def module(self) -> Any:
        """The tree's launcher module, loaded for compiling."""
        path = self.source.find(GLUON_FILE)
        if path is None:
            raise RuntimeError(f"AITER {self.source.version} at {self.source.package} has no "
                               f"{GLUON_FILE}")
        return self.source.load(path, self.answers, compiled=True)

    @property
    def launcher(self) -> Callable[..., None]:
        """AITER's ``pa_decode_gluon`` function itself."""
        return self.module.pa_decode_gluon

    @property
    def fp8(self) -> torch.dtype:
        """``aiter.dtypes.fp8`` of the tree on the arch."""
        return self.module.aiter.dtypes.fp8

    def get_recommended_splits(self, num_sequences: int, num_kv_heads: int,
                               split_kv_blocks: int = 1) -> int:
        """AITER's recommendation on the arch's compute units; :class:`LaunchMismatch` where
        the emulator's differs."""
        with answering(self.answers):
            splits = self.module.get_recommended_splits(num_sequences, num_kv_heads,
                                                        split_kv_blocks)
        emulated = self.emulator.get_recommended_splits(num_sequences, num_kv_heads,
                                                        split_kv_blocks)
        if splits != emulated:
            raise LaunchMismatch(
                f"get_recommended_splits({num_sequences}, {num_kv_heads}, {split_kv_blocks}) "
                f"on {self.answers.compute_units} CUs: AITER {splits}, the emulator {emulated}")
        return splits

    def pa_decode_gluon(self, *args: Any, **kwargs: Any) -> None:
        """AITER's launcher on the call, its launches checked against the emulator's, then
        the emulator's numerics into ``output`` (see the module docstring)."""
        bound = inspect.signature(self.launcher).bind(*args, **kwargs)
        bound.apply_defaults()
        with compiling(self.answers) as recorder, self._reducers(recorder):
            self.launcher(*bound.args, **bound.kwargs)
        call = dict(bound.arguments)
        self.calls.append(CompiledCall(call, recorder.launches))
        try:
            decoded = self.emulator.decode_call(
                **call, reduce="cxx" if self.install == "full" else "triton")
        except (AssertionError, RuntimeError, KeyError) as exc:
            raise LaunchMismatch(f"AITER's launcher accepted the call; the contract emulator "
                                 f"refuses it: {type(exc).__name__}: {exc}") from exc
        differences = launch_differences(decoded.kernels, recorder.launches, call)
        if differences:
            raise LaunchMismatch("the contract emulator disagrees with AITER's launch: "
                                 + "; ".join(differences))
        emulate(decoded.launch, float(call["softmax_scale"]), decoded.scratch)

    @contextlib.contextmanager
    def _reducers(self, recorder: LaunchRecorder) -> Iterator[None]:
        """The module's C++ PS reduce as the install has it, for the duration of a call
        (trees before v0.1.14 have none)."""
        module = self.module
        if not hasattr(module, "CXX_PS_REDUCE_AVAILABLE"):
            yield
            return
        saved = module.CXX_PS_REDUCE_AVAILABLE, module.launch_pa_decode_ps_reduce_cxx
        if self.install == "full":
            module.CXX_PS_REDUCE_AVAILABLE = True
            module.launch_pa_decode_ps_reduce_cxx = _cxx_ps_reduce(recorder)
        else:  # what the tree sets where csrc does not import
            module.CXX_PS_REDUCE_AVAILABLE, module.launch_pa_decode_ps_reduce_cxx = False, None
        try:
            yield
        finally:
            module.CXX_PS_REDUCE_AVAILABLE, module.launch_pa_decode_ps_reduce_cxx = saved


def _cxx_ps_reduce(recorder: LaunchRecorder) -> Callable[..., None]:
    """A stand-in for AITER's C++ ``launch_pa_decode_ps_reduce``: its refusals (raised as
    ``ImportError``, which sends the launcher to its next reduce), then the call recorded."""

    def launch_pa_decode_ps_reduce(*args: Any, **kwargs: Any) -> None:
        arguments = dict(zip(CXX_REDUCE_PARAMETERS, args, strict=False)) | kwargs
        if set(arguments) != set(CXX_REDUCE_PARAMETERS):
            raise TypeError(f"{CXX_PS_REDUCE}: arguments {sorted(arguments)}, expected "
                            f"{', '.join(CXX_REDUCE_PARAMETERS)}")
        if not 1 <= arguments["context_partition_num"] <= 64:
            raise ImportError("C++ PS reduce: optimized kernel supports 1..64 partition slots")
        for name in ("output_ptr", "logits_ptr", "sink_token_ptr"):
            tensor = arguments[name]
            if tensor is not None and tensor.dtype not in _REDUCE_DTYPES:
                raise ImportError(f"C++ PS reduce: unsupported {name} dtype {tensor.dtype!r}")
        recorder.record(RecordedLaunch(CXX_PS_REDUCE, (), arguments))

    return launch_pa_decode_ps_reduce


@cache
def compiled_gluon(source: AiterSource, arch: str, install: str) -> CompiledGluon:
    """The :class:`CompiledGluon` of a tree, arch and install (one per process)."""
    return CompiledGluon(source, arch, install)


def compile_availability(source: AiterSource | None, reason: str) -> Availability:
    """An AITER tree with ``pa_decode_gluon``, and a Triton with Gluon and the AMD backend."""
    if source is None:
        return Availability(False, reason)
    if source.find(GLUON_FILE) is None:
        return Availability(False, f"AITER {source.version} at {source.package} has no "
                            f"{GLUON_FILE} (tags from v0.1.8; scripts/fetch_aiter.sh "
                            "v0.1.20.post1, then aiter=v0.1.20.post1)")
    for module, what in (("triton.experimental.gluon", "Gluon"),
                         ("triton.backends.amd", "the AMD backend")):
        if importlib.util.find_spec(module) is None:
            return Availability(False, f"this Triton has no {what} ({module}) to compile "
                                "AITER's gluon kernels with")
    return Availability(True)


def fp8_refusal(case: Case, arch: str, fp8: torch.dtype) -> str | None:
    """An fp8 case that is not the arch's AITER fp8 type (the launcher asserts it)."""
    if case.is_fp8 and torch_dtype(case.kv_dtype) != fp8:
        return (f"{case.kv_dtype} is not {arch}'s fp8 (AITER's dtypes.fp8 there is {fp8}); "
                "pa_decode_gluon asserts the arch-native flavour (gfx942: e4m3fnuz, gfx950: "
                "e4m3fn)")
    return None


class CompiledOptions:
    """The ``aiter=``, ``arch=`` and ``install=`` options of a compiled backend, and its
    tree, arch and launcher per case."""

    def __init__(self, base: str, options: dict[str, str]) -> None:
        self.aiter = options.pop("aiter", "")
        self.arch = options.pop("arch", "")
        if self.arch and self.arch not in COMPUTE_UNITS:
            raise ValueError(f"{base}: arch={self.arch!r} is not one of "
                             f"{', '.join(COMPUTE_UNITS)}")
        self.source, self.source_error = chosen_source(self.aiter or None)

    def named(self) -> dict[str, str]:
        """The options given, for the backend's name."""
        return {k: v for k, v in (("aiter", self.aiter), ("arch", self.arch)) if v}

    def arch_of(self, case: Case) -> str:
        """The arch a case compiles for."""
        return self.arch or emulated_arch(case)

    def gluon(self, case: Case, install: str) -> CompiledGluon:
        """The launcher for ``case``."""
        if self.source is None:
            raise RuntimeError(self.source_error)
        return compiled_gluon(self.source, self.arch_of(case), install)

    def unsupported(self, case: Case, device: torch.device, install: str) -> str | None:
        """What the MiniMax-M3 callers refuse, and fp8 that is not the arch's."""
        reason = gluon_unsupported(case, device, emulated=True)
        if reason or not case.is_fp8 or self.source is None:
            return reason
        gluon = self.gluon(case, install)
        return fp8_refusal(case, self.arch_of(case), gluon.fp8)

    def versions(self, install: str) -> dict[str, str]:
        """What ran: the tree, the arch, the install, the compiler."""
        import triton

        versions = {"kernel": f"AITER {GLUON_MODULE}.pa_decode_gluon (the tree's launcher); "
                    "its kernels compiled for the arch, not run; numerics: the contract "
                    f"emulator {EMULATOR_REVISION}",
                    "torch": torch.__version__, "triton": triton.__version__,
                    "aiter_arch": self.arch or "per case: gfx942 for float8_e4m3fnuz, else "
                    "gfx950", "aiter_install": install}
        if self.source is not None:
            versions |= {"amd-aiter": self.source.version,
                         "aiter_path": str(self.source.package),
                         "aiter_origin": self.source.origin}
            if install == "triton-only":
                versions[TRITON_ONLY_KEY] = self.source.version
        return versions


def _name(spec: OptionSpec, values: Mapping[str, str], extra: Mapping[str, str]) -> str:
    """``spec``'s name with the free-form options ``extra`` among the changed ones."""
    changed = {k: v for k, v in values.items() if v != spec.choices[k][0]} | dict(extra)
    inner = ",".join(f"{k}={changed[k]}" for k in sorted(changed))
    return f"{spec.base}[{inner}]" if inner else spec.base


COMPILED_OPTIONS = OptionSpec("aiter-gluon@compiled", {
    key: EMULATED_OPTIONS.choices[key] for key in ("k_trim", "scales", "splits")
} | {"install": INSTALLS})


def _empty_rows(splits: int, install: str) -> EmptyRowOutput:
    """One-shot leaves empty rows untouched; the C++ reduce writes 0; the Triton fallback
    reduce's result there is undefined (NaN)."""
    if splits <= 1:
        return EmptyRowOutput.UNTOUCHED
    return EmptyRowOutput.ZERO if install == "full" else EmptyRowOutput.UNDEFINED


class AiterGluonCompiled:
    """The adapter (:func:`~difftest.backends.aiter_gluon.gluon_arguments`: the K-trim and the
    page-16 table) calling a tree's real launcher, compiled for the arch."""

    in_page_orders = ("shuffled",)
    releases = ("aiter",)  # the release kinds it runs (aiter=, $DIFFTEST_AITER)

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        given = dict(options or {})
        self.compiled = CompiledOptions(COMPILED_OPTIONS.base, given)
        self.options = COMPILED_OPTIONS.parse(given)
        self.name = _name(COMPILED_OPTIONS, self.options, self.compiled.named())

    def with_options(self, options: Mapping[str, str]) -> AiterGluonCompiled:
        """``aiter=``, ``arch=``, ``install=``, ``k_trim=``, ``scales=``, ``splits=``."""
        return AiterGluonCompiled(options)

    def availability(self) -> Availability:
        """See :func:`compile_availability`."""
        return compile_availability(self.compiled.source, self.compiled.source_error)

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """The adapter's refusals, and fp8 that is not the arch's."""
        return self.compiled.unsupported(case, device, self.options["install"])

    def precision(self, case: Case, device: torch.device) -> Precision:
        """The emulator's numerics of AITER's kernel (see :func:`gluon_precision`)."""
        return gluon_precision(case)

    def _splits(self, case: Case) -> int:
        value = self.options["splits"]
        if value != "auto":
            return int(value)
        gluon = self.compiled.gluon(case, self.options["install"])
        return gluon.get_recommended_splits(case.total_q * case.num_kv_heads, 1)

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """From the partition count passed (see :func:`_empty_rows`)."""
        return _empty_rows(self._splits(case), self.options["install"])

    def versions(self) -> dict[str, str]:
        """The tree, the arch, the install, the adapter's options."""
        return {**self.compiled.versions(self.options["install"]),
                **{k: self.options[k] for k in ("k_trim", "scales", "splits")}}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """One ``pa_decode_gluon`` call over every query row (see the module docstring)."""
        case = inputs.case
        gluon = self.compiled.gluon(case, self.options["install"])
        splits = self.options["splits"]
        args = gluon_arguments(inputs, self.options["k_trim"], self.options["scales"],
                               None if splits == "auto" else int(splits), gluon.fp8,
                               gluon.get_recommended_splits)
        gluon.calls.clear()
        gluon.pa_decode_gluon(**args)
        inputs.state(stated_call(gluon, gluon.calls[-1], case, splits))
        return args["output"]


def stated_call(gluon: CompiledGluon, call: CompiledCall, case: Case, splits: str) -> KernelCall:
    """The statement of a ``pa_decode_gluon`` call, with the device code it compiled."""
    statement = gluon_statement(gluon.launcher, call.arguments, case, splits)
    return dataclasses.replace(statement, device_code=call.device_code())


COMPILED_VLLM_OPTIONS = OptionSpec("vllm-aiter@compiled", {"install": INSTALLS, **IRREGULAR})


class VllmAiterCompiled(VllmAiter):
    """vLLM's ``minimax_m3_sparse_attn_decode_aiter`` (its builder, its ``_run_gluon_decode``
    and K-trim) calling a tree's real launcher, compiled for the arch: the seed's whole path.
    Its numerics are the emulator's, so it is an emulated caller for the capabilities and
    empty rows it declares."""

    real_options = emulated_options = COMPILED_VLLM_OPTIONS
    releases = ("vllm", "aiter")  # vLLM's caller, AITER's launcher

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        given = dict(options or {})
        self.compiled = CompiledOptions(COMPILED_VLLM_OPTIONS.base, given)
        super().__init__(True, given)
        spec = COMPILED_VLLM_OPTIONS
        named = _name(spec, {k: self.options[k] for k in spec.choices}, self.compiled.named())
        self.options |= self.compiled.named()  # kept by the variants VllmAiter names
        self.name = (f"{named[:-1]},vllm={self.vllm}]" if self.vllm and named.endswith("]")
                     else f"{named}[vllm={self.vllm}]" if self.vllm else named)

    def with_options(self, options: Mapping[str, str]) -> VllmAiterCompiled:
        """``aiter=``, ``arch=``, ``install=``, ``irregular=``, ``vllm=``."""
        return VllmAiterCompiled(options)

    def availability(self) -> Availability:
        """vLLM's (see :class:`VllmAiter`) and the tree's (:func:`compile_availability`)."""
        tree = compile_availability(self.compiled.source, self.compiled.source_error)
        return tree if not tree.available else super().availability()

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """vLLM's refusals, and fp8 that is not the arch's."""
        return super().unsupported_reason(case, device) or (
            self.compiled.unsupported(case, device, self.options["install"]))

    def _recommended_splits(self, case: Case) -> Callable[..., int]:
        return self.compiled.gluon(case, self.options["install"]).get_recommended_splits

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """From the splits vLLM asks for (see :func:`_empty_rows`)."""
        splits = self._recommended_splits(case)(case.total_q * case.num_kv_heads, 1)
        return _empty_rows(splits, self.options["install"])

    def _kernel_versions(self) -> dict[str, str]:
        return self.compiled.versions(self.options["install"])

    def _aiter_for(self, case: Case) -> contextlib.AbstractContextManager[object]:
        """The tree's launcher as ``aiter.ops.triton.gluon.pa_decode_gluon``."""
        gluon = self.compiled.gluon(case, self.options["install"])
        return installed_modules(gluon.pa_decode_gluon, gluon.get_recommended_splits, gluon.fp8,
                                 f"compiled {gluon.source.version} {gluon.answers.arch}",
                                 "AITER's compiled pa_decode_gluon", shadow_real=True)

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """vLLM's decode; the ``pa_decode_gluon`` call it made is stated too, with the device
        code it compiled."""
        gluon = self.compiled.gluon(inputs.case, self.options["install"])
        gluon.calls.clear()
        output = super().run(inputs)
        inputs.state(stated_call(gluon, gluon.calls[-1], inputs.case,
                                 "auto (vLLM's get_recommended_splits)"))
        return output


def default_backends() -> list[Any]:
    """The registered names: ``aiter-gluon@compiled`` and ``vllm-aiter@compiled``."""
    return [AiterGluonCompiled(), VllmAiterCompiled()]
