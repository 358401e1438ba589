"""Two processes with 2 CPU devices each form one (data=2, model=2) mesh; greedy generation and 3 training steps
equal the single-process, single-device run. An unreachable coordinator is one error line, not a hang."""

import json
import os
import socket
import subprocess
import sys

import pytest
from cli_util import run_cli
from distributed_worker import run
from paths import TESTS

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = "nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura " * 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")


@pytest.mark.slow   # two child processes forming one mesh, and the single-process run
@pytest.mark.timeout(600)
def test_two_processes_equal_one_device(tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    want = run(None, str(corpus), str(tmp_path / "single"))
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, os.path.join(TESTS, "distributed_worker.py"), address, str(pid),
                               str(corpus), str(tmp_path / f"proc{pid}")], env=worker_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=500)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for got in results:
        assert got["tokens"] == want["tokens"]
        assert len(got["losses"]) == 3
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= 1e-5, (got, want)


@pytest.mark.slow   # a child process waiting for a coordinator that never answers
@pytest.mark.timeout(120)
def test_unreachable_coordinator_is_one_line_exit_2():
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    proc = run_cli("generate", "--prompt", "Nel", "--coordinator", address, "--num-processes", "2",
                   "--process-id", "1", "--coordinator-timeout", "2", env=worker_env(), timeout=100)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and address in lines[0] and "cannot be reached within 2 s" in lines[0], proc.stderr


def test_incomplete_process_flags():
    from dantinox.cli.entrypoint import main

    assert main(["generate", "--prompt", "Nel", "--num-processes", "2"]) == 2
