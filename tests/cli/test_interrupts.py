"""Ctrl-C (issue 19, item 5): every command ends with one line on stderr, "dantinox COMMAND: interrupted", and
exit status 130; a loop under ``deferred_interrupts`` finishes its step first; ``train`` keeps a checkpoint of
the last whole step, which resumes; ``serve`` ends cleanly during its warm-up (JAX compiling) and while
listening: no traceback, no segfault. The child-process tests send SIGINT when the child has printed a given
line, never after a sleep."""

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from cli_util import cli_env, start_cli
from run_util import TEXT, make_run

from dantinox import _launch
from dantinox.cli import entrypoint
from dantinox.config import ModelConfig
from dantinox.runs.interrupts import EXIT_STATUS, Interrupted, deferred_interrupts
from dantinox.runs.run_dir import load_run, read_summary
from dantinox.train import checkpoint as ckpt
from dantinox.train.trainer import train

COMMANDS = {"generate": ["generate", "--prompt", "Nel"], "serve": ["serve"], "verify": ["verify"],
            "train": ["train", "--data", "text.txt", "--out", "run"], "eval": ["eval"], "plan": ["plan"],
            "import": ["import", "model.gguf", "--out", "run"], "budget": ["budget", "--preset", "tiny"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_ends_with_one_line_and_130(command, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(entrypoint, "initialize_from_args", interrupted)
    assert entrypoint.main(COMMANDS[command]) == EXIT_STATUS == 130
    out, err = capsys.readouterr()
    assert out == "" and err == f"dantinox {command}: interrupted\n"


def test_what_a_library_kept_is_on_the_same_line(monkeypatch, capsys):
    def interrupted(args):
        raise Interrupted("checkpoint saved at step 7 in run/checkpoint")

    monkeypatch.setattr(entrypoint, "initialize_from_args", interrupted)
    assert entrypoint.main(COMMANDS["train"]) == 130
    assert capsys.readouterr().err == "dantinox train: interrupted: checkpoint saved at step 7 in run/checkpoint\n"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread")
def test_deferred_interrupts_sets_a_flag_then_raises_on_the_second():
    # an earlier test in this worker may have left its own SIGINT handler (deferred_interrupts then changes
    # nothing, by design): start from Python's default handler and restore whatever was there
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _deferred_interrupts_case()
    finally:
        signal.signal(signal.SIGINT, outer)


def _deferred_interrupts_case():
    before = signal.getsignal(signal.SIGINT)
    with deferred_interrupts() as flag:
        assert not flag.requested
        signal.raise_signal(signal.SIGINT)  # the handler runs before the next line
        assert flag.requested
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):  # outside, Ctrl-C is Python's again
        signal.raise_signal(signal.SIGINT)


def test_an_interrupt_inside_a_gc_callback_is_sent_again_not_dropped(monkeypatch):
    # a KeyboardInterrupt raised inside a gc callback (JAX's _xla_gc_callback) is printed as "Exception
    # ignored" and dropped by Python: the command's handler sends SIGINT again instead (walk-through: 2 of 11)
    resent, raised = [], []
    monkeypatch.setattr(_launch.threading, "Timer", lambda delay, fn, args: SimpleNamespace(
        start=lambda: resent.append((delay, fn, args))))

    def callback(phase, info):
        if phase == "start":
            try:
                _launch.interrupt(signal.SIGINT, sys._getframe())
            except KeyboardInterrupt:
                raised.append(phase)

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert not raised and resent == [(0.02, os.kill, (os.getpid(), signal.SIGINT))]
    with pytest.raises(KeyboardInterrupt):   # in ordinary code it is Python's KeyboardInterrupt
        _launch.interrupt(signal.SIGINT, sys._getframe())


def test_train_defers_under_the_commands_handler():
    outer = signal.signal(signal.SIGINT, _launch.interrupt)
    try:
        with deferred_interrupts() as flag:
            signal.raise_signal(signal.SIGINT)
            assert flag.requested      # the step finishes; the trainer then saves a checkpoint
    finally:
        signal.signal(signal.SIGINT, outer)


def _interrupt_at(proc: subprocess.Popen, stream, marker: str, timeout: float = 300, ready=None) -> list[str]:
    """Read ``stream`` line by line until a line holds ``marker`` (and then until ``ready()`` is true, when
    given), then send SIGINT; returns the lines read. Fails if the child ends or ``timeout`` seconds pass
    first."""
    lines, timer = [], threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in iter(stream.readline, ""):
            lines.append(line)
            if marker in line:
                while ready is not None and not ready() and proc.poll() is None:
                    pass
                proc.send_signal(signal.SIGINT)
                return lines
    finally:
        timer.cancel()
    raise AssertionError(f"the child ended (status {proc.wait()}) before printing {marker!r}: {''.join(lines)}")


def _rest(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    return out, err


TRAIN_ARGS = dict(steps=100_000, batch_size=2, seq_len=16, eval_every=1, eval_batches=1, checkpoint_every=0)


@pytest.mark.slow
def test_train_interrupted_saves_a_checkpoint_that_resumes(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT * 20, encoding="utf-8")
    out_dir = tmp_path / "run"
    flags = [f for name, value in TRAIN_ARGS.items() for f in (f"--{name}", value)]
    proc = start_cli("train", "--data", data, "--out", out_dir, "--preset", "tiny", "--no_progress", *flags,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                     env=cli_env(PYTHONUNBUFFERED="1", DANTINOX_XLA_CACHE="off"))
    _interrupt_at(proc, proc.stdout, "step 3/")
    _, err = _rest(proc)
    assert proc.returncode == 130, err
    meta = ckpt.read_checkpoint_meta(out_dir / "checkpoint")
    step = meta["step"]
    assert step >= 3
    assert err.splitlines() == [f"dantinox train: interrupted: checkpoint saved at step {step} in "
                                f"{out_dir / 'checkpoint'}; the same command resumes from there"]
    logs = []
    train(ModelConfig.from_preset("tiny"), data, out_dir, log=logs.append, progress=False,
          **{**TRAIN_ARGS, "steps": step})  # resumes the checkpoint (its arrays load into the state) and ends
    assert f"resumed from {out_dir / 'checkpoint'} at step {step}" in logs
    assert read_summary(out_dir)["steps"] == step
    load_run(out_dir)


def _free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


def _serve(tmp_path, port: int, *flags) -> subprocess.Popen:
    run_dir = make_run(tmp_path / "tiny")
    return start_cli("serve", "--run_dir", run_dir, "--port", port, *flags, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=cli_env(DANTINOX_XLA_CACHE="off"))


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_serve_interrupted_during_warmup(tmp_path):
    proc = _serve(tmp_path, _free_port())
    _interrupt_at(proc, proc.stderr, "warm-up: compiling")   # logged by the engine thread, once listening
    _, err = _rest(proc)
    assert proc.returncode == 130, (proc.returncode, err)  # not -11 / 139 (segfault)
    # the background warm-up may log the end of the compilation under way; nothing else, no traceback
    lines = [line for line in err.splitlines() if "dantinox.serving INFO warm-up " not in line]
    assert lines == ["dantinox serve: interrupted"], err


@pytest.mark.slow
def test_serve_interrupted_while_listening(tmp_path):
    port = _free_port()
    proc = _serve(tmp_path, port, "--no-warmup")
    before = _interrupt_at(proc, proc.stderr, "listening on", ready=lambda: _answers(f"http://127.0.0.1:{port}/health"))
    _, err = _rest(proc)  # uvicorn shuts down gracefully, then the command ends
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.splitlines() == ["dantinox serve: interrupted"], err
    assert sum("listening on" in line or "running on" in line.lower() for line in before) == 1
    assert len(set(before)) == len(before), before  # no start line logged twice


def _jax_loading(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
            return "jaxlib" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or not __import__("os").path.exists("/proc/self/maps"),
                    reason="needs /proc to see the child importing JAX")
def test_interrupted_while_the_command_still_imports():
    """A Ctrl-C in the first seconds, while ``python -m dantinox.cli`` is still importing JAX (seen in the child's
    memory map: jaxlib mapped), is one line and status 130, not the import's traceback (dantinox._launch)."""
    import time

    child = start_cli("generate", "--prompt", "Nel", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _jax_loading(child.pid) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err and err.count("\n") == 1 and err.rstrip().endswith("interrupted"), err
    assert out in ("", "Nel"), out


@pytest.mark.slow
def test_serve_interrupted_with_requests_in_flight_answers_them_in_openai_format(tmp_path):
    """Ctrl-C while a plain and a streamed request still generate, past the grace period (--shutdown-grace 0):
    the plain one gets 503 with OpenAI's error object, the stream ends with an error event and "[DONE]", the
    command exits 130 with its one line and no traceback (it printed two uvicorn tracebacks and answered a bare
    500 before)."""
    port = _free_port()
    run_dir = make_run(tmp_path / "long", max_context=4096)
    proc = start_cli("serve", "--run_dir", run_dir, "--port", port, "--no-warmup", "--shutdown-grace", "0",
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                     env=cli_env(DANTINOX_XLA_CACHE="off"))
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": "Nel mezzo", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    results, streaming = {}, threading.Event()

    def plain():
        results["plain"] = httpx.post(url, json=body, timeout=300)

    def stream():
        lines = []
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as reply:
            for line in reply.iter_lines():
                lines.append(line)
                streaming.set()
        results["stream"] = lines

    try:
        deadline = time.monotonic() + 300
        while not _answers(f"http://127.0.0.1:{port}/health"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        workers = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for w in workers:
            w.start()
        assert streaming.wait(300), "no streamed token"
        proc.send_signal(signal.SIGINT)
        for w in workers:
            w.join(120)
        _, err = _rest(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    after = err.splitlines()[[i for i, line in enumerate(err.splitlines()) if "listening on" in line][0] + 1:]
    assert after == ["dantinox serve: interrupted"], err   # no traceback, no uvicorn error line
    answer = results["plain"]
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/json", answer.text
    assert answer.json()["error"]["type"] == "server_error" and "shutting down" in answer.json()["error"]["message"]
    events = [line[len("data: "):] for line in results["stream"] if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert all(json.loads(e) for e in events[:-1])   # every event whole JSON, none cut
