"""serve refuses, before its warm-up, a KV pool in host memory that is larger than the memory the host has
available (it would start, its pages taken as blocks fill, and the kernel would kill it under load);
--kv-overcommit starts it anyway with the warning in the start-up line. The host's MemAvailable is simulated."""

import logging
import socket

import pytest
import uvicorn
from cli_util import run_main

from dantinox.cli import serve

# the bundled model's float32 block: 4 layers x (k, v) x 16 tokens x 2 KV heads x 32 x 4 bytes
BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.fixture
def started(monkeypatch, caplog):
    """uvicorn's run replaced by a record of the call (the command returns once it would have served); the log
    goes to caplog (serve's own logging setup would hold on to pytest's captured stderr)."""
    calls = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: calls.append(sockets))
    monkeypatch.setattr(serve, "configure_logging", lambda: None)
    monkeypatch.setattr(serve, "uvicorn_log_config", lambda: None)
    caplog.set_level(logging.INFO, logger="dantinox")
    return calls


def _serve(capsys, available, *flags):
    return run_main(["serve", "--kv-memory", "4MiB", "--no-warmup", "--port", _free_port(), *flags], capsys)


def test_a_pool_larger_than_the_available_memory_is_refused(monkeypatch, capsys, started):
    monkeypatch.setattr(serve, "host_available_bytes", lambda: 1 << 20)
    status, out, err = _serve(capsys, 1 << 20)
    assert 128 * BLOCK_BYTES == 4 << 20          # 4 MiB holds 128 blocks (below the 256 of --max-running 16)
    assert status == 2 and out == "" and started == []
    assert err == ("dantinox serve: error: the KV pool needs 4 MiB of host memory (128 blocks of 16 tokens) and "
                   "this host has 1 MiB available: the server would start and be killed once its blocks fill "
                   "that far; lower --kv-memory or --max-running, or pass --kv-overcommit to start anyway\n")


def test_kv_overcommit_starts_it_with_the_warning(monkeypatch, capsys, started, caplog):
    monkeypatch.setattr(serve, "host_available_bytes", lambda: 1 << 20)
    status, _, err = _serve(capsys, 1 << 20, "--kv-overcommit")
    assert status == 0 and len(started) == 1, err
    assert "warning: the KV pool (4 MiB) is larger than the memory this host has available (1 MiB)" in caplog.text


def test_a_pool_that_fits_starts(monkeypatch, capsys, started, caplog):
    monkeypatch.setattr(serve, "host_available_bytes", lambda: 4 << 20)      # exactly the pool: it fits
    status, _, err = _serve(capsys, 4 << 20)
    assert status == 0 and len(started) == 1, err
    assert "KV cache: 128 blocks" in caplog.text and "warning: the KV pool" not in caplog.text


def test_the_pool_host_bytes_are_its_arrays_bytes():
    from dantinox.cli import entrypoint as cli

    engine, _, _ = serve.build_engine(cli.build_parser().parse_args(["serve", "--kv-memory", "4MiB"]))
    assert serve.pool_host_bytes(engine) == engine.stats()["kv_cache_bytes"] == 128 * BLOCK_BYTES
