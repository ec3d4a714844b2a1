"""What every adapter to one of vLLM's kernels shares: the release choice, availability, versions,
the interpreter-bf16 and e4m3fnuz refusals, and loading the kernel's module.

A vLLM backend (``triton-unified``, ``vllm-triton-sparse``, ``vllm-paged-decode``,
``vllm-decode-attention``, ``vllm-aiter``) runs the kernel of one vLLM: the ``vllm=<version or
path>`` option's release, else ``$DIFFTEST_VLLM``'s, else the venv's
(:mod:`difftest.backends.vllm_release`); one whose launchers choose by GPU architecture also
takes ``arch=<gfx...>`` (:mod:`difftest.backends.vllm_arch`). :class:`VllmAdapter` holds that
choice and what follows from it; a backend states its own facts (its name, its kernel's file
and module, which dtypes the interpreter miscomputes in its dots) as class attributes, and
adds what it needs beyond them through :meth:`~VllmAdapter.kernel_availability` and
:meth:`~VllmAdapter.on_arch_loaded`.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import ClassVar

import torch

from difftest.backends.vllm_arch import arch_note, arch_of, record_launches
from difftest.backends.vllm_imports import (
    import_minimax_m3,
    import_vllm_kernel,
    kernel_availability,
    minimax_m3_loading,
    triton_availability,
    vllm_location,
    vllm_version,
)
from difftest.backends.vllm_release import Release, chosen_release, resolve
from difftest.case.spec import Case
from difftest.contract.backend import Availability
from difftest.machine import devices

MINIMAX_M3 = "vllm.models.minimax_m3."  # imported without the model package's re-exports
INTERPRETER_BF16_FINDING = (
    "bfloat16 queries under TRITON_INTERPRET=1 are miscomputed by Triton's interpreter "
    "(pinned finding F1, tests/test_findings.py::test_interpreter_miscomputes_bf16); "
    "bfloat16 runs on GPUs"
)
FNUZ_ON_NVIDIA = "float8_e4m3fnuz is an AMD format; Triton on NVIDIA GPUs has no such type"


def with_given(name: str, given: Mapping[str, str | None]) -> str:
    """``name`` with the ``given`` free-form options appended inside its brackets, after the
    options already there, as given (``triton-unified[vllm=0.30.0,arch=gfx1201]``)."""
    listed = [f"{key}={value}" for key, value in given.items() if value]
    if not listed:
        return name
    if name.endswith("]"):
        return f"{name[:-1]},{','.join(listed)}]"
    return f"{name}[{','.join(listed)}]"


class VllmAdapter:
    """The vLLM release a backend runs and what follows from it (see the module docstring).

    ``vllm``, ``arch``: the options as given (``None``: not given); ``name``: the name
    without them (default :attr:`base`); ``allow_interpreter_bf16`` runs the bfloat16 cases
    that Triton's interpreter miscomputes (finding F1) anyway.
    """

    base: ClassVar[str]
    """The registered name: what the name is without options."""
    kernel_files: ClassVar[tuple[str, ...]]
    """The kernel's file inside a release's ``vllm/`` (the first one a release has)."""
    kernel_module_name: ClassVar[str]
    """The module holding the kernel in the venv's vLLM."""
    kernel_what: ClassVar[str] = ""
    """What a release without :attr:`kernel_files` lacks, in the reason (default: the files)."""
    free_options: ClassVar[tuple[str, ...]] = ("vllm",)
    """The free-form options (``vllm``; ``arch`` where the launchers are emulated)."""
    arch_launches: ClassVar[tuple[str, ...]] = ()
    """The ``@triton.jit`` kernels whose launches are recorded under ``arch=``."""
    bf16_dots: ClassVar[tuple[str, ...]] = ("query_dtype",)
    """The case's dtype fields whose bfloat16 the interpreter miscomputes in the kernel."""
    releases: ClassVar[tuple[str, ...]] = ("vllm",)
    """The release kinds it runs the chosen release of (``difftest bump vllm`` runs it)."""
    interpreter_bf16_finding: ClassVar[str]
    """The reason a bfloat16 case is refused under the interpreter (:data:`INTERPRETER_BF16_FINDING`
    where the kernel has no pin of its own)."""

    def __init__(self, vllm: str | None = None, arch: str | None = None, *,
                 name: str | None = None, allow_interpreter_bf16: bool = False) -> None:
        self.vllm = vllm
        self.release, self.release_error = chosen_release(vllm)
        self.arch = arch_of(arch) if arch else None
        self.allow_interpreter_bf16 = allow_interpreter_bf16
        self.name = with_given(name or self.base, {"vllm": vllm, "arch": arch})
        self._module: types.ModuleType | None = None

    @classmethod
    def split_options(cls, options: Mapping[str, str], own: bool = False
                      ) -> tuple[dict[str, str], dict[str, str]]:
        """``options`` as ``(free-form ones, the backend's own)``; a backend without options
        of its own (``own`` False) raises ``ValueError`` for any other, naming the allowed."""
        free = {key: value for key, value in options.items() if key in cls.free_options}
        rest = {key: value for key, value in options.items() if key not in cls.free_options}
        if rest and not own:
            raise ValueError(f"{cls.base}: unknown option {sorted(rest)[0]!r} (options: "
                             f"{', '.join(cls.free_options)})")
        return free, rest

    def version(self) -> str:
        """The version of the vLLM whose kernel runs."""
        return self.release.version if self.release is not None else vllm_version()

    def tree(self) -> Release | None:
        """The release tree whose kernel file is loaded: the chosen release, else under
        ``arch=`` the venv's own tree (its platform answered for the arch); ``None`` where
        the venv's module is imported."""
        if self.release is not None:
            return self.release
        return resolve(vllm_location()) if self.arch is not None else None

    def availability(self) -> Availability:
        """Needs the chosen release (and its kernel file), vLLM's Triton running here (a GPU
        or the interpreter), then :meth:`kernel_availability`."""
        if self.release_error:
            return Availability(False, self.release_error)
        lacks = self.release and self.release.lacks(*self.kernel_files, what=self.kernel_what)
        if lacks:
            return Availability(False, lacks)
        triton = triton_availability()
        if not triton.available:
            return triton
        return self.kernel_availability()

    def kernel_availability(self) -> Availability:
        """What the kernel needs beyond vLLM's Triton: the venv's MiniMax-M3 module must
        import here (a release's files are loaded by the release loader)."""
        if self.tree() is None and self.kernel_module_name.startswith(MINIMAX_M3):
            return kernel_availability(self.kernel_module_name.removeprefix(MINIMAX_M3))
        return Availability(True)

    def kernel_module(self) -> types.ModuleType:
        """The module holding the kernel, loaded once: the chosen release's file
        (:meth:`~difftest.backends.vllm_release.Release.load_first`; under ``arch=`` the copy
        whose platform answers for it, then :meth:`on_arch_loaded`), else the venv's module."""
        if self._module is None:
            tree = self.tree()
            if tree is None and self.kernel_module_name.startswith(MINIMAX_M3):
                module = import_minimax_m3(self.kernel_module_name.removeprefix(MINIMAX_M3))
            elif tree is None:
                module = import_vllm_kernel(self.kernel_module_name)
            else:
                arch = self.arch.name if self.arch is not None else None
                module = import_vllm_kernel(self.kernel_module_name,
                                            lambda: tree.load_first(*self.kernel_files, arch=arch))
            if self.arch is not None:
                self.on_arch_loaded(module)
            self._module = module
        return self._module

    def on_arch_loaded(self, module: types.ModuleType) -> None:
        """Under ``arch=``, once the module is loaded: record the launches of
        :attr:`arch_launches` (the parameters the arch's launcher chose)."""
        record_launches(module, self.arch_launches)

    def vllm_versions(self) -> dict[str, str]:
        """The vLLM that runs (version, path, which of its modules were loaded how), Triton's
        version and whether it is interpreted, and the emulated arch."""
        import triton

        versions = {"vllm": vllm_version(), "vllm_path": vllm_location(),
                    "triton": triton.__version__, "triton_interpret": str(devices.interpreted())}
        tree = self.tree()
        if tree is not None or self.kernel_module_name.startswith(MINIMAX_M3):
            try:
                self.kernel_module()
                loading = (tree.loading(self.arch and self.arch.name) if tree is not None
                           else minimax_m3_loading())
            except Exception as exc:  # the run reports it as the backend's error
                loading = f"loading failed: {exc!r}"
            versions["vllm_loading"] = loading
        if tree is not None:
            versions.update(vllm=tree.version, vllm_path=str(tree.package),
                            vllm_loading=f"{versions['vllm_loading']} ({vllm_version()})")
        if self.arch is not None:
            versions["arch"] = arch_note(self.arch)
        return versions

    def versions(self) -> dict[str, str]:
        """See :meth:`vllm_versions`; a backend adds its own facts."""
        return self.vllm_versions()

    def interpreter_bf16_reason(self, case: Case, device: torch.device) -> str | None:
        """Why a bfloat16 case is refused under Triton's interpreter (finding F1 or the
        kernel's own pin), unless ``allow_interpreter_bf16``."""
        if (device.type == "cpu" and not self.allow_interpreter_bf16
                and "bfloat16" in (getattr(case, field) for field in self.bf16_dots)):
            return self.interpreter_bf16_finding
        return None

    @staticmethod
    def fnuz_reason(case: Case, device: torch.device) -> str | None:
        """Why an e4m3fnuz cache is refused on an NVIDIA GPU."""
        if (device.type == "cuda" and case.kv_dtype == "float8_e4m3fnuz"
                and devices.gpu_vendor() == "nvidia"):
            return FNUZ_ON_NVIDIA
        return None
