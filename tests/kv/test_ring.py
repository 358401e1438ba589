"""A sliding layer's static cache as a ring (dantinox.kv.ring): W + slack slots instead of max_context, the same
numbers as the full cache and the uncached forward at every position across the window edge, for prompts
longer than the ring (one call or chunks), float and int8, through prefill with right padding, the compiled decode
loop and speculation (whose rejected writes roll back inside the ring); bytes follow the ring."""

import numpy as np
import pytest
from conftest import forward, spiky_model, uncached_logits

import dantinox as dx
from dantinox.generation.speculative_generate import speculative_generate
from dantinox.kv import sizes
from dantinox.kv.ring import RING_SLACK
from dantinox.kv.spec import layer_specs
from dantinox.quality.verify import verify_cache

W, S = 8, 128   # ring of W + RING_SLACK = 72 slots in a context of 128


def ring_config(**overrides):
    fields = dict(attention="gqa", kv_heads=2, dim=64, n_heads=8, head_size=8, num_blocks=2, vocab_size=128,
                  max_context=S, mlp_hidden=128, sliding_window=W, layer_types=["sliding_attention", "full_attention"])
    fields.update(overrides)
    return dx.ModelConfig(**fields)


def _tolerance(want):
    return np.maximum(1e-4, 1e-5 * np.abs(want).max(-1, keepdims=True))


def test_the_window_layers_cache_is_a_ring_and_its_bytes_follow():
    cfg = ring_config()
    R = W + RING_SLACK
    assert [spec.ring for spec in layer_specs(cfg)] == [R, 0]
    cache = dx.init_cache(cfg, 2)
    assert cache[0].k.shape == (2, 2, R, 8) and cache[1].k.shape == (2, 2, S, 8)
    assert sizes.cache_bytes(cfg, 2, S) == dx.cache_nbytes(cache)
    assert sizes.bytes_by_kind(cfg, S) == {"sliding": 2 * 2 * R * 8 * 4, "full": 2 * 2 * S * 8 * 4}
    assert layer_specs(cfg.replace(window_cache="full"))[0].ring == 0
    assert layer_specs(cfg.replace(cache_dtype="int8"))[0].ring == 0          # per-channel keys stay whole
    assert layer_specs(cfg.replace(cache_dtype="int8", kv_keys="token"))[0].ring == R
    with pytest.raises(dx.ConfigError, match="window_cache"):
        cfg.replace(window_cache="circle")


@pytest.mark.parametrize("dtype", [dict(), dict(cache_dtype="int8", kv_keys="token")], ids=["float32", "int8"])
@pytest.mark.parametrize("chunks", [(100,), (30, 30, 30, 10)], ids=["one-call", "chunks"])
def test_ring_equals_the_uncached_forward_past_the_ring(dtype, chunks):
    cfg = ring_config(**dtype)
    model = spiky_model(cfg)
    seq = np.random.default_rng(4).integers(0, cfg.vocab_size, 120).tolist()
    want = uncached_logits(model, [seq])[0, :120]
    cache, got, at = dx.init_cache(cfg, 1), [], 0
    for n in chunks:
        logits, cache, _ = forward(model, np.array([seq[at:at + n]]), use_cache=True, kv_caches=cache,
                                   cache_index=at)
        got.append(np.asarray(logits[0]))
        at += n
    for t in range(at, 120):                                                  # decode steps past the prefill
        logits, cache, _ = forward(model, np.array([[seq[t]]]), use_cache=True, kv_caches=cache, cache_index=t)
        got.append(np.asarray(logits[0]))
    got = np.concatenate(got)
    assert np.all(np.abs(got - want) <= _tolerance(want)), float(np.abs(got - want).max())


def test_generation_through_the_ring_equals_the_full_cache():
    cfg = ring_config()
    ring, full = spiky_model(cfg), spiky_model(cfg.replace(window_cache="full"))
    prompts = [np.random.default_rng(1).integers(0, 128, n).tolist() for n in (5, 90)]   # padded batch; > ring
    a = np.asarray(dx.generate(ring, prompts, 30))
    b = np.asarray(dx.generate(full, prompts, 30))
    assert np.array_equal(a, b)
    report = verify_cache(ring, prompts[1], 30)
    assert report.passed, float(report.max_diff.max())


def test_int8_ring_verifies():
    cfg = ring_config(cache_dtype="int8", kv_keys="token")
    report = verify_cache(spiky_model(cfg), np.random.default_rng(2).integers(0, 128, 80).tolist(), 40)
    assert report.passed and report.rounding_flips.faults == 0, float(report.max_diff.max())


def test_speculation_rolls_back_inside_the_ring():
    cfg = ring_config()
    model = spiky_model(cfg)
    prompt = ([3, 1, 4, 1, 5, 9, 2, 6] * 10)[:76]                              # repeats: n-gram proposals
    plain = np.asarray(dx.generate(model, prompt, 40)).tolist()
    result, stats = speculative_generate(model, prompt, 40, spec_tokens=4)
    assert np.asarray(result.tokens).reshape(-1).tolist() == np.asarray(plain).reshape(-1).tolist()
    assert sum(stats.proposed) > 0 and sum(stats.accepted) < sum(stats.proposed)   # some proposals rejected


def test_budget_splits_a_hybrid_model_by_layer_kind(tmp_path, capsys):
    """Gemma 3 270M's shape (18 layers, 15 of them sliding over 512 tokens, one KV head of 256) at its 32,768-token
    context: the ring keeps a sequence's cache at 0.18x of a full-length one (bfloat16: 104 MiB against 576)."""
    from dantinox.cli import entrypoint as cli

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    config = tmp_path / "gemma3-shape.json"
    config.write_text(__import__("json").dumps(dict(
        attention="gqa", kv_heads=1, dim=640, n_heads=4, head_size=256, num_blocks=18, vocab_size=1024,
        max_context=32768, sliding_window=512, layer_types=types, cache_dtype="bfloat16")))
    assert cli.main(["budget", "--config", str(config), "--context", "32768", "--device-memory", "8GB"]) == 0
    table = capsys.readouterr().out.split("by layer kind (MiB)", 1)[1].split("\n\n", 1)[0]
    cells = {line.rsplit(None, 1)[0].strip(): line.split()[-1] for line in table.splitlines()[3:] if line.strip()}
    assert cells["sliding x 15 (W 512, ring 576 slots)"] == "8.438" and cells["full x 3"] == "96"
    assert float(cells["all layers"]) / float(cells["every layer full-length"]) < 0.2
    assert cells["every layer full-length"] == "576"
