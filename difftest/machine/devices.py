"""Which device a process computes on, decided without starting any GPU runtime.

``--device auto`` computes on a GPU when :mod:`difftest.machine.gpus` (the one reader of the
drivers' files and the visibility variables) finds one visible to this process. On a machine
without GPUs the CPU runtime is prepared for vLLM's Triton kernels: they run under
``TRITON_INTERPRET=1`` and need ``CUDA_VISIBLE_DEVICES=""`` set before vLLM is imported.
The GPU counts are re-exported for the backends that choose a kernel by vendor;
:func:`to_device` moves host tensors onto a GPU without waiting for its queued work.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from difftest.machine.gpus import gpu_vendor, physical_gpu_count, visible_gpu_count

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_CHOICES", "amd_arch", "gpu_vendor", "interpreted", "physical_gpu_count",
           "prepare_runtime", "resolve", "to_device", "visible_gpu_count"]

DEVICE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda")


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
    lanes and empty rows (which the kernels discard) are silenced; its re-patching of
    ``triton.language`` on nested calls and its overflow conditions that nothing checks are
    skipped, fp8 NaN/Inf bytes convert to NaN/Inf as on a GPU, and the interpreter's pure
    per-op lookups and conversions are computed once per argument
    (:mod:`difftest.machine.interpreter`). On either device Triton keeps compiled kernels
    where ``DIFFTEST_KERNEL_CACHE`` says
    (:func:`difftest.machine.kernel_compiles.use_kernel_cache`).
    """
    from difftest.machine.kernel_compiles import use_kernel_cache

    use_kernel_cache()
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                module="triton.runtime.interpreter")
        from difftest.machine.interpreter import (
            decode_fp8_specials,
            reuse_pure_results,
            reuse_shape_checks,
            skip_dropped_overflow_checks,
            skip_nested_patching,
        )

        skip_nested_patching()
        skip_dropped_overflow_checks()
        decode_fp8_specials()
        reuse_pure_results()
        reuse_shape_checks()


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def amd_arch(device: torch.device) -> str | None:
    """The gfx architecture of an AMD GPU ``device`` (``gcnArchName`` without its feature
    flags, e.g. ``gfx942``); ``None`` on the CPU or another vendor's GPU."""
    if device.type != "cuda" or gpu_vendor() != "amd":
        return None
    import torch

    return str(torch.cuda.get_device_properties(device).gcnArchName).split(":")[0]


def share_cpu_threads(processes: int) -> int:
    """Give this process its share of the CPU cores for torch's intra-op threads, when
    ``processes`` processes run side by side (xdist workers, benchmark workers): two torch
    threads per worker on a 2-core runner oversubscribe it. An explicit ``OMP_NUM_THREADS``
    wins. Returns the thread count in use."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, processes)))
    return torch.get_num_threads()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; to a GPU through pinned memory, without blocking: a copy from
    pageable memory first waits for all the work queued on the device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
