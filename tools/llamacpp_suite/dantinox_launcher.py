"""pytest plugin for llama.cpp's server tests: ``ServerProcess`` points at ``dantinox serve`` (run_suite.py).

llama.cpp's ``utils.ServerProcess.start`` launches llama-server with the test's settings; here it makes sure a
``dantinox serve`` runs instead and points the test at it. One server per API key (none, or the key the test
sets) is started on first use and kept for the whole session (a SmolLM2 server takes seconds to load and its
warm-up minutes, where llama.cpp's 260K-parameter test model starts in a blink), so ``stop`` after each test
only forgets the instance. What a launcher translates:
  - ``api_key`` -> ``--api-key``;
  - ``model_alias`` -> the served name is the suite's default alias "tinyllama-2"; the model names the tests
    send (MODEL_ALIASES) are accepted through ``--model-alias``;
  - everything else (context size, slots, templates, seeds, llama.cpp's own models) has no dantinox
    counterpart and is left out: the served model is the run directory given to run_suite.py.
``ServerPreset.load_all`` (which downloads llama.cpp's test models) does nothing, and the ``wget`` module
utils.py imports is a stub. At the end of the session each server gets SIGINT and is waited for.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import types

import requests

sys.modules.setdefault("wget", types.ModuleType("wget"))   # utils.py imports it to fetch llama.cpp's models

import utils  # noqa: E402  (llama.cpp's tests/utils.py, next to this file)

SERVED_NAME = "tinyllama-2"   # ServerPreset.tinyllama2's alias, the suite's default
MODEL_ALIASES = ("tinyllama-2-tool-call", "llama-test-model", "codellama70b", "gpt-3.5-turbo",
                 "gpt-3.5-turbo-instruct", "gpt-4.1", "davinci-002")
START_TIMEOUT_S = 600
_servers: dict[tuple, tuple[subprocess.Popen, int]] = {}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(api_key: str | None) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    command = [sys.executable, "-m", "dantinox.cli", "serve", "--run_dir", os.environ["DANTINOX_SUITE_RUN_DIR"],
               "--host", "127.0.0.1", "--port", str(port), "--model-name", SERVED_NAME]
    for alias in MODEL_ALIASES:
        command += ["--model-alias", alias]
    if api_key:
        command += ["--api-key", api_key]
    extra = os.environ.get("DANTINOX_SUITE_SERVE_FLAGS", "")
    command += [f for f in extra.split("\x1f") if f]
    log = open(f"dantinox-serve-{port}.log", "w")  # noqa: SIM115 (kept open for the server's life)
    print(f"dantinox launcher: {' '.join(command)}", flush=True)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dantinox serve exited with {proc.returncode}; see {log.name}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:   # as utils.py
                return proc, port
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"dantinox serve was not ready within {START_TIMEOUT_S} s; see {log.name}")


def start(self, timeout_seconds: int = utils.DEFAULT_HTTP_TIMEOUT) -> None:
    key = (self.api_key,)
    if key not in _servers or _servers[key][0].poll() is not None:
        _servers[key] = _launch(self.api_key)
    self.server_host, self.server_port = "127.0.0.1", _servers[key][1]
    self.ready = True
    utils.server_instances.add(self)


def stop(self) -> None:
    utils.server_instances.discard(self)


utils.ServerProcess.start = start
utils.ServerProcess.stop = stop
utils.ServerPreset.load_all = staticmethod(lambda: None)


def pytest_unconfigure(config) -> None:
    for proc, _port in _servers.values():
        proc.send_signal(signal.SIGINT)
    for proc, _port in _servers.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
