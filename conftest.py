"""Project conftest: the difftest plugin itself is loaded through its pytest11 entry point.

Under ``pytest -n N`` each worker sets ``OMP_NUM_THREADS`` to its share of the cores (unless it
is set), before torch or numpy is imported: torch and numpy's OpenBLAS in the worker take that
many threads, and so do the processes its tests start (``difftest`` CLI runs, nested pytest
runs), which by default took every core while the other workers computed. Their spinning
threads doubled such a process's CPU time on a 2-core machine (the Hypothesis test of
tests/test_crash_and_repro.py, its child alone: 9.9 and 14.6 s beside a busy core, 5.5 and
5.3 s with one thread). The worker's torch threads are unchanged
(:func:`difftest.devices.share_cpu_threads` gives it the same share).

Every test's setup and call run below one large frame, :func:`below_a_large_frame`.
CPython 3.11+ keeps frames in data-stack chunks of 16 KiB, maps a new chunk when a call does not
fit in the current one and unmaps it as soon as that call returns. Where the Triton
interpreter's loops (vLLM's kernels on the CPU) run across a chunk boundary, which depends only
on how deep pytest, Hypothesis and the test put them, every call there maps and unmaps a chunk:
one mutant test made 448,000 mmap/munmap pairs and 675,000 page faults, 3.4 s of system time
in 12.6 s. A frame larger than any 16 KiB chunk holds gets a chunk of its own: its slots plus 1000,
rounded up to 16 KiB times a power of two (CPython's ``push_chunk``). With those just past
128 KiB the chunk is 256 KiB and leaves about 17,000 slots (136 KiB) free, so the phase's calls
stay in it and the chunk is mapped once per phase. Python 3.10 has no chunks (frames are heap
objects): there the frame is one allocation per phase.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from difftest.session import Session


def share_cores_in_workers(environ: MutableMapping[str, str] = os.environ) -> None:
    """In an xdist worker, set ``OMP_NUM_THREADS`` to the cores divided by the workers (at
    least 1), unless it is set (module docstring)."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))


share_cores_in_workers()  # at import: conftests load before any plugin imports torch

# Slots of the large frame (8 bytes each): past 16384 - 1000, so CPython's chunk for it is
# 32768 slots (256 KiB) and ~17,000 stay free for the calls below it.
LARGE_FRAME_SLOTS = 2**14 - 1000 + 16


def _call(phase: Callable[[], None]) -> None:
    phase()


below_a_large_frame: Callable[[Callable[[], None]], None] = types.FunctionType(
    _call.__code__.replace(co_stacksize=LARGE_FRAME_SLOTS), globals(), "below_a_large_frame")
below_a_large_frame.__doc__ = "``phase()``, called from a frame of ``LARGE_FRAME_SLOTS`` slots."


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run each item's setup and call below a large frame (module docstring)."""
    for item in items:
        for name in ("setup", "runtest"):
            phase = getattr(item, name)
            setattr(item, name, lambda phase=phase: below_a_large_frame(phase))


@pytest.fixture(scope="session")
def device_name(difftest_session: Session) -> str:
    """The device this test process runs kernels on (``cpu`` or ``cuda``).

    Tests that start a CLI run or a session in-process pass it on instead of ``cpu``: the CPU
    runtime (``TRITON_INTERPRET=1``, no visible CUDA device) lasts for the whole process, so
    a GPU worker that prepared it once would interpret every later kernel.
    """
    return difftest_session.device.type
