"""The tests' one way of running the ``dantinox`` command: in this process (``main(argv)``, output captured by
pytest's ``capsys``) or as a child process (``python -m dantinox.cli ...`` with this interpreter).

A child inherits this process's environment (so DANTINOX_XLA_CACHE, the run's compilation cache set by
conftest.py, too), runs on the CPU and imports dantinox from this source tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def run_main(argv, capsys) -> tuple[int, str, str]:
    """``dantinox.cli.entrypoint.main(argv)`` in this process: (exit status, stdout, stderr)."""
    from dantinox.cli.entrypoint import main

    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def cli_env(**changes) -> dict:
    """The child's environment: this one, JAX_PLATFORMS=cpu and PYTHONPATH=ROOT, then ``changes`` (a value of
    None removes the variable)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def cli_command(*args) -> list[str]:
    """The command line of ``dantinox ARGS`` run with this interpreter."""
    return [sys.executable, "-m", "dantinox.cli", *map(str, args)]


def run_cli(*args, cwd=None, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``dantinox ARGS`` as a child process to its end; text stdout and stderr captured."""
    return subprocess.run(cli_command(*args), cwd=cwd or ROOT, env=cli_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


def _default_sigint() -> None:
    """SIGINT's default (KeyboardInterrupt) in this process when it inherited SIGINT ignored: a test run started
    in the background by a non-interactive shell (``pytest &``) ignores SIGINT, every child would inherit that,
    and the tests that send Ctrl-C to a child would see it ignored. A Python handler is not inherited (exec
    resets it), so the children start with SIGINT's default action, as from a terminal. Done here, in the
    parent, because a ``preexec_fn`` would fork a multithreaded (JAX) process."""
    if (os.name == "posix" and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def start_cli(*args, cwd=None, env=None, **popen) -> subprocess.Popen:
    """Start ``dantinox ARGS`` as a child process (``popen``: Popen's stdout, stderr, text, ...), with SIGINT's
    default action (``_default_sigint``)."""
    _default_sigint()
    return subprocess.Popen(cli_command(*args), cwd=cwd or ROOT, env=cli_env() if env is None else env, **popen)
