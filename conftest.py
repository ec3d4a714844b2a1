"""Project conftest: the difftest plugin itself is loaded through its pytest11 entry point.

Here: each xdist worker's share of the cores (``OMP_NUM_THREADS``), a wall-clock limit on every
test, and every test phase run below one large frame. docs/performance.md#the-test-processes
says why each is there and what it saved.
"""

from __future__ import annotations

import os
import signal
import types
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from difftest.run.session import Session


def share_cores_in_workers(environ: MutableMapping[str, str] = os.environ) -> None:
    """In an xdist worker, set ``OMP_NUM_THREADS`` to the cores divided by the workers (at
    least 1), unless it is set."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))


share_cores_in_workers()  # at import: conftests load before any plugin imports torch

# Slots of the large frame (8 bytes each): past 16384 - 1000, so CPython's chunk for it is
# 32768 slots (256 KiB) and ~17,000 stay free for the calls below it (docs/performance.md).
LARGE_FRAME_SLOTS = 2**14 - 1000 + 16


def _call(phase: Callable[[], None]) -> None:
    phase()


below_a_large_frame: Callable[[Callable[[], None]], None] = types.FunctionType(
    _call.__code__.replace(co_stacksize=LARGE_FRAME_SLOTS), globals(), "below_a_large_frame")
below_a_large_frame.__doc__ = "``phase()``, called from a frame of ``LARGE_FRAME_SLOTS`` slots."


# The longest a test's setup or call may run, in seconds (DIFFTEST_TEST_TIME_LIMIT; 0: none).
# The slowest test of the CPU suite takes 75-100 s on 2 cores: a wide margin for a loaded box.
TEST_TIME_LIMIT_ENV = "DIFFTEST_TEST_TIME_LIMIT"
DEFAULT_TEST_TIME_LIMIT = 600.0


class TimeLimitExceeded(BaseException):
    """A test phase ran past the limit. A BaseException, so that Hypothesis neither counts it
    as a failing example nor starts shrinking: the test stops at once and fails with this."""


def time_limit_from_env(environ: MutableMapping[str, str] = os.environ) -> float:
    """The per-phase limit in seconds from ``DIFFTEST_TEST_TIME_LIMIT`` (0 turns it off)."""
    text = environ.get(TEST_TIME_LIMIT_ENV, str(DEFAULT_TEST_TIME_LIMIT))
    try:
        limit = float(text)
    except ValueError:
        limit = -1.0
    if not limit >= 0:
        raise pytest.UsageError(f"{TEST_TIME_LIMIT_ENV}={text!r} is not a number of seconds "
                                "(allowed: >= 0; 0 turns the limit off)")
    return limit


def within_time_limit(phase: Callable[[], None], limit: float, what: str) -> None:
    """``phase()``, stopped with :class:`TimeLimitExceeded` after ``limit`` seconds."""
    if limit <= 0 or not hasattr(signal, "setitimer"):
        phase()
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeLimitExceeded(f"{what} ran past {limit:g} s ({TEST_TIME_LIMIT_ENV}; "
                                    "a search without a bound, or a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        phase()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run each item's setup and call below a large frame, each within the time limit."""
    limit = time_limit_from_env()
    for item in items:
        for name in ("setup", "runtest"):
            phase = getattr(item, name)
            what = f"{item.nodeid} ({name})"

            def bounded(phase: Callable[[], None] = phase, what: str = what) -> None:
                below_a_large_frame(lambda: within_time_limit(phase, limit, what))

            setattr(item, name, bounded)


@pytest.fixture(scope="session")
def device_name(difftest_session: Session) -> str:
    """The device this test process runs kernels on (``cpu`` or ``cuda``).

    Tests that start a CLI run or a session in-process pass it on instead of ``cpu``: the CPU
    runtime (``TRITON_INTERPRET=1``, no visible CUDA device) lasts for the whole process, so
    a GPU worker that prepared it once would interpret every later kernel.
    """
    return difftest_session.device.type
