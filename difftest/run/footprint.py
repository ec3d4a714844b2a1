"""The memory a case needs, estimated from its fields before anything is allocated, and the
refusal of a case the device cannot hold (a case-level refusal with the numbers, instead of
an allocation that grows until the machine stops it or a backend error).

The estimate (:func:`footprint`) counts what the framework allocates for a case: the physical
cache once per in-page order the backends read (the layout's buffer,
:meth:`difftest.case.layouts.KVLayout.raw_bytes`), the generated data of the blocks the
requests hold (stored values plus the float32 draws they come from), the reference's scratch
(as the reference states it: :meth:`~difftest.contract.backend.ReferenceBackend.working_bytes`)
and the outputs. It is an upper bound of those allocations; a backend's own scratch is not
counted, so a case that just fits may still run out inside a kernel (reported as that
backend's error).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from difftest.case.spec import Case
from difftest.contract.backend import ReferenceBackend
from difftest.primitives.dtypes import torch_dtype

GIB = float(1 << 30)
HEADROOM = 0.9  # the share of the available memory a case may plan to use


@dataclass(frozen=True)
class Footprint:
    """Bytes a case needs: ``cache`` per in-page order (``orders`` of them), ``data``,
    ``reference`` and ``outputs``."""

    cache: int
    orders: int
    data: int
    reference: int
    outputs: int

    @property
    def total(self) -> int:
        """Every part together."""
        return self.cache * self.orders + self.data + self.reference + self.outputs

    def describe(self) -> str:
        """``9.2 GiB (cache 8.0 GiB x 1 in-page order, data ..., ...)``."""
        return (f"{self.total / GIB:.1f} GiB (cache {self.cache / GIB:.1f} GiB x {self.orders} "
                f"in-page order{'s' if self.orders != 1 else ''}, data {self.data / GIB:.1f} "
                f"GiB, reference {self.reference / GIB:.1f} GiB, outputs "
                f"{self.outputs / GIB:.1f} GiB)")


def footprint(case: Case, orders: int, reference: ReferenceBackend) -> Footprint:
    """The bytes ``case`` needs with ``orders`` in-page orders built and ``reference``
    computing its truth (from its fields only)."""
    itemsize = torch_dtype(case.kv_dtype).itemsize
    cache = case.layout.raw_bytes(case, itemsize)
    held = sum(len(table) for table in case.block_tables)  # an upper bound of the attended
    per_block = case.block_size * case.num_kv_heads * case.head_dim
    data = 2 * held * per_block * (itemsize + 4)  # K and V: stored, and the float32 draws
    outputs = 8 * 4 * case.total_q * case.num_q_heads * case.head_dim
    return Footprint(cache, orders, data, reference.working_bytes(case), outputs)


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Memory free for a case on ``device`` and where the number comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{device} free memory (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable of /proc/meminfo"
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages, "free physical pages (sysconf)"


def refusal(case: Case, device: torch.device, orders: Iterable[str],
            reference: ReferenceBackend, reusable: int = 0) -> str | None:
    """``None`` if ``case`` fits in the memory available on ``device`` (plus ``reusable``
    bytes of buffers the session holds for it) with ``orders`` built and ``reference``
    computing its truth, else why not, with the numbers."""
    need = footprint(case, len(set(orders)), reference)
    free, source = available_bytes(device)
    if need.total <= HEADROOM * (free + reusable):
        return None
    return (f"case refused before any allocation: it needs about {need.describe()}, and "
            f"{device.type} has {(free + reusable) / GIB:.1f} GiB available ({source}"
            f"{f', with {reusable / GIB:.1f} GiB of pooled buffers' if reusable else ''}); "
            f"a case may plan {HEADROOM:.0%} of it. Shrink num_blocks ({case.num_blocks}), "
            "or run it where the memory is (difftest repro on a larger machine)")
