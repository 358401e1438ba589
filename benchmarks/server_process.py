"""A benchmarked HTTP server in a child process: start it, wait until it is ready, sample its memory, stop it.

``ServerProcess`` starts ``command`` (an argv list) with its output in ``log_path``, polls ``url + ready_path``
until it answers 200 (dantinox serve: GET /ready, 200 once every program is compiled; llama-server: GET
/health, 200 once the model is loaded), and records the seconds from the start to the first HTTP answer of
any status (``listening_s``) and to ready (``ready_s``). While the server lives, a thread sums the resident
set size of the process and all its descendants every ``RSS_PERIOD_S`` seconds and keeps the peak
(``peak_rss_bytes``; None where psutil is not installed). ``stop`` sends SIGINT (both servers shut down
cleanly on it), then SIGKILL after ``STOP_GRACE_S``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time

import httpx

try:
    import psutil
except ImportError:  # optional: the peak memory is then not recorded
    psutil = None

RSS_PERIOD_S = 0.25
POLL_S = 0.25
STOP_GRACE_S = 30.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree_rss(process) -> int:
    """Resident bytes of a psutil.Process and all its descendants (processes gone meanwhile count 0)."""
    total = 0
    for proc in [process, *process.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


class ServerProcess:
    """One server in a child process (see the module docstring). Use as a context manager, or call
    ``start`` and ``stop``."""

    def __init__(self, command: list, url: str, ready_path: str, log_path: str):
        self.command, self.url, self.ready_path, self.log_path = command, url, ready_path, log_path
        self.child = None
        self.listening_s = self.ready_s = None
        self.peak_rss_bytes = None
        self._sampling = threading.Event()
        self._sampler = None

    def start(self, timeout_s: float) -> "ServerProcess":
        """Start the child and wait until ready. Raises RuntimeError (naming the log) if it exits first or is not
        ready within ``timeout_s`` seconds; the child is stopped then."""
        self._log = open(self.log_path, "w")
        started = time.perf_counter()
        self.child = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        if psutil is not None:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampling.set()
            self._sampler.start()
        try:
            self._wait_ready(started, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, started: float, timeout_s: float) -> None:
        with httpx.Client(timeout=5) as client:
            while self.child.poll() is None:
                waited = time.perf_counter() - started
                if waited > timeout_s:
                    raise RuntimeError(f"{self.command[0]} was not ready after {timeout_s:g} s "
                                       f"(--ready-timeout); its log: {self.log_path}")
                try:
                    status = client.get(self.url + self.ready_path).status_code
                except httpx.HTTPError:
                    status = None
                if status is not None and self.listening_s is None:
                    self.listening_s = time.perf_counter() - started
                if status == 200:
                    self.ready_s = time.perf_counter() - started
                    return
                time.sleep(POLL_S)
        raise RuntimeError(f"{self.command[0]} exited with status {self.child.returncode} before it was "
                           f"ready; its log: {self.log_path}")

    def _sample(self) -> None:
        process = psutil.Process(self.child.pid)
        while self._sampling.is_set():
            try:
                rss = tree_rss(process)
            except psutil.Error:
                return
            self.peak_rss_bytes = max(self.peak_rss_bytes or 0, rss)
            time.sleep(RSS_PERIOD_S)

    def stop(self) -> None:
        """SIGINT, then SIGKILL after STOP_GRACE_S; stops the memory sampler. Safe to call twice."""
        self._sampling.clear()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGINT)
            try:
                self.child.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        if self._sampler is not None:
            self._sampler.join()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
