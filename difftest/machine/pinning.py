"""One GPU per pytest-xdist worker: the visibility variables each worker process gets.

Pure logic, no runtime: :func:`assign` maps a worker index to the environment that pins it to
one GPU, given the visibility mask the runner already set, the number of GPUs the drivers
report and their vendor. Workers beyond the number of visible GPUs share them round-robin.

Which GPUs a mask leaves visible is :func:`difftest.machine.gpus.visible_gpus`, the runtimes'
reading. Pinning is stricter than the runtimes: where they would silently stop reading a mask
early (an entry past the GPUs that exist, a GPU named twice) or HIP and CUDA masks differ,
and when no GPU is visible with ``--difftest-device cuda``, :func:`assign` raises a
:class:`PinningError` that names the variable. A negative index is the documented end of a
list and is accepted (``CUDA_VISIBLE_DEVICES=-1`` hides every GPU). ``HIP_VISIBLE_DEVICES``
and ``CUDA_VISIBLE_DEVICES`` are always written together, to the same value, because vLLM
refuses to start on ROCm when they differ.

Test hook: ``DIFFTEST_FAKE_GPUS=amd:2`` (or ``nvidia:4``; a bare count means ``amd``) makes
:func:`detect` report that many GPUs without touching any driver. Only the assignment is
faked: a worker pinned this way still computes on the CPU when no real GPU exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from difftest.machine import devices, gpus
from difftest.machine.gpus import VisibilityError, runner_mask

__all__ = ["FAKE_GPUS_ENV", "PinningError", "VisibilityError", "assign", "describe", "detect",
           "runner_mask"]

FAKE_GPUS_ENV = "DIFFTEST_FAKE_GPUS"


class PinningError(VisibilityError):
    """The GPU visibility the runner set cannot be honoured; the message says why."""


def detect(environ: Mapping[str, str] | None = None) -> tuple[str | None, int]:
    """``(vendor, physical GPU count)`` from the driver files, or from the test hook."""
    env = os.environ if environ is None else environ
    fake = env.get(FAKE_GPUS_ENV)
    if fake:
        vendor, _, count = fake.rpartition(":")
        vendor = vendor or "amd"
        if vendor not in gpus.VENDORS or not count.isdigit():
            raise PinningError(f"{FAKE_GPUS_ENV}={fake!r}: expected VENDOR:COUNT with VENDOR "
                               f"one of {', '.join(gpus.VENDORS)} (e.g. amd:2)")
        return (vendor if int(count) else None), int(count)
    return gpus.gpu_vendor(), gpus.physical_gpu_count()


def assign(worker_index: int, n_workers: int, visible_mask: Mapping[str, str],
           physical_count: int, vendor: str | None, device: str = "auto") -> dict[str, str]:
    """The environment that pins worker ``worker_index`` of ``n_workers`` to one GPU.

    Empty when there is nothing to pin: no GPU visible (the worker computes on the CPU) or
    ``device == "cpu"``. Raises :class:`PinningError` on a mask that cannot be honoured,
    and when ``device == "cuda"`` but no GPU is visible.
    """
    if not 0 <= worker_index < n_workers:
        raise PinningError(f"worker index {worker_index} outside 0..{n_workers - 1}")
    if device not in devices.DEVICE_CHOICES:
        raise PinningError(f"--difftest-device {device!r}: allowed "
                           f"{', '.join(devices.DEVICE_CHOICES)}")
    try:
        visible = gpus.visible_gpus(visible_mask, physical_count, vendor)
    except VisibilityError as exc:
        raise PinningError(str(exc)) from exc
    if visible.inconsistency is not None:
        raise PinningError(visible.inconsistency)
    if not visible.entries:
        if device == "cuda":
            where = (", ".join(f"{k}={v!r}" for k, v in visible_mask.items())
                     or "no visibility variable set")
            raise PinningError(f"--difftest-device cuda, but no GPU is visible "
                               f"({physical_count} found by the drivers; {where})")
        return {}
    if device == "cpu":
        return {}
    entry = visible.entries[worker_index % len(visible.entries)]
    return {var: entry for var in visible.variables}


def describe(env: Mapping[str, str]) -> str:
    """``HIP_VISIBLE_DEVICES=1 CUDA_VISIBLE_DEVICES=1``, or ``no GPU (CPU)``."""
    return " ".join(f"{k}={v}" for k, v in env.items()) or "no GPU (CPU)"
