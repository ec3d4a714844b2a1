"""One GPU per pytest-xdist worker: the visibility variables each worker process gets.

Pure logic, no runtime: :func:`assign` maps a worker index to the environment that pins it to
one GPU, given the visibility mask the runner already set, the number of GPUs the drivers
report and their vendor. Workers beyond the number of visible GPUs share them round-robin.

Masks are read the way the runtimes read them:

* NVIDIA: ``CUDA_VISIBLE_DEVICES`` lists physical indices or UUIDs; a worker gets one entry.
* AMD: ``ROCR_VISIBLE_DEVICES`` narrows the physical GPUs first, then ``HIP_VISIBLE_DEVICES``
  (or ``CUDA_VISIBLE_DEVICES``, which HIP also reads) indexes into what is left. A worker gets
  one entry of the innermost mask that is set. ``HIP_VISIBLE_DEVICES`` and
  ``CUDA_VISIBLE_DEVICES`` are always set together, to the same value, because vLLM refuses
  to start on ROCm when they differ.

In either mask a negative index ends the list (``CUDA_VISIBLE_DEVICES=-1`` hides every GPU),
as in the CUDA runtime. Any inconsistency (an entry past the GPUs that exist, a GPU named
twice, HIP and CUDA masks that differ, no GPU visible with ``--difftest-device cuda``) is a
:class:`PinningError` that names the variable.

Test hook: ``DIFFTEST_FAKE_GPUS=amd:2`` (or ``nvidia:4``; a bare count means ``amd``) makes
:func:`detect` report that many GPUs without touching any driver. Only the assignment is
faked: a worker pinned this way still computes on the CPU when no real GPU exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from difftest import devices

FAKE_GPUS_ENV = "DIFFTEST_FAKE_GPUS"
ROCR = "ROCR_VISIBLE_DEVICES"
HIP = "HIP_VISIBLE_DEVICES"
CUDA = "CUDA_VISIBLE_DEVICES"
VISIBILITY_VARS: tuple[str, ...] = (ROCR, HIP, CUDA)
VENDORS: tuple[str, ...] = ("amd", "nvidia")


class PinningError(ValueError):
    """The GPU visibility the runner set cannot be honoured; the message says why."""


@dataclass(frozen=True)
class VisibleGpus:
    """What workers may be pinned to: ``entries`` of the mask written to ``variables``."""

    variables: tuple[str, ...]
    entries: tuple[str, ...]


def runner_mask(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The visibility variables set in ``environ`` (default: this process), by name."""
    env = os.environ if environ is None else environ
    return {var: env[var] for var in VISIBILITY_VARS if var in env}


def detect(environ: Mapping[str, str] | None = None) -> tuple[str | None, int]:
    """``(vendor, physical GPU count)`` from the driver files, or from the test hook."""
    env = os.environ if environ is None else environ
    fake = env.get(FAKE_GPUS_ENV)
    if fake:
        vendor, _, count = fake.rpartition(":")
        vendor = vendor or "amd"
        if vendor not in VENDORS or not count.isdigit():
            raise PinningError(f"{FAKE_GPUS_ENV}={fake!r}: expected VENDOR:COUNT with VENDOR "
                               f"one of {', '.join(VENDORS)} (e.g. amd:2)")
        return (vendor if int(count) else None), int(count)
    return devices.gpu_vendor(), devices.physical_gpu_count()


def _entries(var: str, value: str, available: int) -> tuple[str, ...]:
    """The GPUs ``var=value`` names, checked against the ``available`` GPUs below it."""
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if index < 0:
                break
            if index >= available:
                raise PinningError(f"{var}={value} names GPU {index}, but only {available} "
                                   f"GPU(s) exist below it (indices 0..{available - 1})")
            entry = str(index)
        if entry in entries:
            raise PinningError(f"{var}={value} names GPU {entry} twice")
        entries.append(entry)
    if len(entries) > available:
        raise PinningError(f"{var}={value} names {len(entries)} GPUs, but only {available} "
                           "exist below it")
    return tuple(entries)


def visible_gpus(mask: Mapping[str, str], physical_count: int,
                 vendor: str | None) -> VisibleGpus:
    """The GPUs the runner's ``mask`` leaves visible, and the variables that select them."""
    if vendor is None or physical_count == 0:
        return VisibleGpus((), ())
    if vendor not in VENDORS:
        raise PinningError(f"unknown GPU vendor {vendor!r} (known: {', '.join(VENDORS)})")
    everything = tuple(str(i) for i in range(physical_count))
    if vendor == "nvidia":
        if CUDA in mask:
            return VisibleGpus((CUDA,), _entries(CUDA, mask[CUDA], physical_count))
        return VisibleGpus((CUDA,), everything)
    outer = _entries(ROCR, mask[ROCR], physical_count) if ROCR in mask else everything
    hip, cuda = mask.get(HIP), mask.get(CUDA)
    if hip is not None and cuda is not None:
        hip_entries = _entries(HIP, hip, len(outer))
        if hip_entries != _entries(CUDA, cuda, len(outer)):
            raise PinningError(f"{HIP}={hip} and {CUDA}={cuda} differ; HIP reads both and "
                               "vLLM refuses to start on ROCm unless they match: set one")
        return VisibleGpus((HIP, CUDA), hip_entries)
    inner = hip if hip is not None else cuda
    if inner is not None:
        var = HIP if hip is not None else CUDA
        return VisibleGpus((HIP, CUDA), _entries(var, inner, len(outer)))
    if ROCR in mask:
        return VisibleGpus((ROCR,), outer)
    return VisibleGpus((HIP, CUDA), everything)


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
    visible = visible_gpus(visible_mask, physical_count, vendor)
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
