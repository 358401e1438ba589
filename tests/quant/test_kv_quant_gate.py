"""The quality gate catches the fault it exists for (issue 10, point 6).

A quantizer with one scale per tensor instead of one per (token, KV head) is swapped into the int8 cache path;
a prompt whose first token's keys and values are scaled far above the rest (an attention sink) then makes the
gate fail, while the real per-token quantizer (dantinox.kv.int8_rows) passes the same gate. And one outlier row
leaves the quantization error of every other row unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dantinox import ModelConfig, build_model
from dantinox.cli.eval import candidate_model
from dantinox.quality.gate import check_gate
from dantinox.quality.slices import slice_quality
from dantinox.kv import int8_rows as kv_quant

SINK = 0
GATE = {"sink": {"loss_change_pct": 0.5, "agreement_min": 0.75}}


def per_tensor_roundtrip(x, dtype=None):
    """The deliberate fault: one absmax scale for the whole tensor, stored in the per-row layout."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32)) / 127.0
    q = jnp.clip(jnp.round(x32 / jnp.where(scale > 0, scale, 1.0)), -127, 127).astype(jnp.int8)
    scales = jnp.full(x.shape[:-1] + (1,), scale, jnp.float32)
    return kv_quant.dequantize_rows(q, scales, dtype or x.dtype), (q, scales)


def sink_model():
    """A tiny GQA model whose token SINK has keys and values ~100x larger than any other token's."""
    cfg = ModelConfig(attention="gqa", kv_heads=2, dim=64, n_heads=4, head_size=16, num_blocks=2, vocab_size=64,
                      max_context=64, mlp_hidden=128)
    model = build_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(64, 64)).astype(np.float32)
    emb[:, 0] = 0.0
    emb[SINK] = 0.0
    emb[SINK, 0] = 1.0   # the sink lives on channel 0, which no other token uses
    model.embed.embedding.set_value(jnp.asarray(emb))
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
    for block in model.blocks:
        w = np.asarray(block.attn.qkv.kernel[...]) * 20.0       # sharp attention: logits depend on keys
        w[0, H * D:] = rng.normal(size=2 * K * D) * 50.0      # channel 0 drives the K and V columns only
        block.attn.qkv.kernel.set_value(jnp.asarray(w))
    return model


def sink_stream(n=60):
    rng = np.random.default_rng(1)
    return np.concatenate([[SINK], rng.integers(1, 64, n - 1)])


def gate_results(baseline, candidate):
    q = slice_quality(baseline, candidate, sink_stream(), chars=59, prefix=16, batch=1, prompts=1,
                      prompt_tokens=16, continuation=24)
    base, cand = q.loss
    return {"sink": dict(loss_change_pct=100 * (cand - base) / base, agreement=q.agreement,
                         max_logit_diff=q.max_logit_diff)}


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_gate_fails_per_tensor_scale_and_passes_per_token_scale(monkeypatch):
    """Measured: loss change -0.16 % with the per-token quantizer, +1.24 % with the per-tensor one."""
    baseline = sink_model()
    candidate = candidate_model(sink_model(), "int8", None, keys="token")   # the per-token rows under test
    jax.clear_caches()
    good = gate_results(baseline, candidate)
    assert check_gate(GATE, good) == [], good
    monkeypatch.setattr("dantinox.kv.int8_rows.roundtrip", per_tensor_roundtrip)  # via roundtrip_for
    jax.clear_caches()  # retrace with the faulty quantizer
    bad = gate_results(baseline, candidate)
    jax.clear_caches()
    failures = check_gate(GATE, bad)
    assert any(f.startswith("sink.") for f in failures), bad


def test_one_outlier_row_leaves_every_other_rows_error_unchanged():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 16, 32)).astype(np.float32)   # [B, K, S, D]
    y = x.copy()
    y[:, :, 0] *= 1000.0                                    # one outlier token per row group

    def error(a, roundtrip):
        return np.abs(np.asarray(roundtrip(jnp.asarray(a))[0]) - a)

    def per_row(a):
        return (kv_quant.dequantize_rows(*kv_quant.quantize_rows(a)),)

    before, after = error(x, per_row), error(y, per_row)
    np.testing.assert_array_equal(after[:, :, 1:], before[:, :, 1:])
    assert (after[:, :, 0] > before[:, :, 0]).any()
    # the per-tensor quantizer, by contrast, coarsens every other row (so this test can tell them apart)
    wrong = error(y, per_tensor_roundtrip)
    assert wrong[:, :, 1:].mean() > 100 * before[:, :, 1:].mean()
