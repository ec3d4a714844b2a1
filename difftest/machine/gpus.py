"""The GPUs of this machine and the ones a process may use, known without starting a runtime.

The one reader of the drivers' files and of the GPU visibility variables; devices, pinning
and fingerprints all ask this module, so they cannot disagree about what is visible.

GPUs are counted from the drivers' sysfs/procfs entries (NVIDIA: ``/proc/driver/nvidia/gpus``;
AMD: KFD topology nodes with a non-zero ``gpu_id``), never through torch, so the pytest
controller and the CLI can choose and pin devices before CUDA or HIP initialises.

Masks are read the way the runtimes read them (:func:`visible_gpus`):

* NVIDIA: ``CUDA_VISIBLE_DEVICES`` lists physical indices or UUIDs (``GPU-…``, ``MIG-…``).
* AMD: ``ROCR_VISIBLE_DEVICES`` narrows the physical GPUs first, then ``HIP_VISIBLE_DEVICES``
  (or ``CUDA_VISIBLE_DEVICES``, which HIP also reads) indexes into what is left.

As in the CUDA runtime, the list ends at its first invalid entry: a negative index (so
``CUDA_VISIBLE_DEVICES=-1`` hides every GPU), an index past the GPUs below the mask, or a GPU
named twice. An empty value hides every GPU. An entry that is neither an index nor a UUID is
a :class:`VisibilityError` naming the variable and its value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROCR = "ROCR_VISIBLE_DEVICES"
HIP = "HIP_VISIBLE_DEVICES"
CUDA = "CUDA_VISIBLE_DEVICES"
VISIBILITY_VARS: tuple[str, ...] = (ROCR, HIP, CUDA)
VENDORS: tuple[str, ...] = ("amd", "nvidia")
UUID_PREFIXES: tuple[str, ...] = ("GPU-", "MIG-")
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")
KFD_NODES_DIR = Path("/sys/class/kfd/kfd/topology/nodes")
_INDEX = re.compile(r"-?[0-9]+")


class VisibilityError(ValueError):
    """A GPU visibility variable holds something no runtime could read; the message says what."""


@dataclass(frozen=True)
class VisibleGpus:
    """The GPUs a mask leaves visible: ``entries`` of the mask written to ``variables``.

    ``inconsistency`` says why the runtime stopped reading the mask early, or why two masks
    disagree (``None`` when the mask reads cleanly); the runtime still uses ``entries``.
    """

    variables: tuple[str, ...]
    entries: tuple[str, ...]
    inconsistency: str | None = None


def _nvidia_gpus() -> int:
    return len(list(NVIDIA_GPUS_DIR.iterdir())) if NVIDIA_GPUS_DIR.is_dir() else 0


def _amd_gpus() -> int:
    if not KFD_NODES_DIR.is_dir():
        return 0
    count = 0
    for node in KFD_NODES_DIR.iterdir():
        gpu_id = node / "gpu_id"
        if gpu_id.is_file() and gpu_id.read_text().strip() not in ("", "0"):
            count += 1
    return count


def gpu_vendor() -> str | None:
    """``"nvidia"``, ``"amd"`` or ``None``, from driver files alone."""
    if _nvidia_gpus():
        return "nvidia"
    if _amd_gpus():
        return "amd"
    return None


def physical_gpu_count() -> int:
    """GPUs present on the machine (ignores visibility masks)."""
    return _nvidia_gpus() or _amd_gpus()


def runner_mask(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The visibility variables set in ``environ`` (default: this process), by name."""
    env = os.environ if environ is None else environ
    return {var: env[var] for var in VISIBILITY_VARS if var in env}


def _read_mask(var: str, value: str, available: int) -> tuple[tuple[str, ...], str | None]:
    """The GPUs ``var=value`` names among ``available`` ones, and why reading stopped early."""
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if _INDEX.fullmatch(entry):
            index = int(entry)
            if index < 0:
                return tuple(entries), None
            if index >= available:
                exist = (f"only {available} GPU(s) exist below it (indices 0..{available - 1})"
                         if available else "no GPU is left visible below it")
                return tuple(entries), f"{var}={value} names GPU {index}, but {exist}"
            entry = str(index)
        elif not entry.startswith(UUID_PREFIXES):
            raise VisibilityError(f"{var}={value!r}: entry {entry!r} is neither a GPU index "
                                  f"nor a UUID starting with {' or '.join(UUID_PREFIXES)}")
        if entry in entries:
            return tuple(entries), f"{var}={value} names GPU {entry} twice"
        entries.append(entry)
    if len(entries) > available:
        return tuple(entries[:available]), (f"{var}={value} names {len(entries)} GPUs, but "
                                            f"only {available} exist below it")
    return tuple(entries), None


def visible_gpus(mask: Mapping[str, str], physical_count: int,
                 vendor: str | None) -> VisibleGpus:
    """The GPUs the runner's ``mask`` leaves visible, and the variables that select them."""
    if vendor is None or physical_count == 0:
        return VisibleGpus((), ())
    if vendor not in VENDORS:
        raise VisibilityError(f"unknown GPU vendor {vendor!r} (known: {', '.join(VENDORS)})")
    everything = tuple(str(i) for i in range(physical_count))
    if vendor == "nvidia":
        if CUDA in mask:
            return VisibleGpus((CUDA,), *_read_mask(CUDA, mask[CUDA], physical_count))
        return VisibleGpus((CUDA,), everything)
    outer, outer_problem = (_read_mask(ROCR, mask[ROCR], physical_count) if ROCR in mask
                            else (everything, None))
    if HIP not in mask and CUDA not in mask:
        return VisibleGpus((ROCR,) if ROCR in mask else (HIP, CUDA), outer, outer_problem)
    inner = HIP if HIP in mask else CUDA
    entries, problem = _read_mask(inner, mask[inner], len(outer))
    if inner == HIP and CUDA in mask:
        cuda_entries, cuda_problem = _read_mask(CUDA, mask[CUDA], len(outer))
        if cuda_entries != entries:
            problem = (f"{HIP}={mask[HIP]} and {CUDA}={mask[CUDA]} differ; HIP reads {HIP}, "
                       "and vLLM refuses to start on ROCm unless they match: set one")
        problem = problem or cuda_problem
    return VisibleGpus((HIP, CUDA), entries, outer_problem or problem)


def visible_in_this_process() -> VisibleGpus:
    """The GPUs this process's runtime would see, from its environment and the drivers."""
    return visible_gpus(runner_mask(), physical_gpu_count(), gpu_vendor())


def visible_gpu_count() -> int:
    """How many GPUs this process may use."""
    return len(visible_in_this_process().entries)
