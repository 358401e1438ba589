"""``dantinox serve --config``: the plan's serve.yaml sets the serve flags; flags on the command line win."""

import argparse

import pytest

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
    ("max_running: four\n", "max_running='four' is not allowed: an integer"),
    ("- 1\n", "a mapping of serve flags is required"),
])
def test_bad_serve_config_names_the_key(tmp_path, text, expected):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=expected):
        apply_config_file(_args("--config", str(path)))
