"""Run directory: save/load round trip and a clear RunDirError for every kind of broken directory."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from dantinox import ModelConfig, build_model
from dantinox.runs.run_dir import RunDirError, load_run, save_run
from dantinox.runs.tokenizer import train_tokenizer

TEXT = "tanto gentile e tanto onesta pare\nla donna mia quand'ella altrui saluta.\n"


def _save(tmp_path, name="run"):
    tok = train_tokenizer(TEXT, "char")
    cfg = ModelConfig.from_preset("tiny", vocab_size=tok.vocab_size)
    model = build_model(cfg, seed=3)
    out = tmp_path / name
    save_run(out, model, cfg, tok, {"val_loss": 1.5, "steps": 7})
    return out, model, cfg, tok


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_round_trip_gives_identical_logits(tmp_path):
    out, model, cfg, tok = _save(tmp_path)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "model_summary.json",
                                       "tokenizer.json"]
    assert ModelConfig.from_dict(json.loads((out / "config.json").read_text())) == cfg
    loaded, cfg2, tok2, summary = load_run(out)
    assert cfg2 == cfg and tok2.encode(TEXT) == tok.encode(TEXT)
    ids = jnp.asarray([tok.encode(TEXT[:20])], jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(ids)[0]), np.asarray(model(ids)[0]))
    assert summary["val_loss"] == 1.5 and summary["steps"] == 7 and summary["tokenizer"] == "char"
    assert summary["kv_bytes_per_token"] == cfg.num_blocks * 2 * cfg.kv_heads * cfg.head_size * 4
    assert summary["parameters"] == sum(a.size for a in safetensors.numpy.load_file(out / "model.safetensors")
                                        .values())
    keys = safetensors.numpy.load_file(out / "model.safetensors")
    assert "blocks.0.attn.qkv.kernel" in keys and all(a.dtype == np.float32 for a in keys.values())


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        load_run(tmp_path / "nowhere")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        out, *_ = _save(tmp_path, f"missing-{name}")
        os.remove(out / name)
        with pytest.raises(RunDirError, match=name.replace(".", r"\.")):
            load_run(out)


def test_corrupted_files(tmp_path):
    out, *_ = _save(tmp_path)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RunDirError, match="model.safetensors: damaged: its sha256"):
        load_run(out)
    _drop_checksum(out)   # without a recorded checksum (a run directory written before it existed)
    with pytest.raises(RunDirError, match="model.safetensors.*corrupted"):
        load_run(out)
    out, *_ = _save(tmp_path, "bad-config")
    (out / "config.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(RunDirError, match="config.json"):
        load_run(out)
    out, *_ = _save(tmp_path, "bad-field")
    (out / "config.json").write_text(json.dumps({"dim": -1}), encoding="utf-8")
    with pytest.raises(RunDirError, match="config.json.*dim"):
        load_run(out)
    out, *_ = _save(tmp_path, "bad-tokenizer")
    (out / "tokenizer.json").write_text("[]", encoding="utf-8")
    with pytest.raises(RunDirError, match="tokenizer.json"):
        load_run(out)


def _drop_checksum(out):
    summary = json.loads((out / "model_summary.json").read_text())
    del summary["weights_sha256"]
    (out / "model_summary.json").write_text(json.dumps(summary))


def _edit_weights(path, edit):
    """Rewrite the weights file of a run directory by hand, as a user could: its checksum no longer applies, and
    is dropped (with it, the edited file would be refused as damaged: tests/runs/test_weights_checksum.py)."""
    arrays = safetensors.numpy.load_file(path)
    edit(arrays)
    safetensors.numpy.save_file(arrays, path)
    _drop_checksum(path.parent)


def test_weights_that_do_not_match_the_config(tmp_path):
    key = "blocks.1.mlp.down.kernel"
    out, *_ = _save(tmp_path, "missing-key")
    _edit_weights(out / "model.safetensors", lambda a: a.pop(key))
    with pytest.raises(RunDirError, match=f"missing parameter '{key}'"):
        load_run(out)
    out, *_ = _save(tmp_path, "extra-key")
    _edit_weights(out / "model.safetensors", lambda a: a.update({"blocks.2.extra": np.zeros(3, np.float32)}))
    with pytest.raises(RunDirError, match="unexpected parameter.*blocks.2.extra"):
        load_run(out)
    out, _, cfg, _ = _save(tmp_path, "shape")
    config = json.loads((out / "config.json").read_text())
    config["mlp_hidden"] = 96  # the saved weights have mlp_hidden 128
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunDirError) as err:
        load_run(out)
    message = str(err.value)
    assert "model.safetensors" in message and "(128, 64)" in message and "(96, 64)" in message


def test_tokenizer_vocab_disagrees_with_config(tmp_path):
    out, *_ = _save(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] += 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunDirError, match="tokenizer.json.*vocab_size"):
        load_run(out)
    tok = train_tokenizer(TEXT, "char")
    with pytest.raises(RunDirError, match="vocab_size"):
        cfg = ModelConfig.from_preset("tiny")
        save_run(tmp_path / "x", build_model(cfg), cfg, tok)
