"""``dantinox eval --mesh`` measures the same figures as one device, and ``dantinox plan profile --mesh`` runs
the sharded engine and records the mesh in profile.json (issue 13; 8 forced CPU devices)."""

import json

import pytest

from dantinox import ModelConfig, build_model
from dantinox.cli import entrypoint as cli
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer

TEXT = "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura, che la diritta via era smarrita.\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tok = train_tokenizer(TEXT, "char")
    cfg = ModelConfig.from_preset("tiny", num_blocks=1, vocab_size=tok.vocab_size, attention="gqa", kv_heads=4,
                                  max_context=64)  # plan profile calibrates with 60-token requests
    out = tmp_path_factory.mktemp("mesh_eval") / "run"
    save_run(out, build_model(cfg, seed=3), cfg, tok)
    return str(out)


def eval_json(run_dir, tmp_path, *extra) -> dict:
    (tmp_path / "a.txt").write_text(TEXT * 2, encoding="utf-8")
    out = tmp_path / f"eval{len(list(tmp_path.iterdir()))}.json"
    assert cli.main(["eval", "--run_dir", run_dir, "--slice", f"it={tmp_path}/a.txt", "--prefix", "8",
                     "--batch", "4", "--prompts", "2", "--prompt-tokens", "8", "--continuation", "8",
                     "--kv-dtype", "int8", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_eval_on_a_mesh_equals_one_device(run_dir, tmp_path, capsys):
    """Baseline (float32 cache) and candidate (int8 cache, scales split like the values) per-slice loss."""
    single = eval_json(run_dir, tmp_path)
    meshed = eval_json(run_dir, tmp_path, "--mesh", "data=2,model=4")
    assert single["mesh"] == {"data": 1, "model": 1} and meshed["mesh"] == {"data": 2, "model": 4}
    one, many = single["slices"]["it"], meshed["slices"]["it"]
    assert one["tokens"] == many["tokens"] > 0
    for key in ("loss_baseline", "loss_candidate"):
        assert abs(one[key] - many[key]) <= 1e-5, (key, one[key], many[key])
    assert abs(one["max_logit_diff"] - many["max_logit_diff"]) <= 1e-5
    assert one["agreement"] == many["agreement"]
    assert "on the mesh data=2,model=4" in capsys.readouterr().out


def test_plan_profile_on_a_mesh_records_it(run_dir, tmp_path):
    out = tmp_path / "profile.json"
    assert cli.main(["plan", "profile", "--run_dir", run_dir, "--repeats", "1", "--call-repeats", "1", "--mesh",
                     "data=2,model=4", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["mesh"] == {"data": 2, "model": 4} and prof["machine"]["devices"] == 8
    assert prof["machine"]["devices_used"] == 8
    assert all(s > 0 for s in prof["points"]["forward"].values()) and prof["points"]["decode"]


def test_plan_profile_mesh_that_does_not_divide_the_heads(run_dir, tmp_path, capsys):
    """6 query heads over model=4: exit 2, one line naming --mesh and the field, before any timing."""
    tok = train_tokenizer(TEXT, "char")
    cfg = ModelConfig.from_preset("tiny", num_blocks=1, vocab_size=tok.vocab_size, n_heads=6, head_size=8, dim=48)
    odd = tmp_path / "odd"
    save_run(odd, build_model(cfg, seed=0), cfg, tok)
    assert cli.main(["plan", "profile", "--run_dir", str(odd), "--mesh", "data=2,model=4",
                     "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mesh 'data=2,model=4'" in err[0] and "n_heads=6 is not divisible" in err[0], err
    assert not (tmp_path / "p.json").exists()
