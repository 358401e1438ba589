"""Ctrl-C while the ``dantinox`` command is still importing (JAX takes seconds): one line, exit status 130.

The console script runs ``from dantinox.cli import main`` before ``main`` can catch anything, so a Ctrl-C in
those first seconds printed Python's traceback of the import. When this process is the command (its argv[0] is
the ``dantinox`` script, or ``python -m dantinox.cli``) and SIGINT still has Python's default handler,
``guard_imports`` (run when this module is imported, the first thing ``dantinox/__init__.py`` does) installs a
handler that prints "dantinox: interrupted" and ends the process with status 130:
nothing is written while modules import, so nothing can be left half written. ``release_imports`` (called first
thing in ``dantinox.cli.entrypoint.main``) installs ``interrupt``, which raises KeyboardInterrupt as Python's
handler does, and from there on ``main`` turns a Ctrl-C into its own one line; ``guard_exit`` (when ``main`` is
done) puts the import-time handler back for the interpreter's last moments. A library user's process is never
touched.

A KeyboardInterrupt raised inside a garbage-collector callback (JAX registers one) or a ``__del__`` is printed
as "Exception ignored" and dropped by Python, so a Ctrl-C landing there was lost and the command ran on (2 of
11 tries while a model loaded, new-user walk-through). ``interrupt`` therefore does not raise there: it sends
SIGINT again 20 ms later, when the interpreter is back in ordinary code.
"""

from __future__ import annotations

import gc
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


def interrupt(signum, frame) -> None:
    """SIGINT handler of the command: KeyboardInterrupt, unless ``frame`` is inside a place where Python drops
    it (a gc callback or a ``__del__``): then SIGINT is sent again 20 ms later (module docstring)."""
    if _dropped_here(frame):
        threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    raise KeyboardInterrupt


def _dropped_here(frame) -> bool:
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def release_imports() -> None:
    """``interrupt`` as the SIGINT handler, if ``guard_imports`` installed its own."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _quit:
        signal.signal(signal.SIGINT, interrupt)


def guard_exit() -> None:
    """The import-time handler again once the command's work is done (a Ctrl-C while the interpreter exits
    then gives the same one line and status 130), if ``release_imports`` installed ``interrupt``."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is interrupt:
        signal.signal(signal.SIGINT, _quit)


guard_imports()
