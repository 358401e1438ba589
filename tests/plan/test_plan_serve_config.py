"""``dantinox serve --config``: the plan's serve.yaml sets the serve flags; flags on the command line win."""

import argparse
import socket

import pytest
from cli_util import run_main

from dantinox.cli.serve import add_serve_arguments, apply_config_file
from dantinox.plan.candidate import Candidate
from dantinox.plan.report import serve_config


def _args(*argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_plan_serve_yaml_sets_serve_flags_and_command_line_wins(tmp_path):
    cand = Candidate("c", block_size=32, max_running=8, max_batched_tokens=128, max_decode_steps=4,
                     preemption="swap", prefix_caching=False)
    path = tmp_path / "serve.yaml"
    path.write_text(serve_config(cand.to_dict(), None))
    args = _args("--config", str(path), "--max-running", "12")
    apply_config_file(args)
    assert (args.block_size, args.max_running, args.max_batched_tokens, args.max_decode_steps, args.policy,
            args.no_prefix_caching) == (32, 12, 128, 4, "swap", True)


@pytest.mark.parametrize("text, expected", [
    ("max_runing: 4\n", "unknown key 'max_runing'"),
    ("max_running: four\n", "max_running 'four' is not allowed: an integer"),
    ("policy: evict\n", "policy 'evict' is not allowed: one of recompute, swap"),
    ("- 1\n", "a mapping of serve flags is required"),
])
def test_bad_serve_config_names_the_key(tmp_path, text, expected):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=expected):
        apply_config_file(_args("--config", str(path)))


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.mark.parametrize("text, expected", [
    ("max-running: 0\n", "max-running 0 is not allowed: an integer >= 1"),            # checked before loading
    ("max_batched_tokens: 0\n", "max_batched_tokens 0 is not allowed: an integer >= 1"),
    ("kv-memory: 1KB\n", "kv-memory 1KB: kv memory 1000 bytes holds no block"),      # found by the engine
    ("max-request-bytes: -1MB\n", "max-request-bytes -1MB is not allowed: the size is negative"),
    ("policy: evict\n", "policy 'evict' is not allowed: one of recompute, swap"),
])
def test_a_value_out_of_range_in_the_serve_config_names_the_file_and_the_key(tmp_path, capsys, text, expected):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    status, out, err = run_main(["serve", "--config", str(path), "--port", _free_port()], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"dantinox serve: error: --config {path}: {expected}"), err


def test_a_bad_value_on_the_command_line_is_not_blamed_on_the_config_file(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text("max-running: 4\n")
    status, _, err = run_main(["serve", "--config", str(path), "--port", _free_port(), "--max-queued", "0"], capsys)
    assert status == 2 and err == "dantinox serve: error: --max-queued 0 is not allowed: an integer >= 1\n"
