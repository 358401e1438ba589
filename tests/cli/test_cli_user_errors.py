"""Bad input on the command line is one line naming the flag and the value, exit status 2, no traceback:
files that do not exist or are directories, files that are not YAML, and flags named once."""

import socket

import pytest
from cli_util import run_main
from paths import FIXTURES

from dantinox.parallel.mesh import MeshError, mesh_from_flag, naming_flag


def _one_error_line(capsys, argv):
    status, _, err = run_main(argv, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "[Errno" not in lines[0]
    return lines[0]


def test_missing_or_directory_file_names_its_flag(tmp_path, capsys):
    missing = str(tmp_path / "missing.jsonl")
    line = _one_error_line(capsys, ["plan", "--trace", missing, "--slo", "ttft_p99=500", "--device-memory", "1GB"])
    assert line == f"dantinox plan: error: --trace {missing}: no such file"
    line = _one_error_line(capsys, ["plan", "--trace", str(tmp_path), "--slo", "ttft_p99=500",
                                    "--device-memory", "1GB"])
    assert line == f"dantinox plan: error: --trace {tmp_path}: is a directory, not a regular file"
    other = str(tmp_path / "other.json")
    line = _one_error_line(capsys, ["plan", "gate", "--candidate", missing, "--last-good", other])
    assert line == f"dantinox plan: error: --candidate {missing}: no such file"


def test_file_that_is_not_yaml_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("not: [yaml\n")
    line = _one_error_line(capsys, ["budget", "--config", str(bad)])
    assert line == (f"dantinox budget: error: --config {bad}: not valid YAML: expected ',' or ']', but got "
                    "'<stream end>' (line 2, column 1)")


def test_mesh_error_names_the_flag_once():
    with pytest.raises(MeshError) as info:
        with naming_flag("data=3,model=5"):       # as the CLI calls it: the mesh, then the model on it
            mesh_from_flag("data=3,model=5")
    assert str(info.value).count("--mesh 'data=3,model=5'") == 1
    assert "15 devices" in str(info.value)


def test_import_into_an_unwritable_place_names_out(tmp_path, capsys):
    import os
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = str(blocker / "run")                       # its parent is a file: the directory cannot be made
    source = os.path.join(FIXTURES, "parity", "qwen2")
    line = _one_error_line(capsys, ["import", source, "--out", out])
    assert line.startswith(f"dantinox import: error: --out {out}: cannot create the run directory there")
    assert os.listdir(tmp_path) == ["a-file"]                 # no temporary directory left behind


@pytest.mark.parametrize("argv, command, flag", [
    (["generate", "--max_new_tokens", "abc"], "dantinox generate",
     "argument --max_new_tokens: invalid int value: 'abc'"),
    (["serve", "--port", "eighty"], "dantinox serve", "argument --port: invalid int value: 'eighty'"),
    (["plan", "trace", "--out", "t.jsonl", "--requests", "many"], "dantinox plan trace",
     "argument --requests: invalid int value: 'many'"),
    (["generate", "--refresh", "sometimes"], "dantinox generate", "argument --refresh: invalid choice: 'sometimes'"),
    (["generate", "--no-such-flag"], "dantinox generate", "unrecognized arguments: --no-such-flag"),
    (["serve", "--foo", "1"], "dantinox serve", "unrecognized arguments: --foo 1"),
])
def test_a_flag_of_the_wrong_type_is_one_line_not_the_usage(capsys, argv, command, flag):
    from dantinox.cli.entrypoint import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{command}: error: {flag}") and err.rstrip().endswith(f"(see {command} --help)")
    assert "usage:" not in err


def test_typed_values_and_mesh_axes_are_not_rewritten_into_flags(tmp_path, capsys):
    """train has a --data flag; the mesh text data=2,model=4 and the axes in the message stay as they are."""
    from dantinox.cli.flags import in_flags

    data = tmp_path / "text.txt"
    data.write_text("Nel mezzo del cammin di nostra vita\n" * 20)
    line = _one_error_line(capsys, ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "tiny",
                                    "--steps", "1", "--mesh", "data=2,model=4"])
    assert "--mesh 'data=2,model=4'" in line and "data=2 x model=4" in line and "--data 2" not in line
    flags = {"seed": "--seed", "max_new_tokens": "--max_new_tokens"}
    assert in_flags("--set seed=3: seed=3 is not a field", flags, typed=["seed=3"]) == \
        "--set seed=3: seed=3 is not a field"
    assert in_flags("max_new_tokens=0 is not allowed", flags, typed=["seed=3"]) == "--max_new_tokens 0 is not allowed"


def test_train_into_a_file_is_one_line(tmp_path, capsys):
    data, out = tmp_path / "text.txt", tmp_path / "a-file"
    data.write_text("Nel mezzo del cammin\n" * 20)
    out.write_text("x")
    line = _one_error_line(capsys, ["train", "--data", str(data), "--out", str(out), "--steps", "1"])
    assert line == (f"dantinox train: error: --out {out} is a file, not a directory: give the path of a run "
                    "directory (a new one, or one to resume)")
    assert out.read_text() == "x"


@pytest.mark.parametrize("argv, flag, detail", [
    (["generate", "--prompt", "Nel \udcff\udcfe"], "--prompt", "U+DCFF (the byte 0xff, not UTF-8) at character 4"),
    (["generate", "--chat", "\udced\udca0\udc80 hi"], "--chat", "U+DCED (the byte 0xed, not UTF-8) at character 0"),
    (["verify", "--prompt", "ok \ud800"], "--prompt", "U+D800 at character 3"),
])
def test_text_that_is_not_utf8_names_its_flag_and_byte(capsys, argv, flag, detail):
    # bytes that are not UTF-8 on a command line reach Python as lone surrogates, which the tokenizer
    # cannot read (it raised a TypeError traceback; new-user walk-through of 2026-12-04)
    line = _one_error_line(capsys, argv)
    assert line == (f"dantinox {argv[0]}: error: {flag} is not valid Unicode: a lone surrogate {detail}; "
                    "send UTF-8 text")


def test_a_refused_override_and_a_tiny_kv_memory_name_their_flag_as_typed(capsys, tmp_path):
    # new-user walk-through, 2026-12-04: both named library terms the user never typed
    line = _one_error_line(capsys, ["train", "--data", "it-heldout", "--out", str(tmp_path / "r"),
                                    "--set", "dim=-3"])
    assert line == "dantinox train: error: --set dim=-3: ModelConfig.dim=-3 is not allowed: a positive integer"
    with socket.socket() as probe:   # a free port: serve binds before it loads the model
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    line = _one_error_line(capsys, ["serve", "--kv-memory", "1KB", "--port", str(port)])
    assert line.startswith("dantinox serve: error: --kv-memory 1KB: kv memory 1000 bytes holds no block: ")
