"""Exit codes of the CLI: every invalid value exits 2 with one line before anything is printed; a reader that
closes the pipe (``| head``) ends the command quietly; the budget table stays aligned when a model does not
fit, with the reason under the table."""

import subprocess

import pytest
from cli_util import start_cli
from run_util import make_run

from dantinox.cli import entrypoint as cli
from dantinox.runs.bundled import bundled_slice_names, resolve_slice_file


@pytest.mark.parametrize("flags,flag", [
    (["--reserve-fraction", "1.5"], "--reserve-fraction 1.5"),
    (["--reserve-fraction", "-0.1"], "--reserve-fraction -0.1"),
    (["--device-memory", "0"], "--device-memory 0 is not allowed"),
    (["--device-memory", "7G"], "--device-memory 7G is not allowed"),
    (["--context", "0"], "--context 0"),
    (["--kv-heads", "0"], "--kv-heads 0"),
    (["--kv-heads", "3"], "--kv-heads 3"),
    (["--kv-latent-dim", "0"], "--kv-latent-dim 0"),
    (["--rope-head-dim", "-1"], "--rope-head-dim -1"),
    (["--gen-len", "0"], "--gen-len 0"),
    (["--gen-len", "600"], "--gen-len 600"),
    (["--dtype", "fp8"], "--dtype 'fp8'"),
])
def test_budget_invalid_values_exit_2_before_any_table(flags, flag, capsys):
    assert cli.main(["budget", "--preset", "reference", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and flag in err, err


def test_budget_table_stays_aligned_when_the_model_does_not_fit(capsys):
    assert cli.main(["budget", "--preset", "reference", "--device-memory", "7MB"]) == 0
    out = capsys.readouterr().out
    block = out.split("Max batch at 7MB")[1].split("\n\n")[0].splitlines()[1:]
    header, rule, rows, notes = block[0], block[1], block[2:6], block[6:]
    assert len(header) == len(rule) and all(len(r) == len(rule) for r in rows), block
    assert all(r.split()[-3:] == ["-", "-", "-"] for r in rows)
    assert len(notes) == 4 and all("does not fit" in n and "7000000 B" in n for n in notes)


def _closed_reader(args: list[str]) -> subprocess.CompletedProcess:
    """Run the CLI with its stdout read by nobody (the reader closed the pipe before the first line)."""
    proc = start_cli(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return subprocess.CompletedProcess(args, proc.wait(timeout=300), "", err)


def test_budget_into_a_closed_pipe_exits_quietly():
    done = _closed_reader(["budget", "--preset", "reference"])
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == cli.SIGPIPE_STATUS


@pytest.mark.slow   # the same check as above through a model's stream (the budget one is the default tier's smoke)
def test_generate_stream_into_a_closed_pipe_exits_quietly(tmp_path):
    run_dir = make_run(tmp_path / "tiny")
    done = _closed_reader(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--stream",
                           "--max_new_tokens", "40"])
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == cli.SIGPIPE_STATUS


def test_models_lists_the_bundled_models_and_slices_by_name(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "dante" in out and "dante-diffusion" in out
    names = bundled_slice_names()
    assert set(names) == {"en-shakespeare", "it-heldout", "rare-latin-occitan"}
    slices_line = next(line for line in out.splitlines() if line.startswith("Bundled quality slices"))
    for name in names:  # every listed name resolves to a file that eval can read
        assert name in slices_line
        with open(resolve_slice_file(name), encoding="utf-8") as f:
            assert len(f.read()) > 1000
