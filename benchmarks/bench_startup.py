"""Start-up of `dantinox serve` and `dantinox generate --chat / --prompt`, cold and warm compilation cache.

Each measurement is a fresh process. "cold" points DANTINOX_XLA_CACHE at a new empty directory, "warm" runs
the same command again on the directory the cold run filled. Reported, in seconds from the process start:
  serve:  listening (the "listening on" log line), first answer (a 16-token greedy chat completion, or a plain
          completion for a model without a chat template, sent as soon as the server listens, answered in
          full), ready (GET /ready answers 200: the background warm-up has compiled every program; only with
          --wait-ready, it can take minutes cold) and the warm-up's own figures from its last log line;
  chat / prompt: loaded and warmed up (the "loaded and warmed up" line: the first token follows after one
          prefill), for chat (run with --stream) the first token (the answer's first byte on stdout), and the
          whole command (16 new tokens).

Run:  python benchmarks/bench_startup.py [--run_dir R] [--rounds 1] [--what serve,chat,prompt] [--wait-ready]
It prints one markdown table; say the load average (printed) when you quote it: on a shared host the other
processes' load stretches every figure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

MESSAGE = "What is the capital of France?"
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Lines:
    """Read a process's stream in a thread; remember when each line arrived (seconds from ``start``)."""

    def __init__(self, stream, start: float):
        self.lines: list[tuple[float, str]] = []
        self.start = start
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.perf_counter() - self.start, line.rstrip("\n")))

    def when(self, pattern: str, timeout: float, proc: subprocess.Popen) -> tuple[float, str] | None:
        """(seconds, line) of the first line matching ``pattern``; None if the process ends or time runs out."""
        deadline = time.perf_counter() + timeout
        seen = 0
        while time.perf_counter() < deadline:
            for t, line in self.lines[seen:]:
                if re.search(pattern, line):
                    return t, line
            seen = len(self.lines)
            if proc.poll() is not None and seen == len(self.lines):
                return None
            time.sleep(0.02)
        return None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dantinox.cli", *args]


def measure_serve(run_dir: str | None, cache: str, wait_ready: bool, timeout: float) -> dict:
    """Seconds to listening, to the first answer and (wait_ready) to ready, for one `dantinox serve` process."""
    port = _free_port()
    env = dict(os.environ, DANTINOX_XLA_CACHE=cache, PYTHONUNBUFFERED="1")
    args = ["serve", "--port", str(port)] + (["--run_dir", run_dir] if run_dir else [])
    start = time.perf_counter()
    proc = subprocess.Popen(_cli(*args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = _Lines(proc.stderr, start)
    out: dict = {}
    try:
        listening = log.when("listening on", timeout, proc)
        if listening is None:
            raise RuntimeError("serve did not listen: " + "\n".join(line for _, line in log.lines[-20:]))
        out["listening"] = listening[0]
        url = f"http://127.0.0.1:{port}"
        chat = "no chat template" not in "\n".join(line for _, line in log.lines)
        path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": MESSAGE}]}) if chat
                      else ("/v1/completions", {"prompt": PROMPT}))
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        answer = httpx.post(url + path, json={"model": model, "max_tokens": 16, "temperature": 0, **body},
                            timeout=timeout)
        answer.raise_for_status()
        out["first answer"] = time.perf_counter() - start
        if wait_ready:
            while httpx.get(url + "/ready", timeout=30).status_code != 200:
                if time.perf_counter() - start > timeout:
                    raise RuntimeError("serve did not get ready in time")
                time.sleep(0.2)
            out["ready"] = time.perf_counter() - start
            done = log.when("warm-up done", 30, proc)
            out["warm-up"] = done[1].split("warm-up done: ")[-1] if done else ""
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def measure_generate(run_dir: str | None, cache: str, mode: str, timeout: float) -> dict:
    """Seconds to "loaded and warmed up", to the first byte of the answer on stdout (chat runs with --stream, so
    that is its first token; --prompt prints the prompt first, so it has no such figure) and to the end of one
    `dantinox generate --chat/--prompt` process."""
    env = dict(os.environ, DANTINOX_XLA_CACHE=cache, PYTHONUNBUFFERED="1")
    flag = ["--chat", MESSAGE, "--stream"] if mode == "chat" else ["--prompt", PROMPT]
    args = ["generate", *flag, "--max_new_tokens", "16", "--temperature", "0"] + (
        ["--run_dir", run_dir] if run_dir else [])
    start = time.perf_counter()
    proc = subprocess.Popen(_cli(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, first = _Lines(proc.stderr, start), {}

    def first_byte() -> None:
        if proc.stdout.read(1):
            first["at"] = time.perf_counter() - start
        proc.stdout.read()
    reader = threading.Thread(target=first_byte, daemon=True)
    reader.start()
    warmed = log.when("loaded and warmed up", timeout, proc)
    proc.wait(timeout)
    reader.join(timeout)
    if warmed is None or proc.returncode != 0:
        raise RuntimeError(f"generate {mode} failed: " + "\n".join(line for _, line in log.lines[-20:]))
    out = {"warmed up": warmed[0]}
    if mode == "chat" and "at" in first:
        out["first token"] = first["at"]
    return {**out, "whole command": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default=None, help="run directory (default: the bundled model)")
    parser.add_argument("--rounds", type=int, default=1, help="cold + warm pairs, each on a fresh cache")
    parser.add_argument("--what", default="serve,chat,prompt")
    parser.add_argument("--wait-ready", action="store_true", help="also time serve until GET /ready is 200")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    rows = []
    for _ in range(args.rounds):
        for what in args.what.split(","):
            cache = tempfile.mkdtemp(prefix="dantinox-xla-bench-")
            try:
                for state in ("cold", "warm"):
                    load = os.getloadavg()[0]
                    if what == "serve":
                        got = measure_serve(args.run_dir, cache, args.wait_ready, args.timeout)
                    else:
                        got = measure_generate(args.run_dir, cache, what, args.timeout)
                    rows.append((what, state, load, got))
                    print(f"# {what} {state}: {got} (load average {load:.2f})", file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    print("| command | cache | load avg (1 min) at start | seconds from process start |")
    print("|---|---|---|---|")
    for what, state, load, got in rows:
        figures = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in got.items())
        print(f"| {what} | {state} | {load:.2f} | {figures} |")


if __name__ == "__main__":
    main()
