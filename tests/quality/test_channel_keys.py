"""K13's second arm: per-channel int8 keys over groups of tokens (KIVI) as ``dantinox eval`` runs them, and the
eval's windows sized to the slice (issue 19, item 3). References are numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from dantinox import ModelConfig, build_model
from dantinox.budget import kv_channel_key_cache_bytes
from dantinox.quality.channel_keys import ChannelKeyKV
from dantinox.quality.teacher_forcing import batches, fed_prefix, teacher_forced, window_length
from dantinox.kv.channel_keys import channel_roundtrip, quantize_channels
from dantinox.quant.kv_dtype import with_config


def numpy_channels(k, group):
    """Per-channel absmax int8 over groups of ``group`` slots: (codes, scales [.., S / G, D], read-back)."""
    *lead, S, D = k.shape
    x = k.astype(np.float64).reshape(*lead, S // group, group, D)
    scale = np.abs(x).max(axis=-2) / 127.0
    safe = np.where(scale > 0, scale, 1.0)[..., None, :]
    q = np.clip(np.round(x / safe), -127, 127)
    return q.reshape(k.shape), scale, (q * scale[..., None, :]).reshape(k.shape)


def test_channel_quantizer_matches_numpy_and_one_outlier_token_coarsens_only_its_group():
    k = np.random.default_rng(0).normal(size=(2, 3, 16, 8)).astype(np.float32)
    k[:, :, 0] *= 50.0                                           # an attention-sink-like first token
    q, scale = quantize_channels(jnp.asarray(k), 4)
    want_q, want_scale, want_back = numpy_channels(k, 4)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-6)
    back = np.asarray(channel_roundtrip(jnp.asarray(k), 4))
    np.testing.assert_allclose(back, want_back, rtol=1e-5, atol=1e-6)
    err = np.abs(back - k)
    assert err[:, :, 4:].max() <= want_scale[:, :, 1:].max() / 2 + 1e-6   # later groups keep their own steps
    assert err[:, :, 1:4].max() > 10 * err[:, :, 4:].max()               # the outlier's group is coarse
    with pytest.raises(ValueError, match="do not divide into key groups of 5"):
        quantize_channels(jnp.asarray(k), 5)


def numpy_attention(q, k, v, group, sinks):
    """The per-channel view's rule: query slot t reads key s from int8 when (s // G + 1) G <= t and s >= A; the
    A sinks (always read in float) count as zeros in their group's scale."""
    quantized = k.copy()
    quantized[:, :, :sinks] = 0.0
    _, _, kq = numpy_channels(quantized, group)
    S = k.shape[2]
    t, s = np.arange(S)[:, None], np.arange(S)[None]
    keys = np.where(((s // group + 1) * group <= t) & (s >= sinks), 1, 0)
    scores = np.where(keys[None, None, None], np.einsum("bkgtd,bksd->bkgts", q, kq),
                      np.einsum("bkgtd,bksd->bkgts", q, k))
    scores = np.where((s <= t)[None, None, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bkgts,bksd->bkgtd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
@pytest.mark.parametrize("sinks", [0, 2])
def test_view_attention_matches_numpy_in_one_call_and_in_chunks(sinks):
    rng = np.random.default_rng(1)
    B, K, G, S, D = 2, 2, 3, 12, 8
    q = rng.normal(size=(B, K, G, S, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, K, S, D)).astype(np.float32) for _ in range(2))
    k[:, :, 0] *= 30.0
    want = numpy_attention(q, k, v, 4, sinks)
    stored = lambda a, b: (None,) * 4 + (jnp.asarray(k[:, :, a:b]), None)  # noqa: E731
    zeros = jnp.zeros((B, K, S, D), jnp.float32)
    view = ChannelKeyKV(zeros, zeros, 4, sinks)
    y, _ = view.attend_and_write(jnp.asarray(q), None, jnp.asarray(v), jnp.zeros(B, jnp.int32), None, None,
                                 stored(0, S))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    parts, view = [], ChannelKeyKV(zeros, zeros, 4, sinks)
    for a, b in ((0, 5), (5, 6), (6, 12)):
        y, view = view.attend_and_write(jnp.asarray(q[:, :, :, a:b]), None, jnp.asarray(v[:, :, a:b]),
                                        jnp.full(B, a, jnp.int32), None, None, stored(a, b))
        parts.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(parts, axis=3), want, rtol=1e-4, atol=1e-5)


def test_channel_key_bytes_count_the_layout_arrays():
    cfg = ModelConfig.from_preset("tiny", attention="gqa", kv_heads=2, cache_dtype="int8")
    K, D, G, S = 2, 8, 4, 30                                     # 30 slots: 8 key-scale groups, the last partial
    arrays = [np.zeros((K, S, D), np.int8)] * 2 + [np.zeros((K, S, 1), np.float32),
                                                   np.zeros((K, 8, D), np.float32),
                                                   np.zeros((K, 2 * G, D), np.float32)]  # the residual ring: 2 groups
    assert kv_channel_key_cache_bytes(cfg, 1, S, G) == cfg.num_blocks * sum(a.nbytes for a in arrays)
    assert kv_channel_key_cache_bytes(cfg, 3, S, G) == 3 * cfg.num_blocks * sum(a.nbytes for a in arrays)
    with pytest.raises(ValueError, match="attention='mla'"):
        kv_channel_key_cache_bytes(ModelConfig.from_preset("tiny-mla", cache_dtype="int8"), 1, S, G)


def test_eval_window_and_cache_follow_the_slice_not_max_context():
    # before: every window had max_context slots and every batch `batch` rows (SmolLM2: a 492-token slice ran
    # 8 rows x 8192 slots); now the window is the slice rounded up to a power of two, rows min(batch, windows)
    assert window_length(40, 256) == 64 and window_length(64, 256) == 64 and window_length(1000, 256) == 256
    (rows, mask), = list(batches(np.arange(40), 64, 8))
    assert rows.shape == (1, 64) and mask.sum() == 39
    assert [r.shape for r, _ in batches(np.arange(600), 256, 8)] == [(3, 256)]
    assert [r.shape for r, _ in batches(np.arange(2600), 256, 8)] == [(6, 256)] * 2   # 11 windows
    assert fed_prefix(64, 8, 1) == 8 and (64 - 1 - fed_prefix(64, 8, 16)) % 16 == 0


@pytest.fixture(scope="module")
def gqa_int8():
    cfg = ModelConfig.from_preset("tiny", attention="gqa", kv_heads=2, cache_dtype="int8", max_context=64)
    return build_model(cfg.replace(cache_dtype="float32"), seed=2), build_model(cfg, seed=2)


@pytest.mark.slow
@pytest.mark.parametrize("key_group", [0, 8])
def test_teacher_forced_figures_do_not_depend_on_the_chunk(gqa_int8, key_group):
    base, cand = gqa_int8
    cand = with_config(cand, cand.cfg.replace(kv_sink_tokens=0))
    ids = np.random.default_rng(3).integers(0, 128, 50)
    one = teacher_forced(base, cand, ids, prefix=6, batch=4, chunk=1, key_group=key_group)
    many = teacher_forced(base, cand, ids, prefix=6, batch=4, chunk=8, key_group=key_group)
    np.testing.assert_allclose(one, many, rtol=2e-5, atol=2e-5)
    assert one[2] > 0                                            # the int8 keys move the logits
