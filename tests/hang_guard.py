"""A guard against hangs in tests that feed hostile input (catastrophic regexes, alias bombs,
runaway templates).

It is not a speed assertion: the bound is minutes where the guarded work takes milliseconds,
so machine load cannot trip it. What it turns into a clean failure is the regression these
tests exist for — work that would otherwise run for hours (a backtracking regex on 2 MB, an
exponential YAML expansion) and stall the whole suite. CPython's regex engine and the
interpreter both check for signals while they run, so the alarm interrupts either.
"""
from __future__ import annotations

import contextlib
import signal
import threading

#: far above anything the guarded bodies need on any machine
HANG_SECONDS = 120


class Hung(AssertionError):
    """The guarded body ran for HANG_SECONDS: it hangs (or is exponential)."""


@contextlib.contextmanager
def hang_guard(seconds: float = HANG_SECONDS):
    """Fail with :class:`Hung` if the body is still running after ``seconds``.

    Only in the main thread (where pytest and each xdist worker run tests); elsewhere the
    body runs unguarded.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _fire(signum, frame):
        raise Hung(f"still running after {seconds} s: a hang, not slowness")

    previous = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
