"""Errors speak the caller's language: a CLI error names the flag as typed (never the Python argument), an
HTTP error names the JSON field (never a command-line flag), and a message about some flags names only those
that were given."""

import re

import pytest
from cli_util import run_main
from run_util import make_run

from dantinox.cli import entrypoint as cli
from dantinox.cli.flags import in_flags, option_names, subcommand_parser
from dantinox.runs.bundled import bundled_run_dir
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.serving.completions import _Service
from dantinox.serving.request import RequestError

TEXT = "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura.\n" * 3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("lang") / "tiny")  # char tokenizer, max_context 64


def _python_names(command: str) -> list[str]:
    """Destinations of the subcommand's options that differ from how the user types them (plus all)."""
    return list(option_names(subcommand_parser(cli.build_parser(), command)))


def _run(argv, capsys) -> str:
    status, out, err = run_main(argv, capsys)
    assert status == 2
    assert out == "" and len(err.strip().splitlines()) == 1, err
    for name in _python_names(argv[0]):
        assert not re.search(rf"(?<![\w.\-]){name}=", err), (name, err)
    return err


@pytest.mark.parametrize("extra,flag", [
    (["--max_new_tokens", "1000"], "--max_new_tokens 1000"),
    (["--temperature", "-1"], "--temperature -1.0"),
    (["--top_p", "1.5"], "--top_p 1.5"),
    (["--top_k", "-2"], "--top_k -2"),
    (["--seed", "-1"], "--seed -1"),
    (["--gen_len", "5"], "--gen_len is only for paradigm='diffusion'"),
    (["--gen_len", "5", "--threshold", "0.5"], "--gen_len and --threshold are only for"),
])
def test_generate_errors_name_the_flag_as_typed(run_dir, extra, flag, capsys):
    err = _run(["generate", "--run_dir", run_dir, "--prompt", "Nel", *extra], capsys)
    assert flag in err, err


def test_generate_unknown_character_suggests_the_cli_flag(run_dir, capsys):
    err = _run(["generate", "--run_dir", run_dir, "--prompt", "Nel ∑"], capsys)
    assert "--unknown replace" in err and "unknown=" not in err


def test_diffusion_error_names_only_the_flags_given(capsys):
    err = _run(["generate", "--run_dir", bundled_run_dir("dante-diffusion"), "--prompt", "Nel", "--top_k", "5"],
               capsys)
    assert "--top_k is only for autoregressive models" in err
    assert "--stream" not in err and "--top_p" not in err


def test_verify_new_tokens_is_named(run_dir, capsys):
    err = _run(["verify", "--run_dir", run_dir, "--new_tokens", "1000"], capsys)
    assert "--new_tokens 1000" in err and "max_new_tokens" not in err


def test_budget_and_serve_errors_name_dashed_flags(capsys):
    assert "--reserve-fraction 2.0" in _run(["budget", "--preset", "tiny", "--reserve-fraction", "2"], capsys)
    assert "--max-running 0" in _run(["serve", "--max-running", "0"], capsys)


def test_http_unknown_character_names_the_json_field_not_a_flag():
    service = _Service(None, train_tokenizer(TEXT, "char"), "tiny", 64, None)
    with pytest.raises(RequestError) as caught:
        service._encode("Nel ∑")
    assert caught.value.field == "prompt"
    message = str(caught.value)
    assert "'prompt'" in message and "token ids" in message
    assert "--" not in message and "unknown=" not in message and "unknown replace" not in message


def test_in_flags_rewrites_only_whole_names():
    flags = {"max_new_tokens": "--max_new_tokens", "dim": "--dim", "unknown": "--unknown"}
    assert in_flags("prompt of 3 tokens + max_new_tokens=5 = 8 exceeds max_context=64", flags) == \
        "prompt of 3 tokens + --max_new_tokens 5 = 8 exceeds max_context=64"
    assert in_flags("ModelConfig.dim=3", flags) == "ModelConfig.dim=3"
    assert in_flags("Pass unknown='replace' to map", flags) == "Pass --unknown replace to map"
    assert in_flags("already --max_new_tokens 5", flags) == "already --max_new_tokens 5"
    assert in_flags("dim is odd", flags) == "--dim is odd" and in_flags("dimension", flags) == "dimension"


def test_empty_prompt_names_the_flag(run_dir, capsys):
    assert "--prompt is empty" in _run(["generate", "--run_dir", run_dir, "--prompt", ""], capsys)
