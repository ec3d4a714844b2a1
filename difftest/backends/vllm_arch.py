"""Architecture emulation: a vLLM release's launchers making an AMD GPU's launch choices here.

vLLM's launchers pick tiles, warps, stages, segment counts and the 2D/3D path by GPU
architecture (0.34.0's ``triton_unified_attention.py``: ``is_gfx1201`` / ``is_gfx1100`` from
``vllm.platforms.rocm.on_gfx1201()`` under ``current_platform.is_rocm()``). A backend option
``arch=gfx1201`` loads the release's kernel files a second time
(:meth:`difftest.backends.vllm_release.Release.load` with ``arch``) with their imports of
``vllm.platforms`` and ``vllm.platforms.rocm`` pointed at :func:`arch_modules`: a
``current_platform`` that answers as ROCm on that architecture (``is_rocm()``,
``is_cuda()``, the capability-family and PDL questions, its fp8 dtype) and delegates every
other question to the venv's platform, and ``on_gfx*()`` answers from the arch name. The
kernels then run with that architecture's launch parameters on whatever device is here: the
interpreter, or an NVIDIA or AMD GPU of another architecture. What such a device cannot
reproduce (a warp of ``num_warps`` is a 32-lane wave on RDNA, 64 lanes on CDNA) is stated in
:func:`arch_note`, never adjusted.
"""

from __future__ import annotations

import logging
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from difftest.machine import devices


@dataclass(frozen=True)
class Arch:
    """An AMD GPU architecture's facts the launchers read."""

    name: str
    family: str
    wave: int
    fp8: str  # torch dtype name of the platform's fp8


ARCHES = {a.name: a for a in (
    Arch("gfx1201", "RDNA4", 32, "float8_e4m3fn"),
    Arch("gfx1100", "RDNA3", 32, "float8_e4m3fn"),
    Arch("gfx942", "CDNA3", 64, "float8_e4m3fnuz"),
    Arch("gfx950", "CDNA4", 64, "float8_e4m3fn"),
)}
_ON_NAME = re.compile(r"on_(gfx\w+|mi3xx|rdna\d?)")


class ArchError(ValueError):
    """An ``arch=`` value that is not emulated; the message lists those that are."""


def arch_of(name: str) -> Arch:
    """The emulated architecture ``name``; :class:`ArchError` names the allowed ones."""
    if name not in ARCHES:
        raise ArchError(f"arch={name!r} is not emulated (allowed: {', '.join(ARCHES)})")
    return ARCHES[name]


def on_arch(arch: Arch, query: str) -> bool:
    """``vllm.platforms.rocm.on_<query>()`` for ``arch``: ``gfx1201`` exact or as a
    prefix (``gfx12``, ``gfx12x``, ``gfx115x``: a trailing ``x`` is a wildcard),
    ``gfx1x`` for gfx11/gfx12, ``mi3xx`` for gfx942/gfx950, ``rdna`` for the RDNA family
    (``rdna4``, ``rdna3``: one generation)."""
    if query.startswith("rdna"):
        return arch.family.lower().startswith(query)
    if query == "mi3xx":
        return arch.name in ("gfx942", "gfx950")
    if query == "gfx1x":
        return arch.name.startswith(("gfx11", "gfx12"))
    return arch.name.startswith(query.rstrip("x"))


class ArchPlatform:
    """The venv's ``current_platform``, answering as ROCm on ``arch`` where launchers ask."""

    def __init__(self, arch: Arch) -> None:
        self._arch = arch

    def is_rocm(self) -> bool:
        """True: the launchers take their ROCm branches."""
        return True

    def is_cuda(self) -> bool:
        """False."""
        return False

    def is_cuda_alike(self) -> bool:
        """True, as on ROCm."""
        return True

    def is_device_capability_family(self, *_: Any, **__: Any) -> bool:
        """False: NVIDIA capability families are never an AMD GPU's."""
        return False

    def is_arch_support_pdl(self) -> bool:
        """False: programmatic dependent launch is NVIDIA's."""
        return False

    def fp8_dtype(self) -> torch.dtype:
        """The architecture's fp8 (e4m3fnuz on gfx942, e4m3fn elsewhere)."""
        return getattr(torch, self._arch.fp8)

    def __getattr__(self, name: str) -> Any:
        from vllm.platforms import current_platform

        return getattr(current_platform, name)


def arch_modules(arch: Arch) -> str:
    """Register ``<prefix>.platforms`` and ``<prefix>.platforms.rocm`` for ``arch`` in
    ``sys.modules`` (once) and return the prefix the kernel files' imports point at."""
    prefix = f"_difftest_arch_{arch.name}"
    if prefix not in sys.modules:
        top = types.ModuleType(prefix)
        top.__path__ = []
        platforms = types.ModuleType(f"{prefix}.platforms")
        platforms.__path__ = []
        platforms.current_platform = ArchPlatform(arch)
        rocm = types.ModuleType(f"{prefix}.platforms.rocm")
        rocm.__getattr__ = _rocm_query(arch)
        rocm.use_rocm_custom_paged_attention = no_custom_paged_attention
        platforms.rocm = rocm
        top.platforms = platforms
        sys.modules.update({prefix: top, platforms.__name__: platforms, rocm.__name__: rocm})
    return prefix


def no_custom_paged_attention(*_: Any, **__: Any) -> bool:
    """``vllm.platforms.rocm.use_rocm_custom_paged_attention`` under emulation: False, so
    ``chunked_prefill_paged_decode`` takes its Triton branch (the HIP ``paged_attention_rocm``
    is compiled ROCm code, which no emulation runs)."""
    return False


def _rocm_query(arch: Arch) -> Callable[[str], Callable[[], bool]]:
    def lookup(name: str) -> Callable[[], bool]:
        found = _ON_NAME.fullmatch(name)
        if found is None:
            raise AttributeError(f"vllm.platforms.rocm.{name} is not emulated for arch="
                                 f"{arch.name} (emulated: on_gfx*(), on_mi3xx(), on_rdna*(), "
                                 "use_rocm_custom_paged_attention())")
        return lambda: on_arch(arch, found.group(1))
    return lookup


class OnceLogger:
    """The standard library's logger with vLLM's ``*_once`` methods, for a wrapper's
    ``logger`` under emulation: vLLM's own looks up the process's rank for ``*_once``, which
    imports its serving stack (psutil, zmq, ...). Silent unless logging is configured: the
    wrapper's notes (such as its fallback from the HIP kernel) are what emulation expects."""

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)
        self._logger.addHandler(logging.NullHandler())
        self._said: set[tuple[str, str]] = set()

    def _once(self, level: str, message: str, *args: Any, **_: Any) -> None:
        if (level, message) not in self._said:
            self._said.add((level, message))
            getattr(self._logger, level)(message, *args)

    def warning_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Log ``message`` at WARNING, the first time only."""
        self._once("warning", message, *args, **kwargs)

    def info_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Log ``message`` at INFO, the first time only."""
        self._once("info", message, *args, **kwargs)

    def debug_once(self, message: str, *args: Any, **kwargs: Any) -> None:
        """Log ``message`` at DEBUG, the first time only."""
        self._once("debug", message, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class LaunchRecorder:
    """A ``@triton.jit`` kernel of an arch-emulated module whose launches are counted with
    their launch parameters (:func:`difftest.contract.launches.note_launch`), then run unchanged."""

    def __init__(self, kernel: Any, module: str, name: str) -> None:
        self.kernel, self.module, self.name = kernel, module, name
        self.last: dict[str, Any] = {}  # the keyword arguments of the latest launch

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            from difftest.contract.launches import note_launch

            note_launch(self.module, self.name, kwargs)
            self.last = kwargs
            return launch(*args, **kwargs)
        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def record_launches(module: types.ModuleType, names: tuple[str, ...]) -> None:
    """Count the launches of ``module``'s kernels ``names`` (once per module)."""
    for name in names:
        kernel = getattr(module, name, None)
        if kernel is not None and not isinstance(kernel, LaunchRecorder):
            setattr(module, name, LaunchRecorder(kernel, module.__name__, name))


def arch_note(arch: Arch) -> str:
    """What ran and what this device cannot reproduce of ``arch``."""
    if devices.interpreted():
        here = "Triton's interpreter (no waves: num_warps and num_stages have no effect)"
    elif devices.gpu_vendor() == "nvidia":
        here = "an NVIDIA GPU (32-lane warps)"
    else:
        here = "this GPU's own waves"
    return (f"{arch.name} ({arch.family}) launch choices: vllm.platforms.current_platform "
            f"answers is_rocm() True and fp8 {arch.fp8}, vllm.platforms.rocm.on_gfx*() "
            f"and on_rdna*() for {arch.name}, use_rocm_custom_paged_attention() False; "
            f"num_warps and num_stages are passed as chosen for "
            f"{arch.wave}-lane waves and run on {here}")
