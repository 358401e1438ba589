"""``--mesh`` on ``dantinox eval`` and ``dantinox plan profile``: a bad mesh exits 2 with one line naming the
flag (issue 13). These errors come from parsing the flag and counting devices, before any model is loaded, so
they run on one device; the equality on a real mesh is tests/parallel/multidevice/test_mesh_eval_profile.py."""

import pytest

from dantinox.cli import entrypoint as cli


@pytest.mark.parametrize("command", [["eval", "--slice", "a={d}/a.txt"], ["plan", "profile", "--out", "{d}/p.json"],
                                     ["plan", "--trace", "{d}/t.jsonl", "--out", "{d}/plan"]])
@pytest.mark.parametrize("mesh, needle", [
    ("data=2,tensor=4", "--mesh 'data=2,tensor=4': axis 'tensor' is not allowed; write data=D,model=M"),
    ("model=0", "--mesh 'model=0': model='0' is not allowed: an integer >= 1"),
    ("data=3,model=3", "--mesh 'data=3,model=3': mesh data=3 x model=3 = 9 devices, but 1 device(s) are available"),
])
def test_bad_mesh_exits_2_with_one_line(tmp_path, capsys, command, mesh, needle):
    (tmp_path / "a.txt").write_text("Nel mezzo del cammin di nostra vita\n" * 4, encoding="utf-8")
    (tmp_path / "t.jsonl").write_text('{"arrival": 0.0, "prompt_tokens": 8, "max_tokens": 4}\n', encoding="utf-8")
    args = [a.format(d=tmp_path) for a in command] + ["--mesh", mesh]
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dantinox {command[0]}: error: ") and needle in err[0], err
    assert captured.out == "" and not (tmp_path / "p.json").exists() and not (tmp_path / "plan").exists()
