"""Ctrl-C (SIGINT), the library side: long loops stop at a point where their state is whole, keep what they did,
and say so; the command line turns any interrupt into one line and exit status 130 (``dantinox.cli.entrypoint``).

Python raises KeyboardInterrupt between two bytecodes of the main thread, which can be in the middle of an update
(the training step's donated buffers assigned but the step counter not yet advanced). A loop that must keep a
consistent state runs under :func:`deferred_interrupts`: the first Ctrl-C only sets a flag, which the loop reads
at the top of each iteration; it then saves what it has (the trainer writes a checkpoint through its normal,
atomic writer) and raises :class:`Interrupted` with a line saying what was kept. A second Ctrl-C raises
KeyboardInterrupt at once, for a user who will not wait; every file dantinox writes is written atomically
(``dantinox.runs.files``), so even then nothing is half written.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from .._launch import interrupt

EXIT_STATUS = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that a library loop handled before stopping. ``detail``: one line saying what was kept (e.g.
    "checkpoint saved at step 37 in runs/mine/checkpoint"). Still a KeyboardInterrupt for callers that catch
    that."""

    def __init__(self, detail: str = ""):
        super().__init__(detail)
        self.detail = detail


class InterruptFlag:
    """Set by the first Ctrl-C under :func:`deferred_interrupts`; ``requested`` is read by the loop."""

    def __init__(self):
        self.requested = False


@contextmanager
def deferred_interrupts():
    """Context manager yielding an :class:`InterruptFlag`: inside it the first SIGINT sets ``requested``
    instead of raising KeyboardInterrupt, and a second one raises KeyboardInterrupt at once. The previous
    handler is restored on exit. Outside the main thread, or when SIGINT is not Python's default handler or
    the command's (``dantinox._launch.interrupt``; ignored, or the caller installed its own), nothing is changed
    and ``requested`` stays False."""
    flag = InterruptFlag()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, interrupt):
        yield flag
        return

    def on_sigint(signum, frame):
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
