"""Data splits and batches, the training loop, checkpoints (resume, atomic writes) and the CLI mapping.

Every training run uses the tiny preset, batch 4 and seq_len 16 on one short text, and the resume and CLI
tests share their optimizer options, so the whole file compiles two training steps and one evaluation.
"""

import argparse
import csv
import json
import math
import os

import numpy as np
import pytest
import safetensors.numpy

from dantinox import ConfigError, ModelConfig
from dantinox.cli.train import add_train_arguments, parse_overrides, resolve_cli_config, run_train_from_args
from dantinox.runs.run_dir import load_run, read_summary
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.train import checkpoint as ckpt
from dantinox.train.data import DataError, TokenData, read_text, sample_batch, split_text, val_batches
from dantinox.train.trainer import TrainError, train

TEXT = "la vita nuova, la vita vera. " * 40
RUN = dict(batch_size=4, seq_len=16, eval_every=3, eval_batches=2, lr=1e-2, min_lr=1e-3, warmup_steps=1,
           progress=False, log=lambda line: None)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def tiny_cfg():
    return ModelConfig.from_preset("tiny")


# Data ------------------------------------------------------------------------------------------------------

def test_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        read_text(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="not a regular file"):
        read_text(tmp_path)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="UTF-8"):
        read_text(tmp_path / "latin1.txt")
    with pytest.raises(DataError, match="val_fraction"):
        split_text("abc", 1.5)
    tok = train_tokenizer("abcdefghij" * 3, "char")
    with pytest.raises(DataError, match="validation split has 3 tokens.*seq_len \\+ 1 = 9"):
        TokenData.from_text(tok, "abcdefghij" * 3, "abc", seq_len=8)


def test_split_and_batches():
    train_text, val_text = split_text("0123456789" * 10, 0.1)
    assert train_text + val_text == "0123456789" * 10 and len(val_text) == 10
    ids = np.arange(100, dtype=np.int32)
    a = sample_batch(ids, np.random.default_rng(5), 3, 8)
    assert a.shape == (3, 9) and a.dtype == np.int32
    assert np.array_equal(a, sample_batch(ids, np.random.default_rng(5), 3, 8))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous windows
    batches = list(val_batches(ids[:30], batch_size=2, seq_len=8))
    assert len(batches) == 2  # windows start at 0, 8, 16 -> one full batch and one padded batch
    (w0, m0), (w1, m1) = batches
    assert w0[1, 0] == 8 and w1[0, 0] == 16 and m1[:, 0].tolist() == [1.0, 0.0]
    assert [w.tolist() for w, _ in val_batches(ids[:30], 2, 8)] == [w.tolist() for w, _ in batches]


# Training --------------------------------------------------------------------------------------------------

def test_training_reduces_loss(data_file, tmp_path):
    out = tmp_path / "run"
    summary = train(tiny_cfg(), data_file, out, steps=24, checkpoint_every=0, **RUN)
    with open(out / "training_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(3, 25, 3))
    first, last = float(rows[0]["val_loss"]), float(rows[-1]["val_loss"])
    vocab = len(set(TEXT)) + 1
    assert summary["steps"] == 24 and summary["tokens_seen"] == 24 * 4 * 16
    assert last < 0.6 * first and last < 0.5 * math.log(vocab), (first, last)
    assert summary["val_nats_per_char"] == pytest.approx(summary["val_loss"])  # char tokenizer
    model, cfg, tok, loaded_summary = load_run(out)
    assert cfg.vocab_size == vocab == tok.vocab_size and loaded_summary["val_loss"] == summary["val_loss"]
    assert loaded_summary["data_file"] == "text.txt" and len(loaded_summary["data_sha256"]) == 64


def test_resume_gives_the_same_parameters(data_file, tmp_path):
    opts = dict(steps=6, checkpoint_every=3, **RUN)
    train(tiny_cfg(), data_file, tmp_path / "straight", **opts)
    train(tiny_cfg(), data_file, tmp_path / "split", stop_at=3, **opts)
    assert json.loads((tmp_path / "split" / "checkpoint" / "meta.json").read_text())["step"] == 3
    lines = []
    summary = train(tiny_cfg(), data_file, tmp_path / "split", **{**opts, "log": lines.append})
    assert any("resumed" in line and "step 3" in line for line in lines)
    assert summary["steps"] == 6
    a = safetensors.numpy.load_file(tmp_path / "straight" / "model.safetensors")
    b = safetensors.numpy.load_file(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-6, rtol=0, err_msg=key)
    log_a = (tmp_path / "straight" / "training_log.csv").read_text().splitlines()
    log_b = (tmp_path / "split" / "training_log.csv").read_text().splitlines()
    assert [r.split(",")[:4] for r in log_a] == [r.split(",")[:4] for r in log_b]
    with pytest.raises(TrainError, match="batch_size=4, not 8"):
        train(tiny_cfg(), data_file, tmp_path / "split", **{**opts, "batch_size": 8})


def test_training_option_errors(data_file, tmp_path):
    with pytest.raises(TrainError, match="seq_len=64.*max_context=32"):
        train(tiny_cfg(), data_file, tmp_path / "r", steps=2, seq_len=64, progress=False)
    with pytest.raises(TrainError, match="unknown training option"):
        train(tiny_cfg(), data_file, tmp_path / "r", stepz=2)
    with pytest.raises(TrainError, match="warmup_steps=5.*steps=5"):
        train(tiny_cfg(), data_file, tmp_path / "r", steps=5, warmup_steps=5)
    with pytest.raises(TrainError, match="tokenizer='word'"):
        train(tiny_cfg(), data_file, tmp_path / "r", tokenizer="word")


# Checkpoints -----------------------------------------------------------------------------------------------

def _crash(*args, **kwargs):
    raise OSError("simulated crash before rename")


def test_atomic_write_survives_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "file.bin"
    ckpt.atomic_write_bytes(path, b"old content")
    monkeypatch.setattr(os, "replace", _crash)
    with pytest.raises(OSError, match="simulated"):
        ckpt.atomic_write_bytes(path, b"new content that never lands")
    assert path.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["file.bin"]  # no temporary file left behind


def test_checkpoint_crash_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    state = {"w": np.ones((2, 3), np.float32), "count": np.asarray(1, np.int32)}
    ckpt.save_checkpoint(tmp_path, state, {"step": 1})
    monkeypatch.setattr(os, "replace", _crash)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, {"w": np.zeros((2, 3), np.float32), "count": np.asarray(2, np.int32)},
                             {"step": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["meta.json", "state-00000001.safetensors"]
    restored, meta = ckpt.load_checkpoint(tmp_path, state)
    assert meta["step"] == 1 and np.all(np.asarray(restored["w"]) == 1) and int(restored["count"]) == 1
    with pytest.raises(ckpt.CheckpointError, match="missing array 'extra'"):
        ckpt.load_checkpoint(tmp_path, {**state, "extra": np.zeros(1, np.float32)})
    with pytest.raises(ckpt.CheckpointError, match="'w' has shape \\(2, 3\\)"):
        ckpt.load_checkpoint(tmp_path, {**state, "w": np.zeros((3, 3), np.float32)})


# Command line ----------------------------------------------------------------------------------------------

def test_overrides_and_yaml(tmp_path):
    assert parse_overrides(["kv_heads=4", "sliding_window=none", "tie_embeddings=false", "rope_theta=5e5",
                            "compute_dtype=bf16"]) == {"kv_heads": 4, "sliding_window": None,
                                                       "tie_embeddings": False, "rope_theta": 5e5,
                                                       "compute_dtype": "bf16"}
    with pytest.raises(ConfigError, match="dim='wide'.*expects int"):
        parse_overrides(["dim=wide"])
    with pytest.raises(ConfigError, match="colour: unknown ModelConfig field"):
        parse_overrides(["colour=red"])
    with pytest.raises(ConfigError, match="FIELD=VALUE"):
        parse_overrides(["dim"])
    yaml_path = tmp_path / "cfg.yaml"
    yaml_path.write_text("preset: tiny\nnum_blocks: 1\ntrain:\n  steps: 7\n  lr: 0.01\n")
    cfg, options = resolve_cli_config(None, str(yaml_path), ["num_blocks=3"])
    assert cfg.num_blocks == 3 and cfg.dim == 64 and options == {"steps": 7, "lr": 0.01}
    yaml_path.write_text("train:\n  stepz: 7\n")
    with pytest.raises(ConfigError, match="stepz"):
        resolve_cli_config(None, str(yaml_path))


def test_run_train_from_args(data_file, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = tmp_path / "cli"
    args = parser.parse_args(["--data", str(data_file), "--out", str(out), "--preset", "tiny",
                              "--set", "tie_embeddings=true", "--steps", "6", "--batch_size", "4", "--seq_len",
                              "16", "--eval_every", "3", "--eval_batches", "2", "--warmup_steps", "1", "--lr",
                              "1e-2", "--min_lr", "1e-3", "--no_resume", "--no_progress"])
    assert run_train_from_args(args) == 0
    assert read_summary(out)["steps"] == 6
    assert json.loads((out / "config.json").read_text())["num_blocks"] == 2
    with pytest.raises(ConfigError, match="num_blocks='two'"):
        run_train_from_args(parser.parse_args(["--data", str(data_file), "--out", str(out),
                                               "--set", "num_blocks=two"]))
