"""`dantinox serve` start-up: a port in use is reported before the model loads (one line, exit 2); the log
holds dantinox's and uvicorn's lines, not JAX's INFO line about a missing TPU library."""

import socket
import subprocess
import time

import pytest
from cli_util import cli_env, start_cli
from run_util import make_run

from dantinox.cli import entrypoint as cli
from dantinox.cli import serve as serve_cli


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_port_in_use_is_reported_before_loading(monkeypatch, capsys):
    def must_not_load(args):
        raise AssertionError("the model was loaded although the port is in use")

    monkeypatch.setattr(serve_cli, "build_engine", must_not_load)
    busy = _listening_socket()
    try:
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    finally:
        busy.close()
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert f"--port {port} is in use" in err


def test_unresolvable_host_names_the_flag():
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid'"):
        serve_cli.bind_address("no-such-host.invalid", 8000)


def test_start_up_log_has_no_tpu_line(tmp_path):
    run_dir = make_run(tmp_path / "tiny")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    env = cli_env(JAX_PLATFORMS=None)  # JAX probes its backends as on a user's machine
    proc = start_cli("serve", "--run_dir", run_dir, "--port", port, "--no-warmup", stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, env=env, cwd=tmp_path, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                break
    finally:
        proc.terminate()
        proc.wait(60)
    text = "".join(lines)
    assert "listening on http://127.0.0.1:" in text and "KV cache:" in text, text
    assert "tpu" not in text.lower(), text
