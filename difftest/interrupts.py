"""Interrupts (Ctrl-C's SIGINT, SIGTERM) as one exception a run can end cleanly on.

Python raises ``KeyboardInterrupt`` for SIGINT and dies silently on SIGTERM (status 143,
nothing written). Inside :func:`catching_signals` both become :class:`Interrupted`, which
carries the signal, so a run can record the case it was in as interrupted (not as a crash of
the backend that happened to be running), write what it finished as a partial report, say so
in one line and exit with the shell's status for the signal (``128 + signum``: 130, 143).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Interrupted(BaseException):  # like KeyboardInterrupt: not an error
    """The run was asked to stop by ``signum``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def name(self) -> str:
        """``SIGINT`` or ``SIGTERM``."""
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """The status a shell reports for a process this signal ended: ``128 + signum``."""
        return 128 + self.signum


def _raise(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def catching_signals() -> Iterator[None]:
    """Within, SIGINT and SIGTERM raise :class:`Interrupted` (in the main thread); the
    previous handlers come back on exit. Elsewhere than the main thread it changes nothing."""
    try:
        previous = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
