"""Extending a finished run: re-running train with a larger steps continues from the checkpoint; the
learning rate follows the original warmup + cosine schedule to its end and then stays at min_lr.
Reference: one straight run with schedule_steps set to the first run's steps gives the same parameters."""

import csv

import numpy as np
import pytest
import safetensors.numpy
from test_train import RUN, TEXT, tiny_cfg

from dantinox.cli import entrypoint as cli
from dantinox.runs.run_dir import read_summary
from dantinox.train.trainer import TrainError, train


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def _lrs(run_dir) -> dict[int, float]:
    with open(run_dir / "training_log.csv", newline="") as f:
        return {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}


def test_a_finished_run_extends_at_min_lr(data_file, tmp_path):
    opts = dict(RUN, checkpoint_every=0, eval_every=1)
    lines = []
    train(tiny_cfg(), data_file, tmp_path / "ext", steps=4, **opts)
    summary = train(tiny_cfg(), data_file, tmp_path / "ext", steps=7, **{**opts, "log": lines.append})
    assert summary["steps"] == 7 and read_summary(tmp_path / "ext")["steps"] == 7
    assert any("resumed" in line and "step 4" in line for line in lines)
    lrs = _lrs(tmp_path / "ext")
    assert sorted(lrs) == list(range(1, 8))
    assert [lrs[s] for s in (5, 6, 7)] == pytest.approx([RUN["min_lr"]] * 3)
    assert lrs[4] == pytest.approx(RUN["min_lr"]) and lrs[2] > RUN["min_lr"]
    train(tiny_cfg(), data_file, tmp_path / "straight", steps=7, schedule_steps=4, **opts)
    a = safetensors.numpy.load_file(tmp_path / "ext" / "model.safetensors")
    b = safetensors.numpy.load_file(tmp_path / "straight" / "model.safetensors")
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-6, rtol=0, err_msg=key)
    with pytest.raises(TrainError, match="steps=3 is not allowed: the checkpoint .* is at step 7"):
        train(tiny_cfg(), data_file, tmp_path / "ext", steps=3, **opts)


def test_cli_extension_and_its_errors_name_flags(data_file, tmp_path, capsys):
    out = tmp_path / "cli"
    base = ["train", "--data", str(data_file), "--out", str(out), "--preset", "tiny", "--batch_size", "4",
            "--seq_len", "16", "--eval_every", "3", "--eval_batches", "2", "--warmup_steps", "1", "--lr", "1e-2",
            "--min_lr", "1e-3", "--no_progress"]
    assert cli.main(base + ["--steps", "3"]) == 0
    assert cli.main(base + ["--steps", "5"]) == 0
    assert read_summary(out)["steps"] == 5
    capsys.readouterr()
    assert cli.main(base + ["--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--steps 2 is not allowed" in err and "give --steps 5 or more" in err
    assert "--no_resume" in err and "--out" in err
    assert "resume=False" not in err and "out_dir" not in err and "steps=" not in err
    assert cli.main(base + ["--steps", "6", "--lr", "5e-3"]) == 2
    err = capsys.readouterr().err
    assert "--lr 0.01" in err and "--no_resume" in err and "--out" in err and "resume=False" not in err


def test_checkpoint_from_before_a_config_field_existed_resumes_at_its_default():
    """A checkpoint whose recorded model_config lacks a field added since (e.g. qkv_bias) was made with that
    field at its default: resuming with the default is allowed, with another value it is refused by name."""
    import dataclasses

    from dantinox.train.trainer import TrainConfig, _check_resumable
    cfg = tiny_cfg()
    opts = TrainConfig(steps=4, schedule_steps=4)
    saved_opts = {name: getattr(opts, name) for name in
                  ("tokenizer", "bpe_vocab_size", "batch_size", "seq_len", "lr", "min_lr", "warmup_steps",
                   "weight_decay", "grad_clip", "seed", "val_fraction")}
    saved_opts["steps"] = 4
    old_cfg = {k: v for k, v in cfg.to_dict().items() if k != "qkv_bias"}
    meta = {"model_config": old_cfg, "train_options": saved_opts, "data_sha256": "abc"}
    _check_resumable(meta, cfg, opts, "abc", "ckpt")                        # qkv_bias absent = False
    with pytest.raises(TrainError, match=r"ModelConfig.qkv_bias=False, not True"):
        _check_resumable(meta, dataclasses.replace(cfg, qkv_bias=True), opts, "abc", "ckpt")
    with pytest.raises(TrainError, match=r"ModelConfig.dim="):
        _check_resumable({**meta, "model_config": {**old_cfg, "dim": cfg.dim * 2}}, cfg, opts, "abc", "ckpt")
