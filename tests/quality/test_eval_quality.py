"""dantinox eval (issue 10, point 5): per-slice loss through the cache, greedy agreement, logit difference,
the table, the JSON file, the gate, and one-line errors for bad input."""

import json

import numpy as np
import pytest
from conftest import forward

from dantinox import ModelConfig, build_model, bundled_run_dir
from dantinox.cli import entrypoint as cli
from dantinox.quality.slices import slice_quality, windows
from dantinox.quant.weights import quantize_weights
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer

TEXT = ("tanto gentile e tanto onesta pare\nla donna mia quand'ella altrui saluta,\n"
        "ch'ogne lingua deven tremando muta,\ne li occhi no l'ardiscon di guardare.\n")


def numpy_nll(logits, targets):
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return float((logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).sum())


@pytest.mark.parametrize("n", [33, 40, 63, 64, 95, 200])
def test_windows_score_every_target_once(n):
    starts, mask = windows(n, 32)
    scored = np.concatenate([s + 1 + np.flatnonzero(m) for s, m in zip(starts, mask)])
    assert sorted(scored.tolist()) == list(range(1, n))
    assert (starts + 32 <= n).all()


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.from_preset("tiny"), seed=1)


@pytest.mark.parametrize("n", [20, 75])
def test_teacher_forced_loss_equals_uncached_forward(model, n):
    ids = np.random.default_rng(n).integers(0, 128, n)
    S = model.cfg.max_context
    starts, mask = windows(n, S) if n >= S else (np.zeros(1, int), np.ones((1, n - 1), bool))
    want = 0.0
    for s, m in zip(starts, mask):
        row = ids[s:s + S]
        logits = np.asarray(forward(model, row[None].astype(np.int32))[0])[0, :-1]
        want += numpy_nll(logits[m[:len(row) - 1]], row[1:][m[:len(row) - 1]])
    q = slice_quality(model, model, ids, chars=2 * (n - 1), prefix=8, batch=2, prompts=3, prompt_tokens=8,
                      continuation=8)
    np.testing.assert_allclose(q.loss, (want / (2 * (n - 1)),) * 2, rtol=1e-5)
    assert q.agreement == 1.0 and q.max_logit_diff == 0.0 and q.tokens == n - 1


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_int8_weights_change_the_figures(model):
    candidate = quantize_weights(build_model(model.cfg, seed=1), "int8")
    ids = np.random.default_rng(0).integers(0, 128, 60)
    q = slice_quality(model, candidate, ids, chars=59, prefix=8, batch=2, prompts=4, prompt_tokens=8,
                      continuation=16)
    assert q.max_logit_diff > 0 and q.loss[0] != q.loss[1]
    assert 0.0 <= q.agreement <= 1.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tok = train_tokenizer(TEXT, "char")
    cfg = ModelConfig.from_preset("tiny", vocab_size=tok.vocab_size)
    out = tmp_path_factory.mktemp("eval") / "run"
    save_run(out, build_model(cfg, seed=3), cfg, tok)
    return str(out)


@pytest.fixture()
def slices(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT * 2, encoding="utf-8")
    b.write_text(TEXT[::-1], encoding="utf-8")
    return str(a), str(b)


def run(run_dir, *extra):
    return cli.main(["eval", "--run_dir", run_dir, "--prefix", "8", "--prompts", "2", "--prompt-tokens", "8",
                     "--continuation", "8", *extra])


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_eval_prints_table_writes_json_and_gate_passes(run_dir, slices, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text("slices:\n  it: {loss_change_pct: 50, agreement_min: 0.0}\n  rev: {max_logit_diff: 10}\n")
    out = tmp_path / "res.json"
    code = run(run_dir, "--slice", f"it={slices[0]}", "--slice", f"rev={slices[1]}", "--quantize", "int8",
               "--gate", str(gate), "--json", str(out))
    printed = capsys.readouterr().out
    assert code == 0
    for needle in ("loss (nats/char)", "greedy agreement", "max |logit diff|", "PASS"):
        assert needle in printed
    data = json.loads(out.read_text())
    assert set(data["slices"]) == {"it", "rev"} and data["failures"] == [] and data["quantize"] == "int8"
    row = data["slices"]["it"]
    assert row["chars"] == len(TEXT * 2) - 1 and row["max_logit_diff"] > 0
    np.testing.assert_allclose(row["loss_change_pct"],
                               100 * (row["loss_candidate"] - row["loss_baseline"]) / row["loss_baseline"])


@pytest.mark.slow   # two eval runs
def test_baseline_run_dir_is_that_run_as_saved(run_dir, slices, tmp_path, capsys):
    """--baseline RUN_DIR (same tokenizer): the baseline figures are that run's own, the candidate this run's."""
    tok = train_tokenizer(TEXT, "char")
    cfg = ModelConfig.from_preset("tiny", vocab_size=tok.vocab_size)
    other = tmp_path / "other"
    save_run(other, build_model(cfg, seed=4), cfg, tok)
    pair, alone = tmp_path / "pair.json", tmp_path / "alone.json"
    assert run(run_dir, "--slice", f"it={slices[0]}", "--baseline", str(other), "--json", str(pair)) == 0
    assert run(str(other), "--slice", f"it={slices[0]}", "--json", str(alone)) == 0
    capsys.readouterr()
    a, b = json.loads(pair.read_text())["slices"]["it"], json.loads(alone.read_text())["slices"]["it"]
    assert a["loss_baseline"] == pytest.approx(b["loss_baseline"], rel=1e-6)
    assert a["max_logit_diff"] > 0 and a["loss_candidate"] != a["loss_baseline"]


def test_gate_failure_names_every_failing_slice_and_metric(run_dir, slices, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text("slices:\n  it: {max_logit_diff: 0.0, loss_change_pct: 100}\n  rev: {max_logit_diff: 0}\n")
    code = run(run_dir, "--slice", f"it={slices[0]}", "--slice", f"rev={slices[1]}", "--quantize", "int8",
               "--gate", str(gate))
    err = capsys.readouterr().err
    assert code == 1
    assert "gate failed: it.max_logit_diff" in err and "gate failed: rev.max_logit_diff" in err
    assert "it.loss_change_pct" not in err
    assert "%|" not in err and "\r" not in err   # no progress bar in a log (stderr not a terminal)


def bad_files(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("citt\xe0".encode("latin-1"))
    (tmp_path / "short.txt").write_text("tanto")
    (tmp_path / "ok.txt").write_text(TEXT)
    (tmp_path / "g_slice.yaml").write_text("slices:\n  nope: {agreement_min: 0.5}\n")
    (tmp_path / "g_metric.yaml").write_text("slices:\n  ok: {perplexity: 3}\n")
    (tmp_path / "g_value.yaml").write_text("slices:\n  ok: {agreement_min: -1}\n")


@pytest.mark.parametrize("args, needle", [
    (["--slice", "x={d}/missing.txt"], "--slice x={d}/missing.txt: no such file, and not a bundled slice "
                                       "(bundled: en-shakespeare, it-heldout, rare-latin-occitan)"),
    (["--slice", "x={d}"], "--slice x={d}: is a directory, not a regular file"),
    (["--slice", "it-heldout", "--slice", "nope"], "--slice 'nope' is not a bundled slice (bundled: "
                                                   "en-shakespeare, it-heldout, rare-latin-occitan)"),
    (["--slice", "x={d}/empty.txt"], "the file is empty"),
    (["--slice", "x={d}/latin1.txt"], "not UTF-8"),
    (["--slice", "x={d}/short.txt"], "shorter than --prefix 8"),
    (["--slice", "{d}/ok.txt"], "NAME=FILE"),
    (["--slice", "a b={d}/ok.txt"], "NAME=FILE"),
    (["--slice", "ok={d}/ok.txt", "--slice", "ok={d}/ok.txt"], "given twice"),
    ([], "--slice is required"),
    (["--slice", "ok={d}/ok.txt", "--gate", "{d}/g_slice.yaml"], "slice 'nope' is not one of the --slice names"),
    (["--slice", "ok={d}/ok.txt", "--gate", "{d}/g_metric.yaml"], "metric 'perplexity' of slice 'ok' is not allowed"),
    (["--slice", "ok={d}/ok.txt", "--gate", "{d}/g_value.yaml"], "ok.agreement_min=-1 is not allowed"),
    (["--slice", "ok={d}/ok.txt", "--gate", "{d}/none.yaml"], "--gate"),
    (["--slice", "ok={d}/ok.txt", "--quantize", "int3"], "--quantize int3 is not allowed: one of bf16, int8, int4"),
    (["--slice", "ok={d}/ok.txt", "--kv-dtype", "int3"], "--kv-dtype 'int3' is not allowed: one of"),
    (["--slice", "ok={d}/ok.txt", "--baseline", "fp16"], "--baseline fp16 is not allowed: one of default"),
    (["--slice", "ok={d}/ok.txt", "--baseline", bundled_run_dir()], "its tokenizer differs from --run_dir"),
    (["--slice", "ok={d}/ok.txt", "--batch", "0"], "--batch 0 is not allowed"),
    (["--slice", "ok={d}/ok.txt", "--chunk", "0"], "--chunk 0 is not allowed"),
    (["--slice", "ok={d}/ok.txt", "--kv-keys", "row"], "--kv-keys row is not allowed: one of token, channel"),
    (["--slice", "ok={d}/ok.txt", "--kv-keys", "channel"], "--kv-keys channel needs an int8"),
    (["--slice", "ok={d}/ok.txt", "--kv-sinks", "2"], "--kv-sinks 2 needs an int8 cache"),
    (["--slice", "ok={d}/ok.txt", "--json", "{d}/no/such/out.json"], "--json"),
    (["--slice", "ok={d}/ok.txt", "--run_dir", bundled_run_dir("dante-diffusion")], "paradigm='diffusion'"),
])
def test_bad_eval_input_exits_2_with_one_line(run_dir, tmp_path, capsys, args, needle):
    bad_files(tmp_path)
    args = [a.format(d=tmp_path) for a in args]
    assert run(run_dir, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.format(d=tmp_path) in err[0], err
