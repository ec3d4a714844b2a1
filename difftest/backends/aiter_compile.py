"""Compiling an AITER tree's GPU kernels for a gfx arch instead of running them, on any machine.

Inside :func:`compiling`, AITER's device questions are answered for the arch
(:func:`difftest.backends.aiter_triton.answering`: Triton's active driver reports
``GPUTarget("hip", arch, 64)``), and every launch ``kernel[grid](...)`` of a Triton or Gluon
JIT function becomes ``kernel.run(..., grid=grid, warmup=True)``: Triton's AMD backend compiles
the kernel for the arch and nothing runs. Triton's own on-disk cache (``$TRITON_CACHE_DIR``,
default ``~/.triton/cache``) keeps each compiled specialization, so a later process pays for it
once. Each launch is recorded as a :class:`RecordedLaunch` (the kernel, its grid, every
argument by parameter name), and :func:`device_code` fingerprints the compiled kernel
(:class:`difftest.contract.kernel_call.DeviceCode`). A kernel that does not compile raises
:class:`KernelCompileError` with the compiler's diagnostics (MLIR prints them on the process's
stderr, not into the exception). The tree's modules must be loaded with
``AiterSource.load(..., compiled=True)``, so that their ``@triton.jit`` functions are compiled
ones even where ``TRITON_INTERPRET=1``
(:func:`difftest.machine.triton_compile.not_interpreted`). docs/rocm.md says what this shows
and what it cannot (numerics).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import struct
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from difftest.backends.aiter_triton import DeviceAnswers, answering
from difftest.contract.kernel_call import DeviceCode
from difftest.machine.triton_compile import not_interpreted

# LDS of one compute unit (CDNA3: 64 KiB; CDNA4: 160 KiB), and SIMDs per compute unit.
LDS_BYTES_PER_CU = {"gfx942": 65536, "gfx950": 163840}
SIMDS_PER_CU = 4
_METADATA_FIELD = re.compile(r"^\s*\.(\w+):\s+(\d+)\s*$", re.M)
_OCCUPANCY = re.compile(r"^; Occupancy: (\d+)\s*$", re.M)
_DIAGNOSTIC = re.compile(r"^(?:.*/)?([^/:\s]+:\d+:\d+: error: .*)$", re.M)


class KernelCompileError(RuntimeError):
    """A launched kernel does not compile for the arch; the message holds the diagnostics."""


@dataclass
class RecordedLaunch:
    """One launch a launcher made: ``arguments`` by parameter name (defaults filled in),
    ``compiled`` Triton's compiled kernel (``None`` for a call a stand-in took, e.g. AITER's
    C++ reduce)."""

    kernel: str
    grid: tuple[int, ...]
    arguments: dict[str, Any]
    compiled: Any = None


@dataclass
class LaunchRecorder:
    """The launches made inside one :func:`compiling` block, in order."""

    launches: list[RecordedLaunch] = field(default_factory=list)

    def record(self, launch: RecordedLaunch) -> None:
        """Append a launch (a stand-in for a launch that is not a JIT kernel records too)."""
        self.launches.append(launch)


def _bind(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``kernel[grid](*args, **kwargs)`` by parameter name, defaults filled."""
    bound = dict(zip(kernel.arg_names, args, strict=False))
    for param in kernel.params:
        if param.name in kwargs:
            bound[param.name] = kwargs[param.name]
        elif param.name not in bound and param.has_default:
            bound[param.name] = param.default
    return bound


@contextlib.contextmanager
def compiling(answers: DeviceAnswers) -> Iterator[LaunchRecorder]:
    """Inside the block, kernel launches compile for ``answers.arch`` and are recorded."""
    from triton.runtime.jit import KernelInterface

    recorder = LaunchRecorder()

    def compile_only(kernel: Any, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            arguments = _bind(kernel, args, kwargs)
            with _stderr_kept() as printed:
                try:
                    compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
                except Exception as exc:
                    failure = exc
                else:
                    failure = None
            if failure is not None:
                said = "; ".join(_DIAGNOSTIC.findall(printed[0])) or f"{failure}"
                raise KernelCompileError(f"{kernel.fn.__name__} does not compile for "
                                         f"{answers.arch}: {said}") from failure
            sys.stderr.write(printed[0])
            shape = grid(arguments) if callable(grid) else grid
            recorder.record(RecordedLaunch(kernel.fn.__name__, tuple(int(n) for n in shape),
                                           arguments, compiled))
            return compiled
        return launch

    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = compile_only  # type: ignore[method-assign]
    try:
        with answering(answers), not_interpreted():
            yield recorder
    finally:
        KernelInterface.__getitem__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _stderr_kept() -> Iterator[list[str]]:
    """What the block prints on file descriptor 2 (C++ diagnostics included), as the list's
    one item after the block."""
    printed: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield printed
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            printed.append(sink.read().decode(errors="replace"))


def text_section(elf: bytes) -> bytes:
    """The ``.text`` section of an ELF64 code object: the machine code alone (the object's
    other sections hold debug information with the source file's path)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(index: int) -> tuple[int, int, int]:
        base = shoff + index * shentsize
        name, = struct.unpack_from("<I", elf, base)
        offset, size = struct.unpack_from("<QQ", elf, base + 0x18)
        return name, offset, size

    _, names_at, _ = section(shstrndx)
    for index in range(shnum):
        name, offset, size = section(index)
        if elf[names_at + name:elf.index(b"\0", names_at + name)] == b".text":
            return elf[offset:offset + size]
    raise ValueError("code object has no .text section")


def specialization(compiled: Any) -> str:
    """What determines the binary besides the kernel's source and the arch: each constexpr
    as ``NAME=value``, each other argument as ``name:type`` (``/16`` where Triton specialised
    it as divisible by 16), in parameter order."""
    source = compiled.src
    names = list(source.fn.arg_names)
    constants = {names[path[0]]: value for path, value in source.constants.items()
                 if len(path) == 1}
    divisible = {names[path[0]] for path, attrs in source.attrs.items()
                 if len(path) == 1 and ["tt.divisibility", 16] in [list(a) for a in attrs]}
    parts = []
    for name in names:
        if name in constants:
            parts.append(f"{name}={constants[name]}")
        else:
            parts.append(f"{name}:{source.signature[name]}" + ("/16" if name in divisible else ""))
    return " ".join(parts)


def device_code(compiled: Any) -> DeviceCode:
    """The fingerprint of one compiled AMD kernel (see :class:`DeviceCode`): registers and
    spills from the code object's metadata, LDS from Triton's metadata, occupancy the
    compiler's register-limited waves per SIMD, lowered where the workgroups LDS admits per
    compute unit hold fewer waves."""
    metadata = compiled.metadata
    amdgcn = compiled.asm["amdgcn"]
    fields = {name: int(value) for name, value in _METADATA_FIELD.findall(amdgcn)}
    arch = metadata.target.arch
    lds = max(int(metadata.shared), fields.get("group_segment_fixed_size", 0))
    occupancy = int(_OCCUPANCY.search(amdgcn).group(1))
    if lds:
        workgroups = LDS_BYTES_PER_CU[arch] // lds
        occupancy = min(occupancy, workgroups * metadata.num_warps // SIMDS_PER_CU)
    return DeviceCode(
        kernel=metadata.name, arch=arch, specialization=specialization(compiled),
        sha256=hashlib.sha256(text_section(compiled.asm["hsaco"])).hexdigest(),
        vgprs=fields["vgpr_count"], sgprs=fields["sgpr_count"], lds_bytes=lds,
        spills=fields.get("vgpr_spill_count", 0) + fields.get("sgpr_spill_count", 0),
        occupancy=occupancy)
