"""Cases K01-K05 of ../shared/cases/ACCEPTANCE.md, one named test (or group) each. K05's HTTP part belongs
to the serving issue. "Equal logits" is max |diff| <= 1e-5 in float32. K01, K02, K03 and K05 also run with
cache_dtype="int8" (issue 10): there the uncached forward and the numpy reference round-trip every key and
value row through int8 the same way the cache does.

Model calls go through conftest.forward (jitted: one compilation per shape, not per primitive and step); each
decode step is compared with one uncached forward over the final sequence, whose logits at position p are, by
causality, those of the forward over the sequence's first p + 1 tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KV_DTYPES, forward, reference_logits, spiky_model, tiered, tiny_config, uncached_logits

import dantinox as dx

EQ = 1e-5
# int8 caches against the numpy reference: its keys, computed in float64, can round to the other int8 code than
# the model's float32 keys at a rounding boundary (one code step, about 1e-4 in the logits here; which cases flip
# depends on XLA's code generation). A wrong head mapping moves K03's logits by 0.43-0.54 (measured by breaking
# the reference's mapping), so 1e-3 still tells them apart. The flip-adopting check is verify's
# (tests/quality/test_int8_reference.py).
INT8_FLIP = 1e-3


def decode_greedy(model, prompt, steps, cache=None):
    """Prefill `prompt` at cache_index 0, then `steps` greedy decode calls at cache_index len(prompt)+t.
    Returns (generated tokens, per-decode-step logits [V], final cache)."""
    cache = dx.init_cache(model.cfg, 1) if cache is None else cache
    logits, cache, _ = forward(model, np.array([prompt], np.int32), use_cache=True, kv_caches=cache, cache_index=0)
    tokens, step_logits = [int(np.argmax(logits[0, -1]))], []
    for t in range(steps):
        logits, cache, _ = forward(model, np.array([[tokens[-1]]], np.int32), use_cache=True, kv_caches=cache,
                                   cache_index=len(prompt) + t)
        step_logits.append(np.asarray(logits[0, -1]))
        tokens.append(int(np.argmax(step_logits[-1])))
    return tokens, step_logits, cache


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("prompt_len", [6, 1, 22])
def test_K01_decode_positions_follow_cache_index(prompt_len, kv_dtype):
    # kv_keys="token": the numpy reference quantizes keys per token (per-channel keys: test_channel_cache.py)
    model = spiky_model(tiny_config(cache_dtype=kv_dtype, kv_keys="token"))
    prompt = list(np.random.default_rng(prompt_len).integers(0, 128, prompt_len))
    tokens, step_logits, cache = decode_greedy(model, prompt, 10)
    # step t saw prompt + tokens[: t + 1]: its logits are position prompt_len + t of the final sequence's forward
    seq = np.array([prompt + tokens[:10]], np.int32)
    uncached = uncached_logits(model, seq)[0]
    reference = reference_logits(model, seq)[0]
    for t, logits in enumerate(step_logits):
        expected = uncached[prompt_len + t]
        assert np.abs(logits - expected).max() <= EQ, (t, np.abs(logits - expected).max())
        np.testing.assert_allclose(logits, reference[prompt_len + t], atol=EQ)
    if prompt_len == 22:  # the last decode step wrote slot 31, the last slot
        assert float(jnp.abs(cache[0].k[0, :, 31]).max()) > 0


def left_padded_run(model, prompts, pad_id, steps):
    """Greedy decoding of a left-padded batch with key_start = number of pad slots per row."""
    width = max(len(p) for p in prompts)
    pad = np.array([width - len(p) for p in prompts], np.int32)
    ids = np.array([[pad_id] * (width - len(p)) + list(p) for p in prompts], np.int32)
    cache = dx.init_cache(model.cfg, len(prompts))
    logits, cache, _ = forward(model, ids, use_cache=True, kv_caches=cache, cache_index=0, key_start=pad)
    all_logits = [np.asarray(logits[:, -1])]
    tokens = [all_logits[-1].argmax(-1)]
    for t in range(steps - 1):
        logits, cache, _ = forward(model, tokens[-1][:, None].astype(np.int32), use_cache=True, kv_caches=cache,
                                   cache_index=width + t, key_start=pad)
        all_logits.append(np.asarray(logits[:, -1]))
        tokens.append(all_logits[-1].argmax(-1))
    return np.stack(tokens, 1), np.stack(all_logits, 1)


@pytest.mark.parametrize("kv_dtype", tiered(KV_DTYPES, slow=["int8"]))
def test_K02_left_padded_batch_matches_solo_runs(kv_dtype):
    model = spiky_model(tiny_config(cache_dtype=kv_dtype))
    prompts = [[11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    tokens, logits = left_padded_run(model, prompts, pad_id=0, steps=12)
    for b, prompt in enumerate(prompts):
        solo_tokens, solo_logits = left_padded_run(model, [prompt], pad_id=0, steps=12)
        np.testing.assert_array_equal(tokens[b], solo_tokens[0])
        assert np.abs(logits[b] - solo_logits[0]).max() <= EQ
    tokens17, logits17 = left_padded_run(model, prompts, pad_id=17, steps=12)
    np.testing.assert_array_equal(tokens, tokens17)
    assert np.abs(logits - logits17).max() <= EQ
    # row 0's first real token sits at RoPE position 0: its prefill logits equal the unpadded forward
    alone = np.asarray(forward(model, np.array([prompts[0]], np.int32))[0])[0, -1]
    assert np.abs(logits[0, 0] - alone).max() <= EQ


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kv_heads", [pytest.param(8, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow),
                                      2, pytest.param(1, marks=pytest.mark.slow)])   # 2 in the default tier
def test_K03_grouped_heads_map_to_kv_head_h_div_group(kv_heads, kv_dtype):
    attention = {8: "mha", 1: "mqa"}.get(kv_heads, "gqa")
    cfg = tiny_config(attention=attention, kv_heads=kv_heads, cache_dtype=kv_dtype, kv_keys="token")  # as K01
    model = spiky_model(cfg)
    for batch in ([1, 3] if kv_heads == 1 else [1]):
        prompts = np.random.default_rng(batch).integers(0, 128, (batch, 5))
        cache = dx.init_cache(cfg, batch)
        assert all(layer.k.shape == (batch, kv_heads, 32, 8) == layer.v.shape for layer in cache)
        out = dx.generate(model, prompts, 20)
        for b in range(batch):
            seq = np.concatenate([prompts[b], out[b, :-1]])[None].astype(np.int32)
            ref = reference_logits(model, seq)[0]
            _, step_logits, _ = decode_greedy(model, list(prompts[b]), 19)
            for t, logits in enumerate(step_logits):
                assert np.abs(logits - ref[5 + t]).max() <= (EQ if kv_dtype == "float32" else INT8_FLIP)


def test_K03_kv_heads_not_dividing_heads_is_a_config_error():
    with pytest.raises(dx.ConfigError, match=r"kv_heads=3.*divisor of n_heads=8"):
        tiny_config(attention="gqa", kv_heads=3)


TIE_LOGITS = np.array([[0.1, 2.0, -1.0, 2.0, 0.5], [3.0, 1.0, 0.0, -2.0, 2.9]], np.float32)


@pytest.mark.parametrize("temperature", [0.0, -0.0, 1e-12])
@pytest.mark.parametrize("top_k", [0, 1, 5])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_K04_zero_temperature_is_greedy(temperature, top_k, top_p):
    params = dx.make_sampling_params(2, temperature, top_k, top_p)
    with jax.debug_nans(True), jax.debug_infs(True):
        for seed in range(3):
            out = dx.sample_next(jnp.asarray(TIE_LOGITS), jax.random.key(seed), params)
            np.testing.assert_array_equal(np.asarray(out), [1, 0])  # tie in row 0 -> lowest id


def test_K04_mixed_temperatures_and_generation_at_zero():
    params = dx.make_sampling_params(2, [0.0, 0.8], 0, 1.0)
    with jax.debug_nans(True), jax.debug_infs(True):
        rows0 = {int(dx.sample_next(jnp.asarray(TIE_LOGITS), jax.random.key(s), params)[0]) for s in range(20)}
    assert rows0 == {1}
    model = spiky_model(tiny_config())
    greedy = dx.generate(model, [3, 1, 4], 20)
    for seed in (0, 1, 12345):
        np.testing.assert_array_equal(dx.generate(model, [3, 1, 4], 20, temperature=0.0, seed=seed), greedy)
    with pytest.raises(ValueError, match="temperature=-0.5"):
        dx.generate(model, [3, 1, 4], 5, temperature=-0.5)


def test_K05_prompt_longer_than_context_is_rejected():
    model = dx.build_model(tiny_config())
    prompt = list(range(40))
    with pytest.raises(dx.CapacityError, match="40 tokens.*max_context=32"):
        dx.generate(model, prompt, 1)
    with pytest.raises(dx.CapacityError, match="max_context=32"):
        model(np.array([prompt], np.int32), use_cache=True, kv_caches=dx.init_cache(model.cfg, 1), cache_index=0)


@pytest.mark.parametrize("kv_dtype", tiered(KV_DTYPES, slow=["int8"]))
def test_K05_prompt_plus_new_tokens_beyond_context_never_writes_past_last_slot(kv_dtype):
    model = spiky_model(tiny_config(cache_dtype=kv_dtype))
    with pytest.raises(dx.CapacityError, match=r"28 tokens \+ max_new_tokens=10 = 38 exceeds max_context=32"):
        dx.generate(model, list(range(28)), 10)
    assert len(dx.generate(model, list(range(28)), 4)) == 4  # what fits is served
    # Slot 31 is filled by decoding position 31; its key must equal the key an independent 32-token prefill
    # writes there, before and after every attempted write at or past slot 32.
    prompt = list(range(1, 32))
    tokens, _, cache = decode_greedy(model, prompt, 1)
    full = np.array([prompt + tokens[:1]], np.int32)
    _, reference, _ = forward(model, full, use_cache=True, kv_caches=dx.init_cache(model.cfg, 1), cache_index=0)
    expected = np.asarray(reference[0].k[0, :, 31])
    np.testing.assert_allclose(np.asarray(cache[0].k[0, :, 31]), expected, atol=1e-6)
    for index, width in ((32, 1), (31, 2), (40, 1), (np.array([32]), 1)):
        try:  # an unchecked write would be clamped by JAX onto slot 31 and return normally
            _, written, _ = model(np.full((1, width), 7, np.int32), use_cache=True, kv_caches=cache,
                                  cache_index=index)
        except dx.CapacityError as err:
            assert "max_context=32" in str(err)
        else:
            np.testing.assert_allclose(np.asarray(written[0].k[0, :, 31]), expected, atol=1e-6)
            pytest.fail(f"a write at cache_index={index} with {width} tokens was accepted")
    # The compiled path: generate checks the request on the host before the donated loop runs.
    with pytest.raises(dx.CapacityError):
        dx.generate(model, prompt, 2)
    result = dx.generate_result(model, prompt, 1)
    assert result.lengths.tolist() == [1] and result.finish_reasons == ["length"]
