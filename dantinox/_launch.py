"""Ctrl-C while the ``dantinox`` command is still importing (JAX takes seconds): one line, exit status 130.

The console script runs ``from dantinox.cli import main`` before ``main`` can catch anything, so a Ctrl-C in
those first seconds printed Python's traceback of the import. When this process is the command (its argv[0] is
the ``dantinox`` script, or ``python -m dantinox.cli``) and SIGINT still has Python's default handler,
``guard_imports`` (run when this module is imported, the first thing ``dantinox/__init__.py`` does) installs a
handler that prints "dantinox: interrupted" and ends the process with status 130:
nothing is written while modules import, so nothing can be left half written. ``release_imports`` (called first
thing in ``dantinox.cli.entrypoint.main``) puts Python's handler back, and from there on ``main`` turns a Ctrl-C
into its own one line. A library user's process is never touched.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_COMMANDS = ("dantinox", "dantinox.exe", "dantinox-script.py")


def _is_command() -> bool:
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) in _COMMANDS or argv0.endswith(os.path.join("dantinox", "cli", "__main__.py")):
        return True
    original = list(getattr(sys, "orig_argv", []))  # python -m dantinox.cli: argv[0] is "-m" while it imports
    return any(a == "-m" and b == "dantinox.cli" for a, b in zip(original, original[1:]))


def _quit(signum, frame) -> None:
    try:
        sys.stderr.write("dantinox: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


def guard_imports() -> None:
    """Install the import-time handler when this process is the command (see the module docstring)."""
    if (_is_command() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _quit)


def release_imports() -> None:
    """Python's default SIGINT handler again, if ``guard_imports`` installed its own."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _quit:
        signal.signal(signal.SIGINT, signal.default_int_handler)


guard_imports()
