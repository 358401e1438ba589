"""Bundled models by short name from any directory: --run_dir dante / dante-diffusion, `dantinox models`."""

import pytest
from cli_util import run_cli

from dantinox.cli import entrypoint as cli
from dantinox.runs.bundled import bundled_names, bundled_run_dir, describe_bundled, resolve_run_dir
from dantinox.runs.run_dir import RunDirError, load_run


def test_generate_the_diffusion_model_by_name_from_another_directory(tmp_path):
    done = run_cli("generate", "--run_dir", "dante-diffusion", "--prompt", "Nel mezzo", "--gen_len", "8",
                   "--temperature", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("Nel mezzo") and len(done.stdout) > len("Nel mezzo\n")
    listed = run_cli("models", cwd=tmp_path, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["name", "paradigm", "attention", "parameters", "size", "context", "vocab",
                                "tokenizer"]
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert rows["dante"][1:3] == ["ar", "gqa"] and rows["dante-diffusion"][1:3] == ["diffusion", "gqa"]
    assert "MiB" in rows["dante"]


def test_names_resolve_everywhere_a_run_directory_is_asked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bundled_names() == ["dante", "dante-diffusion"]
    assert resolve_run_dir("dante") == bundled_run_dir("dante") and resolve_run_dir(None) == bundled_run_dir()
    assert load_run("dante-diffusion")[1].paradigm == "diffusion"
    assert cli.main(["budget", "--run_dir", "dante", "--device-memory", "1GB"]) == 0
    assert "dim 192" in capsys.readouterr().out
    with pytest.raises(RunDirError, match="dante, dante-diffusion"):
        load_run("no-such-run")
    (tmp_path / "dante").mkdir()  # an existing path wins over a bundled name
    assert resolve_run_dir("dante") == "dante"
    with pytest.raises(RunDirError, match="has no config.json"):
        load_run("dante")
    sizes = {row["name"]: row["size_mib"] for row in describe_bundled()}
    assert all(0 < size < 8 for size in sizes.values())
