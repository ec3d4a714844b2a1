"""Finding AITER's Triton ops and importing them without ROCm.

``import aiter`` needs ROCm (its ``__init__`` builds the JIT extension environment and reads
the HIP version), but AITER's Triton ops are plain Python over Triton. An :class:`AiterSource`
is one AITER tree on disk; :meth:`AiterSource.load` executes one of its module files under a
private top-level name (``_difftest_aiter_<tag>.ops.triton...``), with every directory an
empty package (no ``__init__`` runs) and its ``from aiter... import`` / ``import aiter... as``
lines pointed at the same private name. Only import lines are rewritten, on their own lines,
so every ``@triton.jit`` function keeps AITER's text and line numbers.

Where a source comes from (:func:`chosen_source`): an ``aiter=<path or name>`` option, else
``$DIFFTEST_AITER``; else the AITER installed in the environment (ROCm runners' real one);
else the PyPI wheel ``scripts/setup.sh`` unpacks into ``<venv>/difftest-aiter`` (never on
``sys.path``, so it never shadows a real AITER). A name resolves to
``$DIFFTEST_AITER_ROOT/<name>`` (default ``~/.cache/difftest/aiter/<name>``), where
``scripts/fetch_aiter.sh`` puts a wheel version or a git tag.

Without a GPU, AITER's import-time and launch-time questions about the device are answered on
its behalf, in one place (:class:`DeviceAnswers`): Triton's active driver reports a HIP target
of the chosen gfx arch (AITER reads it for its fp8 type and tuning), ``get_num_sms`` of
AITER's ``utils/device_info`` and ``torch.cuda.get_device_properties()`` return the chosen
compute-unit count (AITER's 2-D/3-D choice, ``pa_decode_gluon``'s split recommendation), and
``aiter.dtypes`` (a plain ``import aiter`` of a tree module is pointed at the private package)
is AITER's ``utility/dtypes.py`` with the arch answered (:func:`answered_dtypes`).
``AiterSource.load(..., compiled=True)`` loads a tree's modules a second time, under their own
private name and with Triton's interpreter off, so that their kernels can be compiled for the
arch rather than interpreted (:mod:`difftest.backends.aiter_compile`).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from difftest.backends.private_tree import PrivateTreeFinder
from difftest.backends.vllm_arch import ARCHES
from difftest.contract.backend import Availability
from difftest.machine import devices
from difftest.machine.triton_compile import not_interpreted

ROOT_ENV = "DIFFTEST_AITER_ROOT"
SOURCE_ENV = "DIFFTEST_AITER"
DEFAULT_ROOT = Path("~/.cache/difftest/aiter")
WHEEL_DIR = "difftest-aiter"  # under the venv's prefix: where setup unpacks the PyPI wheel
VERSION_FILE = "difftest-aiter-version"  # written by scripts/fetch_aiter.sh beside aiter/

# Compute units of the GPUs whose arch a CPU run answers (MI300X, MI355X, Radeon AI PRO R9700).
COMPUTE_UNITS = {"gfx942": 304, "gfx950": 256, "gfx1201": 64}
# The arch whose AITER fp8 type (``aiter.ops.triton.utils.types.e4m3_dtype``) is each format.
ARCH_OF_FP8 = {"float8_e4m3fnuz": "gfx942", "float8_e4m3fn": "gfx950"}

_FROM_LINE = re.compile(r"^(\s*from\s+)aiter((?:\.\w+)*\s+import\b)", re.M)
_IMPORT_AS_LINE = re.compile(r"^(\s*import\s+)aiter((?:\.\w+)+\s+as\s+\w+)", re.M)
_PLAIN_IMPORT_LINE = re.compile(r"^(\s*)import aiter[ \t]*$", re.M)
_DEVICE_INFO = "ops.triton.utils.device_info"
_DTYPES = "utility.dtypes"


class SourceError(ValueError):
    """An ``aiter=`` option names no usable AITER tree; the message says where it looked."""


@dataclass(frozen=True)
class DeviceAnswers:
    """What AITER is told about the GPU when there is none: a gfx arch and its CU count."""

    arch: str
    compute_units: int

    @staticmethod
    def for_arch(arch: str) -> DeviceAnswers:
        """The answers for one of :data:`COMPUTE_UNITS`' archs."""
        if arch not in COMPUTE_UNITS:
            raise ValueError(f"arch={arch}: allowed {', '.join(sorted(COMPUTE_UNITS))}")
        return DeviceAnswers(arch, COMPUTE_UNITS[arch])

    def describe(self) -> str:
        """One line for ``versions()``."""
        return (f"{self.arch} (Triton's active driver reports target hip/{self.arch}, "
                f"warp {ARCHES[self.arch].wave}; get_num_sms() -> {self.compute_units})")


class _AnsweringDriver:
    """A stand-in for Triton's active driver that reports one HIP target."""

    def __init__(self, arch: str) -> None:
        self.arch = arch

    def get_current_target(self) -> object:
        """``GPUTarget("hip", arch, wave)``: 64-lane waves on CDNA, 32 on RDNA."""
        from triton.backends.compiler import GPUTarget

        return GPUTarget("hip", self.arch, ARCHES[self.arch].wave)

    def get_current_device(self) -> int:
        """Device 0."""
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        """The null stream (a launch compiled only never uses it)."""
        return 0


@contextlib.contextmanager
def answering(answers: DeviceAnswers | None) -> Iterator[None]:
    """Triton's active driver reports ``answers.arch`` and ``torch.cuda.get_device_properties``
    its compute units inside the block (nothing without answers); both come back after it."""
    if answers is None:
        yield
        return
    import torch
    from triton.runtime.driver import driver

    properties = types.SimpleNamespace(name=f"AMD {answers.arch} (answered)",
                                       gcnArchName=answers.arch,
                                       multi_processor_count=answers.compute_units)
    previous, previous_properties = driver._active, torch.cuda.get_device_properties
    driver.set_active(_AnsweringDriver(answers.arch))
    torch.cuda.get_device_properties = lambda device=None: properties
    try:
        yield
    finally:
        driver._active = previous
        torch.cuda.get_device_properties = previous_properties


def answered_dtypes(path: Path, arch: str, name: str) -> types.ModuleType:
    """AITER's ``utility/dtypes.py`` at ``path`` as ``arch`` gives it: its statements run in
    order with ``get_gfx_runtime()`` (``get_gfx()`` before v0.1.19) answering ``arch``. Its
    imports are not run (they reach ``rocminfo`` and the C++ enum header), so the statements
    that need what they import (the C++ dtype ids) are skipped; ``fp8``, ``bf16``, ``fp16`` and
    ``fp32`` are AITER's own lines."""
    import torch

    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__dict__.update(torch=torch, get_gfx_runtime=lambda: arch, get_gfx=lambda: arch)
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        try:
            exec(compile(ast.Module([node], []), str(path), "exec"), module.__dict__)
        except NameError:
            continue  # a name one of the skipped imports would have bound
    return module


@dataclass(frozen=True)
class AiterSource:
    """One AITER tree: ``package`` is its ``aiter/`` directory; ``origin`` says where it was
    found (``installed``, ``wheel``, ``tree``)."""

    spec: str
    package: Path
    version: str
    origin: str

    def find(self, *candidates: str) -> Path | None:
        """The first of ``candidates`` (paths inside ``aiter/``) this tree has."""
        for relative in candidates:
            path = self.package / relative
            if path.is_file():
                return path
        return None

    def module_prefix(self, answers: DeviceAnswers | None, compiled: bool = False) -> str:
        """The private top-level name its modules load under (one per tree, answers and
        whether they are loaded to be compiled)."""
        tag = re.sub(r"\W", "_", self.version)
        tag += "_" + hashlib.sha256(str(self.package).encode()).hexdigest()[:8]
        return (f"_difftest_aiter_{tag}" + (f"_{answers.arch}" if answers else "")
                + ("_compiled" if compiled else ""))

    def load(self, path: Path, answers: DeviceAnswers | None,
             compiled: bool = False) -> types.ModuleType:
        """Import the tree's module file ``path`` under the private name (once), with
        ``answers`` given to AITER's device questions (none on a GPU); ``compiled`` executes
        the tree's files with Triton's interpreter off, so their kernels compile."""
        prefix = self.module_prefix(answers, compiled)
        if not any(isinstance(f, _AiterFinder) and f.prefix == prefix for f in sys.meta_path):
            sys.meta_path.append(_AiterFinder(self.package, prefix, answers, compiled))
        relative = path.relative_to(self.package).with_suffix("")
        with answering(answers):
            return importlib.import_module(".".join((prefix, *relative.parts)))


class _AiterFinder(PrivateTreeFinder):
    """Finds ``<prefix>.<path inside aiter/>`` in one tree (directories are empty packages)."""

    def __init__(self, package: Path, prefix: str, answers: DeviceAnswers | None,
                 compiled: bool = False) -> None:
        super().__init__(package, prefix)
        self.answers = answers
        self.compiled = compiled

    def exec_module(self, module: types.ModuleType) -> None:
        """As the base class; the top-level package gets the answered ``dtypes`` (also
        the module ``utility.dtypes``) where AITER's device questions are answered."""
        super().exec_module(module)
        dtypes = self.package / Path(*_DTYPES.split(".")).with_suffix(".py")
        if module.__name__ == self.prefix and self.answers is not None and dtypes.is_file():
            name = f"{self.prefix}.{_DTYPES}"
            module.dtypes = sys.modules.setdefault(
                name, answered_dtypes(dtypes, self.answers.arch, name))

    def run_file(self, module: types.ModuleType, path: Path) -> None:
        """Run a module file with its ``aiter`` imports pointed at the prefix (``import
        aiter`` binds the private package). ``device_info.get_num_sms`` is replaced by the
        answered CU count."""
        source = _FROM_LINE.sub(rf"\g<1>{self.prefix}\g<2>", path.read_text())
        source = _IMPORT_AS_LINE.sub(rf"\g<1>{self.prefix}\g<2>", source)
        source = _PLAIN_IMPORT_LINE.sub(rf"\g<1>import {self.prefix} as aiter", source)
        with not_interpreted() if self.compiled else contextlib.nullcontext():
            exec(compile(source, str(path), "exec"), module.__dict__)
        if self.answers is not None and module.__name__ == f"{self.prefix}.{_DEVICE_INFO}":
            units = self.answers.compute_units
            module.get_num_sms = lambda: units


def source_root() -> Path:
    """Where names are looked up: ``$DIFFTEST_AITER_ROOT`` or ``~/.cache/difftest/aiter``."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT).expanduser()


def _version_of(package: Path) -> str:
    marker = package.parent / VERSION_FILE
    if marker.is_file():
        return marker.read_text().strip()
    for info in sorted(package.parent.glob("*aiter*.dist-info")):
        return info.name.removesuffix(".dist-info").rpartition("-")[2]
    return "unknown"


def _has_triton_ops(package: Path) -> bool:
    return (package / "ops" / "triton").is_dir()


def resolve(spec: str) -> AiterSource:
    """The tree an ``aiter=`` option names; :class:`SourceError` when it is not there."""
    if "/" in spec or spec.startswith("."):
        given = Path(spec).expanduser().resolve()
        package = given if given.name == "aiter" else given / "aiter"
    else:
        package = source_root() / spec / "aiter"
    if not _has_triton_ops(package):
        fetch = "" if "/" in spec else f"; fetch it with scripts/fetch_aiter.sh {spec}"
        raise SourceError(f"aiter={spec}: no AITER package with ops/triton at {package} "
                          f"(names resolve under ${ROOT_ENV}, default {DEFAULT_ROOT}){fetch}")
    return AiterSource(spec, package, _version_of(package), "tree")


def installed_source() -> AiterSource | None:
    """The AITER of this environment (found without importing it), if it has Triton ops."""
    spec = importlib.util.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    if not _has_triton_ops(package):
        return None  # e.g. PyPI's unrelated "aiter"
    version = "unknown"
    for dist in ("amd-aiter", "aiter"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return AiterSource("installed", package, version, "installed")


def wheel_source() -> AiterSource | None:
    """The PyPI wheel setup unpacked into ``<venv>/difftest-aiter``, if it is there."""
    package = Path(sys.prefix) / WHEEL_DIR / "aiter"
    if not _has_triton_ops(package):
        return None
    return AiterSource("wheel", package, _version_of(package), "wheel")


def chosen_source(option: str | None) -> tuple[AiterSource | None, str]:
    """The tree a backend runs and, when there is none, why: the ``aiter=`` option's (a bad
    one raises :class:`SourceError`), else ``$DIFFTEST_AITER``'s, else the installed AITER,
    else the setup's wheel."""
    if option:
        return resolve(option), ""
    spec = os.environ.get(SOURCE_ENV)
    if spec:
        try:
            return resolve(spec), ""
        except SourceError as err:
            return None, f"${SOURCE_ENV}: {err}"
    found = installed_source() or wheel_source()
    if found is None:
        return None, (f"no AITER with Triton ops: none installed, no wheel in "
                      f"{Path(sys.prefix) / WHEEL_DIR} (bash scripts/setup.sh unpacks "
                      f"amd-aiter's wheel there), no aiter= option or ${SOURCE_ENV}")
    return found, ""


def tree_availability(source: AiterSource | None, source_error: str,
                      kernel_files: tuple[str, ...]) -> Availability:
    """Whether an AITER Triton kernel can run here: a tree (``source``, else why none,
    ``source_error``) holding one of ``kernel_files``, and a GPU or the Triton interpreter."""
    if source is None:
        return Availability(False, source_error)
    if source.find(*kernel_files) is None:
        return Availability(False, f"AITER {source.version} at {source.package} "
                            f"has no {' or '.join(kernel_files)}")
    if devices.visible_gpu_count() == 0 and not devices.interpreted():
        return Availability(False, "no GPU and TRITON_INTERPRET is not 1 (difftest sets "
                            "it for --device cpu before Triton is imported)")
    return Availability(True)


def load_aiter_kernel(tree: str | None, device: str, modules: list[str], name: str,
                      arch: str, compute_units: int) -> object:
    """``name`` of the first of AITER's ``modules`` that exists: of the installed ``aiter``,
    or of the tree at ``tree`` (a directory holding ``aiter/``, or that directory), whose
    directories become empty packages so that ``aiter/__init__`` (which needs ROCm) never
    runs. On the CPU (``device == "cpu"``, Triton's interpreter) AITER's questions about the
    GPU are answered as :class:`DeviceAnswers` answers them: Triton's active driver reports
    ``hip/<arch>`` and ``device_info.get_num_sms()`` returns ``compute_units``.
    Self-contained: ``difftest export`` copies it into its scripts
    (:mod:`difftest.contract.exported_call`).
    """
    import importlib
    import importlib.util
    import sys
    import types
    from pathlib import Path

    if not tree and importlib.util.find_spec("aiter") is None:
        raise ImportError("AITER is not installed here: install amd-aiter, or pass --tree DIR "
                          "(a directory holding aiter/, e.g. an unpacked wheel or a checkout)")
    if tree:
        root = Path(tree).expanduser().resolve()
        root = root if root.name == "aiter" else root / "aiter"
        if not (root / "ops" / "triton").is_dir():
            raise ImportError(f"--tree {tree}: no AITER package with ops/triton at {root}")
        for directory in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            package = ".".join(("aiter", *directory.relative_to(root).parts))
            module = types.ModuleType(package)
            module.__path__ = [str(directory)]
            sys.modules[package] = module
    if device == "cpu":
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver

        class Answers:
            def get_current_target(self) -> object:
                return GPUTarget("hip", arch, 64)

            def get_current_device(self) -> int:
                return 0

        driver.set_active(Answers())
        try:
            info = importlib.import_module("aiter.ops.triton.utils.device_info")
            info.get_num_sms = lambda: compute_units
        except ModuleNotFoundError:
            pass  # a release that does not ask
    for module_name in modules:
        try:
            return getattr(importlib.import_module(module_name), name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name):
                raise
    raise ImportError(f"AITER has none of {', '.join(modules)}")
