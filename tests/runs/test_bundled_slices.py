"""The three quality slices ship inside the package and are found by name (issue 19 item 8): ``eval --slice
NAME`` / ``NAME=SLICE``, ``plan --slice NAME=SLICE`` and ``plan trace --rare-file SLICE``; a path still works, an
existing path wins over a name, and an unknown name is one line listing the bundled names."""

import json
import os
import re
import shutil

import pytest
from paths import REPO

from dantinox.cli import entrypoint as cli
from dantinox.cli.eval import parse_slices, resolve_slice_specs
from dantinox.runs.bundled import bundled_root, bundled_slice_names, resolve_slice_file

NAMES = ["en-shakespeare", "it-heldout", "rare-latin-occitan"]
LISTED = "(bundled: en-shakespeare, it-heldout, rare-latin-occitan)"


def one_error_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_slices_are_package_data():
    assert bundled_slice_names() == NAMES
    sizes = {n: os.path.getsize(resolve_slice_file(n)) for n in NAMES}
    assert sizes == {"en-shakespeare": 19996, "it-heldout": 54366, "rare-latin-occitan": 1182}
    rare = open(resolve_slice_file("rare-latin-occitan"), encoding="utf-8").read()
    assert "Tan m'abellis vostre cortes deman" in rare and rare.count("\n") == 33   # Purgatorio XXVI, 140
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        assert 'dantinox = ["bundled/*/*"]' in f.read()           # so a wheel (pip install .) carries them
    assert os.path.dirname(resolve_slice_file("it-heldout")) == os.path.join(bundled_root(), "slices")


def test_a_path_wins_over_a_name_and_unknown_names_are_listed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "it-heldout").write_text("mine\n", encoding="utf-8")
    assert resolve_slice_file("it-heldout") == "it-heldout"
    with pytest.raises(FileNotFoundError, match=re.escape(f"nope: no such file, and not a bundled slice {LISTED}")):
        resolve_slice_file("nope")
    assert resolve_slice_specs(["rare=rare-latin-occitan", "en-shakespeare"]) == [
        ("rare", resolve_slice_file("rare-latin-occitan")), ("en-shakespeare", resolve_slice_file("en-shakespeare"))]
    texts = parse_slices(["rare-latin-occitan", f"mine={tmp_path / 'it-heldout'}"])
    assert texts["mine"] == "mine\n" and texts["rare-latin-occitan"].startswith(
        open(resolve_slice_file("rare-latin-occitan"), encoding="utf-8").read()[:40])


def test_plan_trace_takes_the_rare_file_by_name(tmp_path, capsys):
    copy = tmp_path / "rare.txt"
    shutil.copyfile(resolve_slice_file("rare-latin-occitan"), copy)
    traces = []
    for rare in ("rare-latin-occitan", str(copy)):
        out = tmp_path / f"t{len(traces)}.jsonl"
        assert cli.main(["plan", "trace", "--out", str(out), "--requests", "60", "--rate", "8",
                         "--rare-file", rare]) == 0
        traces.append(out.read_bytes())
    assert traces[0] == traces[1]
    rare_prompts = [r["prompt"] for r in map(json.loads, traces[0].decode().splitlines()) if r["slice"] == "rare"]
    assert rare_prompts and all(p in open(copy, encoding="utf-8").read() for p in rare_prompts)
    capsys.readouterr()
    line = one_error_line(capsys, ["plan", "trace", "--out", str(tmp_path / "x.jsonl"), "--rare-file", "rare"])
    assert line == f"dantinox plan: error: --rare-file rare: no such file, and not a bundled slice {LISTED}"
    assert not (tmp_path / "x.jsonl").exists()


def test_plan_refuses_an_unknown_slice_before_profiling(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival": 0.0, "prompt_tokens": 8, "max_tokens": 4}\n', encoding="utf-8")
    line = one_error_line(capsys, ["plan", "--trace", str(trace), "--gate", "g.yaml", "--slice", "rare=latin",
                                   "--out", str(tmp_path / "plan")])
    assert f"--slice rare=latin: no such file, and not a bundled slice {LISTED}" in line
    assert not (tmp_path / "plan").exists()


def test_eval_unknown_bare_name_is_one_line(capsys):
    line = one_error_line(capsys, ["eval", "--slice", "heldout"])
    assert line.startswith(f"dantinox eval: error: --slice 'heldout' is not a bundled slice {LISTED}")
