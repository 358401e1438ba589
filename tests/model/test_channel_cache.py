"""Per-channel int8 keys (KIVI) in the static cache (issue 19 item 3, K13): dantinox.kv.channel_layout and
channel_attention.

The exactness property (one call, chunks or one token at a time give the same logits), equality with the eval
view ``dantinox.quality.channel_keys``, an independent numpy reference of one layer's stored arrays and
read-back, the budget against the real arrays, the compiled decode loop, and the refusals."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import spiky_model, tiny_config
from flax import nnx

import dantinox as dx
from dantinox.budget import kv_cache_bytes, plan_capacity
from dantinox.generation.speculative_generate import speculative_generate
from dantinox.kv.static import cache_nbytes, first_slots
from dantinox.kv.channel_attention import channel_attention
from dantinox.kv.channel_layout import ChannelQuantLayerKV, init_channel_layer
from dantinox.quality.channel_keys import channel_key_cache
from dantinox.kv.channel_keys import config_with_kv_keys
from dantinox.kv.int8_rows import quantize_rows

G = 4


def channel_cfg(**overrides):
    base = dict(attention="gqa", kv_heads=2, cache_dtype="int8", kv_keys="channel", kv_key_group=G)
    return tiny_config(**{**base, **overrides})


@partial(jax.jit, static_argnames=("graphdef", "fresh", "use_cache"))
def _call(graphdef, state, ids, cache, index, valid, key_start, *, fresh, use_cache=True):
    model = nnx.merge(graphdef, state)
    return model(ids, use_cache=use_cache, kv_caches=cache, cache_index=0 if fresh else index,
                 valid_tokens=valid, key_start=key_start)[:2]


def run(model, ids, cache=None, index=0, valid=None, key_start=None):
    """One model call through jit: (logits [B, T, V] numpy, the cache); cache None: the uncached forward."""
    graphdef, state = nnx.split(model)
    fresh = isinstance(index, int) and index == 0 and key_start is None
    as_int = lambda a: None if a is None else jnp.asarray(a, jnp.int32)  # noqa: E731
    logits, cache = _call(graphdef, state, jnp.asarray(ids, jnp.int32), cache, jnp.asarray(index, jnp.int32),
                          as_int(valid), as_int(key_start), fresh=fresh, use_cache=cache is not None)
    return np.asarray(logits), cache


@pytest.fixture(scope="module")
def model():
    return spiky_model(channel_cfg())


def test_all_at_once_in_chunks_or_one_token_at_a_time_give_the_uncached_logits(model):
    cfg = model.cfg
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 14))
    want, _ = run(model, ids)
    once, _ = run(model, ids, dx.init_cache(cfg, 2))
    np.testing.assert_array_equal(once, want)
    cache, parts = dx.init_cache(cfg, 2), []
    for a, b in ((0, 5), (5, 6), (6, 9), (9, 14)):      # chunks that start and end inside groups and on edges
        logits, cache = run(model, ids[:, a:b], cache, a)
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate(parts, 1), want, rtol=0, atol=2e-5)
    cache, parts = dx.init_cache(cfg, 2), []
    for a in range(14):
        logits, cache = run(model, ids[:, a:a + 1], cache, a)
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate(parts, 1), want, rtol=0, atol=2e-5)
    token = run(spiky_model(cfg.replace(kv_keys="token")), ids)[0]
    assert np.abs(token - want).max() > 1e-3         # the layout is not the per-token one


def test_rows_at_different_slots_after_a_right_padded_prefill(model):
    """Prefill of a bucket with valid_tokens (right padding never enters a key group), then one token per
    step at each row's own slot: each row's logits are its uncached forward's."""
    cfg = model.cfg
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, cfg.vocab_size, 11), rng.integers(0, cfg.vocab_size, 11)]
    lengths = np.array([3, 7])
    bucket = np.zeros((2, 8), np.int64)
    for b, n in enumerate(lengths):
        bucket[b, :n] = seqs[b][:n]
        bucket[b, n:] = 99                            # padding keys that must not set a group's scale
    logits, cache = run(model, bucket, dx.init_cache(cfg, 2), valid=lengths)
    got = [[logits[b, n - 1]] for b, n in enumerate(lengths)]
    for step in range(4):
        feed = np.array([[seqs[b][n + step]] for b, n in enumerate(lengths)])
        out, cache = run(model, feed, cache, lengths + step)
        for b in range(2):
            got[b].append(out[b, 0])
    for b, n in enumerate(lengths):
        want, _ = run(model, seqs[b][None, :n + 4])
        np.testing.assert_allclose(np.stack(got[b]), want[0, n - 1:], rtol=0, atol=2e-5)


def test_left_padding_matches_the_uncached_forward_with_key_start(model):
    cfg = model.cfg
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 10))
    key_start = np.array([0, 3])
    want, _ = run(model, ids, key_start=key_start)
    cache = dx.init_cache(cfg, 2)
    first, cache = run(model, ids[:, :6], cache, 0, key_start=key_start)
    rest, _ = run(model, ids[:, 6:], cache, 6, key_start=key_start)
    got = np.concatenate([first, rest], 1)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=2e-5)
    np.testing.assert_allclose(got[1, 3:], want[1, 3:], rtol=0, atol=2e-5)    # the padding's queries: unused


def test_real_cache_equals_the_eval_view_on_the_same_inputs(model):
    cfg = model.cfg
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 13))
    real, view, got_real, got_view = dx.init_cache(cfg, 2), channel_key_cache(cfg, 2, 16, G), [], []
    for a, b in ((0, 6), (6, 7), (7, 13)):
        logits, real = run(model, ids[:, a:b], real, a)
        got_real.append(logits)
        logits, view = run(model, ids[:, a:b], view, a)
        got_view.append(logits)
    np.testing.assert_allclose(np.concatenate(got_real, 1), np.concatenate(got_view, 1), rtol=0, atol=2e-5)


def numpy_layer(q, k, v, sinks):
    """Numpy reference of one layer: keys of complete groups per-channel absmax int8 (the sinks, read in float,
    counting as zeros in their group's scale), the filling group and the sinks in float, values per-token
    absmax int8 (sinks in float). Returns (y, codes, scales)."""
    B, K, S, D = k.shape
    N = S // G
    x = k[:, :, :N * G].astype(np.float64)
    x[:, :, :sinks] = 0.0
    x = x.reshape(B, K, N, G, D)
    scale = (np.abs(x).max(axis=-2) / 127.0).astype(np.float32)
    codes = np.clip(np.round(x / np.where(scale > 0, scale, 1)[..., None, :]), -127, 127)
    k_int8 = (codes * scale[..., None, :]).reshape(B, K, N * G, D)
    vs = np.abs(v).max(-1, keepdims=True).astype(np.float32) / np.float32(127)
    v_back = np.clip(np.round(v / np.where(vs > 0, vs, 1)), -127, 127) * vs
    v_back[:, :, :sinks] = v[:, :, :sinks]
    t, s = np.arange(S)[:, None], np.arange(S)[None]
    from_int8 = ((s // G + 1) * G <= t) & (s >= sinks)
    padded = np.concatenate([k_int8, k[:, :, N * G:]], axis=2)
    scores = np.where(from_int8, np.einsum("bkgtd,bksd->bkgts", q, padded), np.einsum("bkgtd,bksd->bkgts", q, k))
    scores = np.where(s <= t, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bkgts,bksd->bkgtd", p / p.sum(-1, keepdims=True), v_back), codes, scale


@pytest.mark.parametrize("sinks", [0, 2])
def test_one_layer_stores_and_reads_back_as_numpy_does(sinks):
    cfg = channel_cfg(max_context=16, kv_sink_tokens=sinks)
    rng = np.random.default_rng(4)
    B, K, S, D = 2, 2, 14, cfg.head_size
    q = rng.normal(size=(B, K, 2, S, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, K, S, D)).astype(np.float32) for _ in range(2))
    k[:, :, :, 1] *= 40.0                                    # an outlier channel, as KIVI's figure 2
    want, codes, scales = numpy_layer(q, k, v, sinks)
    layer, parts = init_channel_layer(cfg, B), []
    step = jax.jit(lambda *a: channel_attention(cfg, *a[:3], a[3], a[3], *a[4:]))
    for a, b in ((0, 3), (3, 9), (9, 10), (10, 14)):
        vq, vs = quantize_rows(jnp.asarray(v[:, :, a:b]))
        back = np.asarray(vq, np.float32) * np.asarray(vs)
        back[:, :, :max(0, sinks - a)] = v[:, :, a:a + max(0, sinks - a)]
        stored = (None, vq, None, vs, jnp.asarray(k[:, :, a:b]), jnp.asarray(v[:, :, a:b]))
        y, layer = step(jnp.asarray(q[:, :, :, a:b]), jnp.asarray(k[:, :, a:b]), jnp.asarray(back), layer,
                        jnp.full(B, a, jnp.int32), None, stored)
        parts.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(parts, 3), want, rtol=1e-4, atol=1e-5)
    N = S // G                                                # 3 complete groups, slots 12, 13 filling
    np.testing.assert_array_equal(np.asarray(layer.k)[:, :, :N * G], codes.reshape(B, K, N * G, D))
    np.testing.assert_allclose(np.asarray(layer.k_scale)[:, :, :N], scales, rtol=1e-6)
    ring = np.asarray(layer.k_residual)                      # slot s at s mod 2 G: groups 2 and 3 (slots 8..13)
    assert ring.shape[2] == 2 * G
    np.testing.assert_array_equal(ring[:, :, np.arange(8, S) % (2 * G)], k[:, :, 8:])
    np.testing.assert_array_equal(np.asarray(layer.k_sink), k[:, :, :sinks])


@pytest.mark.parametrize("group, sinks, slots", [(4, 4, 32), (5, 0, 32), (64, 4, 48)])
def test_budget_counts_the_allocated_arrays(group, sinks, slots):
    cfg = channel_cfg(kv_key_group=group, kv_sink_tokens=sinks, max_context=slots)
    cache = dx.init_cache(cfg, 3)
    assert isinstance(cache[0], ChannelQuantLayerKV)
    assert cache_nbytes(cache) == kv_cache_bytes(cfg, 3, slots) == 3 * kv_cache_bytes(cfg, 1, slots)
    K, D, A = cfg.kv_heads, cfg.head_size, cfg.sink_slots
    G = min(group, slots)            # a group longer than the context is clipped to it (64 -> 48: cfg.key_group)
    assert cfg.key_group == G and cache[0].k_residual.shape[-2] == 2 * G
    per_layer = slots * (2 * K * D + 4 * K) + -(-slots // G) * K * D * 4 + 2 * G * K * D * 4 + A * 2 * K * D * 4
    assert kv_cache_bytes(cfg, 1, slots) == cfg.num_blocks * per_layer
    assert kv_cache_bytes(cfg, 1, slots, "float32") == slots * cfg.num_blocks * 2 * K * D * 4   # no int8: no layout
    plan = plan_capacity(cfg, 2 ** 30, [(5, 3)], admission="request")
    assert plan.bytes_per_request == kv_cache_bytes(cfg, 1, 8)


def test_a_cut_cache_keeps_the_residual_and_the_groups_covering_it():
    cfg = channel_cfg(kv_key_group=8)
    cut = first_slots(dx.init_cache(cfg, 1)[0], 12)
    assert [a.shape[-2] for a in cut] == [12, 12, 2, 12, 16, 4, 4]   # the residual ring: 2 G


@pytest.mark.slow
def test_the_compiled_decode_loop_matches_the_uncached_run_and_compiles_once():
    """B = 2 on S = 256: decode windows 128 and 256 (cache_window cuts the layout); greedy tokens equal the
    use_cache=False path; a second request of the same bucket compiles nothing."""
    cfg = channel_cfg(max_context=256, kv_key_group=64)
    model = spiky_model(cfg, qk_scale=4.0)
    prompts = [[5, 9, 2, 7, 1, 3], [8, 1]]
    with dx.CompileCounter():
        cached = dx.generate(model, prompts, 130)
    assert np.array_equal(cached, dx.generate(model, prompts, 130, use_cache=False))
    with dx.CompileCounter() as again:
        dx.generate(model, [[4, 4, 4], [1, 2, 3, 4, 5, 6, 7]], 60, temperature=0.7, seed=2)
    assert again.compilations == 0, again


def test_oversized_speculation_and_bad_layouts_are_refused_naming_the_flag(model):
    with pytest.raises(ValueError, match="--spec-tokens 4 is not allowed with --kv-key-group 4"):
        speculative_generate(model, [[1, 2, 3]], 4)
    with pytest.raises(ValueError, match="--kv-keys channel needs an int8"):
        config_with_kv_keys(tiny_config(attention="gqa", kv_heads=2), "channel")
    with pytest.raises(ValueError, match="--kv-keys channel needs an int8"):
        config_with_kv_keys(dx.ModelConfig.from_preset("tiny-mla", cache_dtype="int8"), "channel")
    with pytest.raises(ValueError, match="--kv-keys 'row' is not allowed"):
        config_with_kv_keys(channel_cfg(), "row")
    with pytest.raises(ValueError, match="--kv-key-group 0 is not allowed"):
        config_with_kv_keys(channel_cfg(), "channel", 0)
    assert config_with_kv_keys(channel_cfg(kv_keys="token"), "channel", 8).kv_key_group == 8
