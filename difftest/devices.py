"""Which device a process computes on, decided without starting any GPU runtime.

GPUs are counted from the drivers' sysfs/procfs entries (NVIDIA: ``/proc/driver/nvidia/gpus``;
AMD: KFD topology nodes with a non-zero ``gpu_id``), never through torch, so the pytest
controller and the CLI can choose and pin devices before CUDA or HIP initialises. On a
machine without GPUs the CPU runtime is prepared for vLLM's Triton kernels: they run under
``TRITON_INTERPRET=1`` and need ``CUDA_VISIBLE_DEVICES=""`` set before vLLM is imported.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

DEVICE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda")
_VISIBILITY_VARS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def gpu_vendor() -> str | None:
    """``"nvidia"``, ``"amd"`` or ``None``, from driver files alone."""
    if _nvidia_gpus():
        return "nvidia"
    if _amd_gpus():
        return "amd"
    return None


def _nvidia_gpus() -> int:
    root = Path("/proc/driver/nvidia/gpus")
    return len(list(root.iterdir())) if root.is_dir() else 0


def _amd_gpus() -> int:
    root = Path("/sys/class/kfd/kfd/topology/nodes")
    if not root.is_dir():
        return 0
    count = 0
    for node in root.iterdir():
        gpu_id = node / "gpu_id"
        if gpu_id.is_file() and gpu_id.read_text().strip() not in ("", "0"):
            count += 1
    return count


def visible_mask() -> tuple[str, list[str]] | None:
    """The visibility variable a runner already set and its entries, if any."""
    for var in _VISIBILITY_VARS:
        value = os.environ.get(var)
        if value is not None:
            return var, [v for v in value.split(",") if v.strip()]
    return None


def physical_gpu_count() -> int:
    """GPUs present on the machine (ignores visibility masks)."""
    return _nvidia_gpus() or _amd_gpus()


def visible_gpu_count() -> int:
    """GPUs this process may use: the physical count narrowed by a visibility mask."""
    count = physical_gpu_count()
    mask = visible_mask()
    if mask is not None:
        count = min(count, len(mask[1]))
    return count


def resolve(choice: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``--device`` choice (torch names HIP devices "cuda")."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"--device {choice!r}: allowed {', '.join(DEVICE_CHOICES)}")
    if choice == "auto":
        return "cuda" if visible_gpu_count() > 0 else "cpu"
    return choice


def prepare_runtime(device: str) -> None:
    """Set the environment vLLM's Triton kernels need on ``device``; call before importing vLLM.

    On the CPU, Triton kernels run in the interpreter and vLLM must not see a CUDA device
    (else it disables Triton for want of a driver). The interpreter's numpy warnings on masked
    lanes and empty rows (which the kernels discard) are silenced.
    """
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                module="triton.runtime.interpreter")


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"
