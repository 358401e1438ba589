"""Masked diffusion: case K07 (../shared/cases/ACCEPTANCE.md), refresh policies, compile counts, memory
accounting, bad inputs, the training objective. A random tiny model with an untied head (varied predictions)."""

import jax
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import dantinox as dx
from dantinox.budget.memory import diffusion_cache_bytes
from dantinox.generation.diffusion import (
    diffusion_generate,
    diffusion_generate_result,
    dual_cache_bytes,
    init_dual_cache,
    prompt_slots,
)

PROMPTS = [[5, 17, 42, 99, 3, 64], [88, 1, 23, 77, 51, 9]]  # K07: two different 6-token prompts
K07 = dict(gen_len=16, block_size=8, steps_per_block=8)     # one token unmasked per step


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(paradigm="diffusion", attention="gqa", kv_heads=2, mask_token_id=127, tie_embeddings=False)
    return dx.build_model(cfg, seed=3)


def test_K07_batch_rows_equal_batch_1_runs(model):
    for prompts in (PROMPTS, [PROMPTS[0], PROMPTS[1][:3]]):  # same lengths, then different lengths
        batch = diffusion_generate(model, prompts, **K07)
        assert batch.shape == (2, 16)
        for row, prompt in zip(batch, prompts):
            np.testing.assert_array_equal(row, diffusion_generate(model, prompt, **K07))


def test_K07_cache_refreshed_every_step_equals_no_cache(model):
    for prompts in ([PROMPTS[0]], PROMPTS):
        no_cache = diffusion_generate_result(model, prompts, **K07, use_cache=False)
        every_step = diffusion_generate_result(model, prompts, **K07, refresh="step")
        np.testing.assert_array_equal(every_step.tokens, no_cache.tokens)
        assert every_step.steps == no_cache.steps == [8, 8]


@nnx.jit
def _fresh_kv(model, x, key_start):
    """Keys and values of a plain forward over x through the static cache: per layer [B, K, S, D]."""
    cache = dx.init_cache(model.cfg, x.shape[0])
    return model(x, use_cache=True, kv_caches=cache, cache_index=0, key_start=key_start)[1]


def _capture(model, refresh):
    seen = {}

    def on_block(n, x, cache):
        seen[n] = (np.asarray(x), jax.tree.map(np.asarray, cache))

    result = diffusion_generate_result(model, PROMPTS, **K07, refresh=refresh, on_block=on_block)
    return result, seen


def test_K07_committed_block_kv_is_fresh_under_block_refresh(model):
    result, seen = _capture(model, "block")
    x1, cache1 = seen[1]  # the sequence and cache used while block 2 is generated
    assert (x1[:, 16:24] != 127).all() and (x1[:, 24:] == 127).all()
    fresh = _fresh_kv(model, x1, np.array([10, 10], np.int32))
    stale = seen[0][1]  # computed while block 1 was still MASK
    for layer in range(model.cfg.num_blocks):
        for part in (0, 1):  # k, v
            used = cache1.suffix_kvs[layer][part][:, :, :8]
            np.testing.assert_allclose(used, np.asarray(fresh[layer][part])[:, :, 16:24], atol=1e-5, rtol=1e-5)
            assert not np.allclose(used, stale.suffix_kvs[layer][part][:, :, :8], atol=1e-3)
            np.testing.assert_allclose(cache1.prefix_kvs[layer][part][:, :, 10:],
                                       np.asarray(fresh[layer][part])[:, :, 10:16], atol=1e-5, rtol=1e-5)
    assert result.prefix_computations == 2  # one full refresh per block


def test_K07_prompt_once_computes_the_prefix_once(model):
    result, seen = _capture(model, "prompt_once")
    assert result.prefix_computations == 1
    (_, cache0), (x1, cache1) = seen[0], seen[1]
    fresh = _fresh_kv(model, x1, np.array([10, 10], np.int32))
    for layer in range(model.cfg.num_blocks):
        for part in (0, 1):
            np.testing.assert_array_equal(cache1.prefix_kvs[layer][part], cache0.prefix_kvs[layer][part])
            used = cache1.suffix_kvs[layer][part][:, :, :8]
            assert not np.allclose(used, cache0.suffix_kvs[layer][part][:, :, :8], atol=1e-3)  # refreshed
    # layer 0's keys and values depend only on the tokens, so they match a fresh forward exactly
    np.testing.assert_allclose(cache1.suffix_kvs[0].k[:, :, :8], np.asarray(fresh[0].k)[:, :, 16:24], atol=1e-5)


def test_no_recompilation_across_blocks_steps_and_prompts(model):
    rng = np.random.default_rng(0)
    kw = dict(gen_len=16, block_size=8, steps_per_block=4)
    diffusion_generate(model, PROMPTS, **kw)  # warm-up (block refresh + dual-cache steps, batch 2)
    with dx.CompileCounter() as warm:
        for n in (1, 7, 12):
            prompts = [rng.integers(0, 127, n).tolist(), rng.integers(0, 127, 16 - n).tolist()]
            diffusion_generate(model, prompts, **kw)
            diffusion_generate(model, prompts, **kw, threshold=0.01, temperature=0.7, seed=n)
            diffusion_generate(model, prompts, gen_len=16, block_size=8, steps_per_block=2)
    assert warm.compilations == 0, warm


def test_dual_cache_bytes_equal_the_allocated_arrays(model):
    cfg = model.cfg
    P = prompt_slots(cfg, 6, 16)
    assert P == 16
    assert dual_cache_bytes(cfg, 6, 16, 2) == dx.cache_nbytes(init_dual_cache(cfg, 2, P, 16))
    sizes = []
    diffusion_generate_result(model, PROMPTS, **K07, on_block=lambda n, x, c: sizes.append(dx.cache_nbytes(c)))
    assert sizes == [dual_cache_bytes(cfg, 6, 16, 2)] * 2
    report = diffusion_cache_bytes(cfg, 6, 16, 2)
    assert report["dual_cache"] == sizes[0]
    assert report["ar_same_length"] == dx.kv_cache_bytes(cfg, 2, 22)
    assert report["ar_static"] == dx.cache_nbytes(dx.init_cache(cfg, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(gen_len=12, block_size=8), "gen_len=12.*multiple of block_size=8"),
    (dict(gen_len=16, block_size=8, steps_per_block=3), "steps_per_block=3.*divisor of block_size=8"),
    (dict(gen_len=16, block_size=8, threshold=0.0), r"threshold=0.0.*\(0, 1\]"),
    (dict(gen_len=16, block_size=8, threshold=1.5), r"threshold=1.5.*\(0, 1\]"),
    (dict(gen_len=16, block_size=8, refresh="never"), "refresh='never'.*one of"),
    (dict(gen_len=32, block_size=8), "exceeds max_context=32"),
])
def test_bad_diffusion_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        diffusion_generate(model, PROMPTS[0], **kwargs)


def test_paradigm_specific_options_are_refused(model):
    with pytest.raises(ValueError, match="top_k=5.*autoregressive models only"):
        dx.generate(model, PROMPTS[0], 16, top_k=5)
    ar = dx.build_model(tiny_config())
    with pytest.raises(ValueError, match="block_size=8.*paradigm='diffusion' models only"):
        dx.generate(ar, PROMPTS[0], 16, block_size=8)
    with pytest.raises(ValueError, match="paradigm='diffusion'"):
        diffusion_generate(ar, PROMPTS[0], 16, 8)
    with pytest.raises(dx.ConfigError, match="mask_token_id=5.*None for paradigm='ar'"):
        tiny_config(mask_token_id=5)
    with pytest.raises(dx.ConfigError, match="mask_token_id=128"):
        tiny_config(paradigm="diffusion", mask_token_id=128)


def test_generate_dispatches_to_diffusion(model):
    np.testing.assert_array_equal(dx.generate(model, PROMPTS[0], 16, block_size=8),
                                  diffusion_generate(model, PROMPTS[0], **K07))


def test_masked_diffusion_objective_masks_at_rate_t():
    from dantinox.train.trainer import masked_nll, training_loss

    cfg = tiny_config(paradigm="diffusion", mask_token_id=127)
    graphdef, params, rest = nnx.split(dx.build_model(cfg), nnx.Param, ...)
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 127, (4, 33)).astype(np.int32)
    noise = rng.random((4, 33), dtype=np.float32)
    nll, masked, t = jax.jit(masked_nll, static_argnums=0)(graphdef, params, rest, windows, noise)
    np.testing.assert_array_equal(np.asarray(masked), noise[:, 1:] < np.asarray(t))
    assert 0.001 <= np.asarray(t).min() and np.asarray(t).max() < 1.0
    want = float((np.asarray(nll) * np.asarray(masked) / np.asarray(t)).sum() / nll.size)
    loss = jax.jit(training_loss, static_argnums=0)(graphdef, params, rest, windows, noise)
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_budget_prints_the_dual_cache_table(capsys):
    from dantinox.cli.entrypoint import main

    assert main(["budget", "--preset", "dante-diffusion", "--context", "256", "--gen-len", "100"]) == 0
    out = capsys.readouterr().out
    assert "DualCache" in out and "156" in out


def test_diffusion_training_appends_the_mask_token(tmp_path):
    from dantinox.runs.run_dir import load_run
    from dantinox.train import train

    text = tmp_path / "text.txt"
    text.write_text("Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura. " * 20, encoding="utf-8")
    summary = train(tiny_config(paradigm="diffusion", num_blocks=1), text, tmp_path / "run", tokenizer="char", steps=2,
                    batch_size=2, seq_len=16, eval_every=2, eval_batches=1, progress=False, log=lambda _: None)
    model, cfg, tokenizer, _ = load_run(tmp_path / "run")
    assert cfg.paradigm == "diffusion" and cfg.mask_token_id == cfg.vocab_size - 1
    assert tokenizer.decode([cfg.mask_token_id]) == "<mask>"
    assert summary["val_loss_unit"] == "nats per masked token" and np.isfinite(summary["val_loss"])


def test_bundled_diffusion_model_generates_with_and_without_cache(capsys):
    import os

    from dantinox.cli.entrypoint import main
    from dantinox.runs.bundled import bundled_run_dir

    run_dir = bundled_run_dir("dante-diffusion")
    if not os.path.isdir(run_dir):
        pytest.skip("the bundled diffusion model is not installed")
    size = sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir))
    assert size <= 8 * 2**20
    args = ["generate", "--run_dir", run_dir, "--prompt", "Nel mezzo del cammin", "--gen_len", "32",
            "--steps_per_block", "4", "--temperature", "0"]
    assert main(args) == 0
    cached = capsys.readouterr().out
    assert main(args + ["--no_cache"]) == 0
    assert cached.startswith("Nel mezzo del cammin") and capsys.readouterr().out.startswith("Nel mezzo")
    assert main(args + ["--top_k", "5"]) == 2  # an AR-only option on a diffusion model
    capsys.readouterr()
    assert main(["verify", "--run_dir", run_dir]) == 2  # no causal static cache to verify
    assert main(["serve", "--run_dir", run_dir, "--port", "1"]) == 2  # the engine decodes AR models only
    assert capsys.readouterr().err.count("paradigm='diffusion'") == 2


def test_shifted_prediction_cache_paths_equal_no_cache():
    """cfg.shifted_prediction (AR-adapted models): slot i predicted at i - 1; the cached block forward also runs
    the slot before the block (in the prompt for block 0). K07 (b) and the batch rows still hold."""
    cfg = tiny_config(paradigm="diffusion", attention="gqa", kv_heads=2, mask_token_id=127, tie_embeddings=False,
                      shifted_prediction=True)
    model = dx.build_model(cfg, seed=3)
    no_cache = diffusion_generate_result(model, PROMPTS, **K07, use_cache=False)
    np.testing.assert_array_equal(diffusion_generate_result(model, PROMPTS, **K07, refresh="step").tokens,
                                  no_cache.tokens)
    for row, prompt in zip(diffusion_generate(model, PROMPTS, **K07), PROMPTS):
        np.testing.assert_array_equal(row, diffusion_generate(model, prompt, **K07))
    unshifted = dx.build_model(cfg.replace(shifted_prediction=False), seed=3)
    assert not np.array_equal(diffusion_generate_result(unshifted, PROMPTS, **K07, use_cache=False).tokens,
                              no_cache.tokens)
    with pytest.raises(dx.ConfigError, match="shifted_prediction"):
        tiny_config(shifted_prediction=True)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_shifted_objective_scores_token_i_at_position_i_minus_1():
    from dantinox.train.trainer import masked_nll

    cfg = tiny_config(paradigm="diffusion", mask_token_id=127, shifted_prediction=True)
    model = dx.build_model(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(1)
    windows = rng.integers(0, 127, (2, 17)).astype(np.int32)
    noise = rng.random((2, 17), dtype=np.float32)
    noise[:, 1] = 0.0  # token 0 would be masked, but a shifted model never masks it
    nll, masked, t = masked_nll(graphdef, params, rest, windows, noise)
    assert not np.asarray(masked)[:, 0].any()
    x0 = windows[:, :-1]
    logits = np.asarray(model(np.where(np.asarray(masked), 127, x0), use_cache=False)[0])
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp[:, :-1], x0[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(nll)[:, 1:], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--gen_len", "0"], "--gen_len 0 is not allowed: an integer >= 1"),
    (["--gen_len", "-8"], "--gen_len -8 is not allowed"),
    (["--block_size", "0"], "--block_size 0 is not allowed"),
    (["--steps_per_block", "0"], "--steps_per_block 0 is not allowed"),
    (["--max_new_tokens", "0"], "--max_new_tokens 0 is not allowed"),
    (["--gen_len", "32", "--max_new_tokens", "5"], "--gen_len 32 and --max_new_tokens 5 disagree"),
    (["--gen_len", "32", "--seed", "-1"], "--seed -1 is not allowed"),
    (["--gen_len", "32", "--steps_per_block", "3"], "--steps_per_block 3 is not allowed"),
])
def test_diffusion_cli_flags_are_checked_before_printing(flags, message, capsys):
    import os

    from dantinox.cli.entrypoint import main
    from dantinox.runs.bundled import bundled_run_dir

    run_dir = bundled_run_dir("dante-diffusion")
    if not os.path.isdir(run_dir):
        pytest.skip("the bundled diffusion model is not installed")
    assert main(["generate", "--run_dir", run_dir, "--prompt", "Nel mezzo"] + flags) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_diffusion_cli_uses_max_new_tokens_as_gen_len(capsys):
    import os

    from dantinox.cli.entrypoint import main
    from dantinox.runs.bundled import bundled_run_dir

    run_dir = bundled_run_dir("dante-diffusion")
    if not os.path.isdir(run_dir):
        pytest.skip("the bundled diffusion model is not installed")
    assert main(["generate", "--run_dir", run_dir, "--prompt", "Nel mezzo", "--max_new_tokens", "8",
                 "--temperature", "0"]) == 0
    assert "8 new tokens" in capsys.readouterr().err
