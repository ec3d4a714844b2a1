"""Interrupts (Ctrl-C's SIGINT, SIGTERM, SIGHUP) as one exception a run can end cleanly on.

Python raises ``KeyboardInterrupt`` for SIGINT and dies silently on SIGTERM and SIGHUP (a
closed terminal, a CI agent that lost its session: status 143 or 129, nothing written, the
case in flight left pending for the next run to report as a crash). Inside
:func:`catching_signals` each becomes :class:`Interrupted`, which carries the signal, so a run
can record the case it was in as interrupted (not as a crash of the backend that happened to
be running), write what it finished as a partial report, say so in one line and exit with the
shell's status for the signal (``128 + signum``: 130, 143, 129).
A signal that lands where Python cannot raise (a garbage-collector callback, a ``__del__``)
stays pending: :func:`raise_pending` raises it at the run's next safe point. Signals after the
first are ignored, so that the run's cleanup is not itself interrupted.
"""

from __future__ import annotations

import signal
import sys
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
        """``SIGINT``, ``SIGTERM`` or ``SIGHUP``."""
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """The status a shell reports for a process this signal ended: ``128 + signum``."""
        return 128 + self.signum


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each ends a run as Ctrl-C does
_pending: list[int] = []


def _raise(signum: int, _frame: FrameType | None) -> None:
    if _pending:  # already ending: Ctrl-C reaches a job both from the terminal and its parent
        return
    _pending.append(signum)
    raise Interrupted(signum)


def raise_pending() -> None:
    """Raise the first signal received inside :func:`catching_signals`, if there was one;
    the loop over cases calls it between cases, so a signal Python had to drop still ends
    the run."""
    if _pending:
        raise Interrupted(_pending[0])


def _quiet_unraisable(previous: object) -> object:
    """An unraisable-exception hook that drops :class:`Interrupted` (it is pending, and
    :func:`raise_pending` raises it) and passes anything else to ``previous``."""
    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            previous(unraisable)  # type: ignore[operator]
    return hook


@contextmanager
def catching_signals() -> Iterator[None]:
    """Within, each of :data:`SIGNALS` raises :class:`Interrupted` (in the main thread), but
    a SIGHUP the process ignores (started under ``nohup``); the previous handlers come back on
    exit. Elsewhere than the main thread it changes nothing."""
    try:  # a SIGHUP that is ignored stays so (nohup: the run outlives its terminal)
        previous = {s: signal.signal(s, _raise) for s in SIGNALS
                    if not (s == signal.SIGHUP and signal.getsignal(s) is signal.SIG_IGN)}
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    unraisable = sys.unraisablehook
    sys.unraisablehook = _quiet_unraisable(unraisable)  # type: ignore[assignment]
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = unraisable
        _pending.clear()
