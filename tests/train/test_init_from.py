"""--init_from: a diffusion model initialised from an AR run (DiffuLLaMA-style adaptation) on tiny configs.

The source run is written with save_run (no training); one 2-step diffusion training run through the CLI
mapping checks the trainer path.
"""

import argparse

import numpy as np
import pytest
import safetensors.numpy
from conftest import tiny_config

import dantinox as dx
from dantinox.cli.train import add_train_arguments, run_train_from_args
from dantinox.runs.run_dir import load_run, param_arrays, save_run
from dantinox.runs.tokenizer import train_tokenizer, with_mask_token
from dantinox.train.init_from import InitFromError, adapt_arrays, init_from_run
from dantinox.train.trainer import TrainError, train

TEXT = "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura. " * 20


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory):
    """A tiny AR run directory (char tokenizer of TEXT, untied head so both vocabulary parameters grow)."""
    out = tmp_path_factory.mktemp("ar")
    tokenizer = train_tokenizer(TEXT, "char")
    cfg = tiny_config(num_blocks=1, vocab_size=tokenizer.vocab_size, tie_embeddings=False)
    save_run(out, dx.build_model(cfg, seed=7), cfg, tokenizer, {"val_loss": 1.0})
    (out / "text.txt").write_text(TEXT, encoding="utf-8")
    return out


def diffusion_model(ar_dir, **overrides):
    _, cfg, tokenizer, _ = load_run(ar_dir)
    tokenizer = with_mask_token(tokenizer)
    cfg = cfg.replace(paradigm="diffusion", vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.vocab_size - 1,
                      **overrides)
    return dx.build_model(cfg, seed=1), tokenizer


def test_weights_copied_and_mask_row_added(ar_run):
    source = safetensors.numpy.load_file(ar_run / "model.safetensors")
    model, tokenizer = diffusion_model(ar_run)
    assert sorted(init_from_run(model, tokenizer, ar_run)) == ["embed.embedding", "lm_head.kernel"]
    got = param_arrays(model)
    assert got.keys() == source.keys()
    V = source["embed.embedding"].shape[0]
    for key, array in source.items():
        if key == "embed.embedding":
            np.testing.assert_array_equal(got[key][:V], array)
            np.testing.assert_allclose(got[key][V], array.mean(0), rtol=1e-6)  # <mask> = the mean embedding
        elif key == "lm_head.kernel":
            np.testing.assert_array_equal(got[key][:, :V], array)
            assert got[key].shape == (array.shape[0], V + 1)
        else:
            np.testing.assert_array_equal(got[key], array, err_msg=key)


def test_shape_and_tokenizer_mismatches_are_named(ar_run):
    model, tokenizer = diffusion_model(ar_run, mlp_hidden=96)
    with pytest.raises(InitFromError, match=r"'blocks.0.mlp.down.kernel' has shape \(128, 64\).*\(96, 64\)"):
        init_from_run(model, tokenizer, ar_run)
    model, tokenizer = diffusion_model(ar_run, num_blocks=2)
    with pytest.raises(InitFromError, match="'blocks.1.attn.out.kernel'.*lacks"):
        init_from_run(model, tokenizer, ar_run)
    other = with_mask_token(train_tokenizer(TEXT.upper(), "char"))
    model = dx.build_model(tiny_config(paradigm="diffusion", num_blocks=1, vocab_size=other.vocab_size,
                                       mask_token_id=other.vocab_size - 1, tie_embeddings=False))
    with pytest.raises(InitFromError, match="tokenizers differ in their 'model' section"):
        init_from_run(model, other, ar_run)
    with pytest.raises(InitFromError, match="tokenizer kind differs"):
        init_from_run(model, with_mask_token(train_tokenizer(TEXT, "bpe", 300)), ar_run)
    with pytest.raises(InitFromError, match="'embed.embedding'.*only the vocabulary axis"):  # a smaller vocabulary
        adapt_arrays({"embed.embedding": np.zeros((10, 4), np.float32)}, {"embed.embedding": (9, 4)})


def test_train_init_from_reuses_the_run_tokenizer(ar_run, tmp_path):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--data", str(ar_run / "text.txt"), "--out", str(tmp_path / "run"), "--preset", "tiny",
                              "--set", "paradigm=diffusion", "--set", "num_blocks=1", "--set", "tie_embeddings=false",
                              "--init_from", str(ar_run), "--steps", "2", "--batch_size", "2", "--seq_len", "16",
                              "--eval_every", "2", "--eval_batches", "1", "--no_progress"])
    assert run_train_from_args(args) == 0
    model, cfg, tokenizer, summary = load_run(tmp_path / "run")
    _, ar_cfg, ar_tokenizer, _ = load_run(ar_run)
    assert tokenizer.kind == "char" and cfg.vocab_size == ar_cfg.vocab_size + 1 == cfg.mask_token_id + 1
    assert tokenizer.encode(TEXT[:40]) == ar_tokenizer.encode(TEXT[:40])
    assert summary["init_from"] == str(ar_run) and np.isfinite(summary["init_val_loss"])
    assert set(p.name for p in (tmp_path / "run").iterdir()) >= {"config.json", "model.safetensors", "tokenizer.json",
                                                                  "training_log.csv", "model_summary.json"}
    with pytest.raises(TrainError, match="tokenizer='bpe' conflicts with init_from.*char"):
        train(tiny_config(paradigm="diffusion", num_blocks=1), ar_run / "text.txt", tmp_path / "r2",
              init_from=ar_run, tokenizer="bpe", steps=2, progress=False)
    with pytest.raises(InitFromError, match="parameter 'blocks.0.attn.qkv.kernel'"):
        train(tiny_config(paradigm="diffusion", num_blocks=1, kv_heads=2, attention="gqa", tie_embeddings=False),
              ar_run / "text.txt", tmp_path / "r3", init_from=ar_run, steps=2, batch_size=2, seq_len=16,
              progress=False, log=lambda _: None)
