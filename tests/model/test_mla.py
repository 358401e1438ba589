"""Multi-head latent attention: naive == absorbed, cached == uncached at every position (batch 1, ragged
batches with per-row cache_index, left padding), the acceptance cases K01-K03 rerun with attention="mla",
an independent per-head reference, the compiled decode loop, and config validation.

Tiny shape of ../shared/cases/ACCEPTANCE.md: vocab 128, dim 64, 2 layers, 8 heads x 8, max_context 32; MLA
with kv_latent_dim 16 and rope_head_dim 8. "Equal logits" is max |diff| <= 1e-5 in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KV_DTYPES, forward, qdq_after_sinks, spiky_mla, tiered
from flax import nnx

import dantinox as dx
from dantinox.kv.static import LatentKV

EQ = 1e-5
PATHS = {"absorbed": True, "naive": False}


def mla_config(**overrides) -> dx.ModelConfig:
    return dx.ModelConfig.from_preset("tiny-mla", **overrides)


def twin(model):
    """The same parameters with the other attention path (mla_absorb flipped)."""
    other = spiky_mla(model.cfg.replace(mla_absorb=not model.cfg.mla_absorb))
    nnx.update(other, nnx.state(model, nnx.Param))
    return other


def mla_reference_logits(model, ids: np.ndarray) -> np.ndarray:
    """Independent float64 numpy forward (DeepSeek-V2 section 2.1 written out per head, explicit causal mask,
    no cache, no absorption). ids: [B, T] -> logits [B, T, V]. With cache_dtype="int8" the latent and the
    RoPE key rows of every token after the first cfg.sink_slots (the float32 sinks) go through ``qdq_rows``."""
    cfg = model.cfg
    p = lambda x: np.asarray(x[...], np.float64)  # noqa: E731
    B, T = ids.shape
    H, D, C, R, Q = cfg.n_heads, cfg.head_size, cfg.kv_latent_dim, cfg.rope_head_dim, cfg.q_latent_dim or 0
    ang = np.arange(T)[:, None] * (1.0 / cfg.rope_theta ** (np.arange(0, R, 2) / R))
    cos, sin = np.cos(ang), np.sin(ang)                                  # [T, R/2]

    def rope(t):  # [B, T, R]
        a, b = t[..., : R // 2], t[..., R // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def rms(t, scale):
        return t / np.sqrt(np.mean(t * t, -1, keepdims=True) + cfg.norm_eps) * scale

    emb = p(model.embed.embedding)
    x = emb[ids]
    mask = np.tril(np.ones((T, T), bool))
    for blk in model.blocks:
        a = blk.attn
        h = rms(x, p(blk.attn_norm.scale))
        down = h @ p(a.down.kernel)
        c_q, c_kv, k_r = down[..., :Q], down[..., Q:Q + C], rope(down[..., Q + C:])
        q = ((rms(c_q, p(a.q_norm.scale)) if Q else h) @ p(a.q_up.kernel)).reshape(B, T, H, D + R)
        c_kv = rms(c_kv, p(a.kv_norm.scale))
        if cfg.cache_dtype == "int8":
            c_kv, k_r = qdq_after_sinks(c_kv, cfg.sink_slots), qdq_after_sinks(k_r, cfg.sink_slots)
        out = np.zeros((B, T, H, D))
        for head in range(H):
            k = np.concatenate([c_kv @ p(a.w_uk)[head].T, k_r], -1)      # [B, T, D + R]
            v = c_kv @ p(a.w_uv)[head]                                    # [B, T, D]
            qh = np.concatenate([q[:, :, head, :D], rope(q[:, :, head, D:])], -1)
            s = np.where(mask, np.einsum("btd,bsd->bts", qh, k) / np.sqrt(D + R), -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, :, head] = np.einsum("bts,bsd->btd", w / w.sum(-1, keepdims=True), v)
        x = x + out.reshape(B, T, H * D) @ p(a.out.kernel)
        gate, up = np.split(rms(x, p(blk.mlp_norm.scale)) @ p(blk.mlp.gate_up.kernel), 2, -1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p(blk.mlp.down.kernel)
    return rms(x, p(model.final_norm.scale)) @ emb.T


# Jitted entry points (one compile per config and shape; eager calls of the model are ~300x slower).
@nnx.jit
def _prefill(model, ids, cache):
    return model(ids, use_cache=True, kv_caches=cache, cache_index=0)[:2]      # the fresh-prefill path


@nnx.jit
def _prefill_padded(model, ids, cache, key_start):
    return model(ids, use_cache=True, kv_caches=cache, cache_index=0, key_start=key_start)[:2]


@nnx.jit
def _decode(model, ids, cache, index, key_start):
    return model(ids, use_cache=True, kv_caches=cache, cache_index=index, key_start=key_start)[:2]


@nnx.jit
def _forward(model, ids):
    return model(ids)[0]


def decode_step(model, tokens, cache, index, key_start=None):
    """One decode call for every row: tokens [B], index int or [B] -> (logits [B, V], cache)."""
    B = len(tokens)
    index = np.broadcast_to(np.asarray(index, np.int32), (B,))
    key_start = np.zeros(B, np.int32) if key_start is None else np.asarray(key_start, np.int32)
    logits, cache = _decode(model, np.asarray(tokens, np.int32)[:, None], cache, index, key_start)
    return np.asarray(logits[:, 0]), cache


def uncached(model, seqs) -> np.ndarray:
    """Plain causal forward (use_cache=False) over each row right-padded to max_context: [B, S, V]. By
    causality position t holds the last-position logits of the forward over seq[:t + 1]."""
    S = model.cfg.max_context
    return np.asarray(_forward(model, np.array([list(q) + [0] * (S - len(q)) for q in seqs], np.int32)))


def decode_greedy(model, prompt, steps):
    """Prefill at cache_index 0, then `steps` greedy decode calls at len(prompt)+t.
    Returns (tokens incl. the prefill's pick, per-decode-step logits [V], final cache)."""
    logits, cache = _prefill(model, np.array([prompt], np.int32), dx.init_cache(model.cfg, 1))
    tokens, step_logits = [int(np.argmax(logits[0, -1]))], []
    for t in range(steps):
        logits, cache = decode_step(model, [tokens[-1]], cache, len(prompt) + t)
        step_logits.append(logits[0])
        tokens.append(int(np.argmax(step_logits[-1])))
    return tokens, step_logits, cache


def assert_matches_uncached(model, prompt, tokens, step_logits):
    """Decode step t (which saw prompt + tokens[:t + 1]) equals the uncached logits at that position."""
    full = uncached(model, [prompt + tokens[:len(step_logits)]])[0]
    for t, logits in enumerate(step_logits):
        assert np.abs(logits - full[len(prompt) + t]).max() <= EQ, t


# ---------------------------------------------------------------------------------------------------------
# Configuration and cache layout


def test_mla_config_validation_names_field_value_and_allowed():
    cfg = mla_config()
    assert cfg.kv_heads is None and cfg.group_size == 1 and cfg.rope_dim == 8
    assert mla_config(rope_head_dim=None).rope_head_dim == 4          # head_size // 2, even
    bad = [(dict(kv_latent_dim=None), "kv_latent_dim"), (dict(kv_latent_dim=0), "kv_latent_dim"),
           (dict(kv_heads=2), "kv_heads"), (dict(rope_head_dim=3), "rope_head_dim"),
           (dict(rope_head_dim=-2), "rope_head_dim"), (dict(q_latent_dim=0), "q_latent_dim"),
           (dict(mla_absorb="yes"), "mla_absorb")]
    for change, field in bad:
        with pytest.raises(dx.ConfigError, match=f"ModelConfig.{field}=.*not allowed"):
            mla_config(**change)
    for field in ("kv_latent_dim", "rope_head_dim", "q_latent_dim"):
        with pytest.raises(dx.ConfigError, match=f"{field}=16.*only attention='mla'"):
            dx.ModelConfig.from_preset("tiny", **{field: 16})
    with pytest.raises(dx.ConfigError, match="attention"):
        mla_config(attention="latent")


def test_latent_cache_layout_and_shape_check():
    cfg = mla_config(cache_dtype="bf16")
    cache = dx.init_cache(cfg, 3)
    assert len(cache) == 2 and all(isinstance(layer, LatentKV) for layer in cache)
    assert cache[0].c_kv.shape == (3, 32, 16) and cache[0].k_rope.shape == (3, 32, 8)
    assert cache[0].c_kv.dtype == jnp.bfloat16
    model = dx.build_model(mla_config())
    wrong = dx.init_cache(dx.ModelConfig.from_preset("tiny"), 1)
    with pytest.raises(ValueError, match="c_kv"):
        model(np.zeros((1, 3), np.int32), use_cache=True, kv_caches=wrong, cache_index=0)


# ---------------------------------------------------------------------------------------------------------
# Naive == absorbed, cached == uncached


def forced_run(model, ids, prompt_len):
    """Prefill logits [B, prompt_len, V] and the decode steps' logits over the rest of ids (teacher
    forced)."""
    pre, cache = _prefill(model, ids[:, :prompt_len], dx.init_cache(model.cfg, ids.shape[0]))
    steps = []
    for t in range(prompt_len, ids.shape[1]):
        logits, cache = decode_step(model, ids[:, t], cache, t)
        steps.append(logits)
    return np.asarray(pre), np.stack(steps, 1)


def test_naive_and_absorbed_give_the_same_logits():
    absorbed = spiky_mla(mla_config())
    naive = twin(absorbed)
    ids = np.random.default_rng(0).integers(0, 128, (1, 12)).astype(np.int32)
    results = {}
    for name, model in (("absorbed", absorbed), ("naive", naive)):
        pre, steps = forced_run(model, ids, 7)
        full = uncached(model, ids)[:, :12]
        results[name] = (full, pre, steps)
        assert np.abs(pre - full[:, :7]).max() <= EQ          # each path's cache is exact
        assert np.abs(steps - full[:, 7:]).max() <= EQ
    for a, n in zip(results["absorbed"], results["naive"]):   # and the two paths agree
        assert np.abs(a - n).max() <= 1e-4
    np.testing.assert_allclose(results["naive"][0][0], mla_reference_logits(absorbed, ids)[0], atol=1e-4)


def test_absorbed_path_runs_in_bfloat16():
    """bf16 compute and cache (the head-batched W_UK / W_UV products have no bf16 -> f32 CPU kernel)."""
    model = spiky_mla(mla_config(compute_dtype="bf16", cache_dtype="bf16"))
    ids = np.random.default_rng(3).integers(0, 128, (1, 10)).astype(np.int32)
    pre, steps = forced_run(model, ids, 6)
    full = uncached(model, ids)[:, :10]
    assert np.abs(np.concatenate([pre, steps], 1) - full).max() <= 0.05 * max(1.0, np.abs(full).max())


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_ragged_batch_with_per_row_cache_index_matches_uncached(path, kv_dtype):
    """Three prompts of lengths 3, 5 and 8 prefilled together (right-padded), then decoded with one cache
    slot per row ([B] cache_index): every row's logits at every generated position equal its own uncached
    forward (for int8: the uncached forward that round-trips its latents the same way)."""
    model = spiky_mla(mla_config(mla_absorb=PATHS[path], cache_dtype=kv_dtype))
    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(0, 128, n)) for n in (3, 5, 8)]
    lengths = np.array([len(q) for q in seqs], np.int32)
    ids = np.array([q + [0] * (8 - len(q)) for q in seqs], np.int32)
    logits, cache = _prefill(model, ids, dx.init_cache(model.cfg, 3))
    last, got = np.asarray(logits)[np.arange(3), lengths - 1], []
    for step in range(6):
        got.append(last)
        nxt = last.argmax(-1)
        for b in range(3):
            seqs[b].append(int(nxt[b]))
        last, cache = decode_step(model, nxt, cache, lengths + step)
    full = uncached(model, seqs)
    for step, logits in enumerate(got):
        expected = full[np.arange(3), lengths - 1 + step]
        assert np.abs(logits - expected).max() <= EQ, step


def test_query_latent_sliding_window_and_no_rope_key_cached_match_uncached():
    model = spiky_mla(mla_config(q_latent_dim=16, sliding_window=5, rope_head_dim=0))
    prompt = list(np.random.default_rng(2).integers(0, 128, 7))
    tokens, step_logits, _ = decode_greedy(model, prompt, 6)
    assert_matches_uncached(model, prompt, tokens, step_logits)


# ---------------------------------------------------------------------------------------------------------
# Acceptance cases K01-K03 with attention="mla"


@pytest.mark.parametrize("prompt_len, kv_dtype",
                         tiered([(n, d) for d in KV_DTYPES for n in (6, 1, 22)], slow=[(6, "int8")]))
def test_K01_mla_decode_positions_follow_cache_index(prompt_len, kv_dtype):
    model = spiky_mla(mla_config(cache_dtype=kv_dtype))
    prompt = list(np.random.default_rng(prompt_len).integers(0, 128, prompt_len))
    tokens, step_logits, cache = decode_greedy(model, prompt, 10)
    assert_matches_uncached(model, prompt, tokens, step_logits)
    reference = mla_reference_logits(model, np.array([prompt + tokens[:-1]]))[0]
    np.testing.assert_allclose(np.stack(step_logits), reference[prompt_len:], atol=1e-4)
    if prompt_len == 22:  # the last decode step wrote slot 31, the last slot
        assert float(jnp.abs(cache[0].c_kv[0, 31]).max()) > 0
        assert float(jnp.abs(cache[0].k_rope[0, 31]).max()) > 0


def left_padded_run(model, prompts, pad_id, steps):
    """Greedy decoding of a left-padded batch with key_start = number of pad slots per row."""
    width = max(len(p) for p in prompts)
    pad = np.array([width - len(p) for p in prompts], np.int32)
    ids = np.array([[pad_id] * (width - len(p)) + list(p) for p in prompts], np.int32)
    logits, cache = _prefill_padded(model, ids, dx.init_cache(model.cfg, len(prompts)), pad)
    all_logits = [np.asarray(logits[:, -1])]
    for t in range(steps - 1):
        logits, cache = decode_step(model, all_logits[-1].argmax(-1), cache, width + t, pad)
        all_logits.append(logits)
    all_logits = np.stack(all_logits, 1)
    return all_logits.argmax(-1), all_logits


@pytest.mark.parametrize("path, kv_dtype",
                         tiered([(p, d) for d in KV_DTYPES for p in PATHS], slow=[("absorbed", "int8")]))
def test_K02_mla_left_padded_batch_matches_solo_runs(path, kv_dtype):
    model = spiky_mla(mla_config(mla_absorb=PATHS[path], cache_dtype=kv_dtype))
    prompts = [[11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    tokens, logits = left_padded_run(model, prompts, pad_id=0, steps=12)
    full = uncached(model, [p + list(t[:-1]) for p, t in zip(prompts, tokens)])
    for b, prompt in enumerate(prompts):     # each row equals the same prompt alone, without padding
        assert np.abs(logits[b] - full[b, len(prompt) - 1:len(prompt) + 11]).max() <= EQ, b
    if path == "absorbed":                   # and its own batch-1 cached run (left_padded_run of one row)
        solo_tokens, solo_logits = left_padded_run(model, prompts[:1], pad_id=0, steps=12)
        np.testing.assert_array_equal(tokens[0], solo_tokens[0])
        assert np.abs(logits[0] - solo_logits[0]).max() <= EQ
    tokens17, logits17 = left_padded_run(model, prompts, pad_id=17, steps=12)
    np.testing.assert_array_equal(tokens, tokens17)
    assert np.abs(logits - logits17).max() <= EQ


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_K03_mla_heads_read_their_own_up_projection_of_the_latent(batch, kv_dtype):
    """MLA's counterpart of the head-mapping case: the cache is [B, S, d_c] + [B, S, d_rope] whatever the
    batch (no squeezed axis), and at every position the logits equal a per-head reference in which head h
    uses W_UK[h], W_UV[h] and the shared RoPE key."""
    model = spiky_mla(mla_config(cache_dtype=kv_dtype))
    seq = np.random.default_rng(batch).integers(0, 128, (batch, 5)).astype(np.int32)
    logits, cache = _prefill(model, seq, dx.init_cache(model.cfg, batch))
    got = [np.asarray(logits[:, -1])]
    for t in range(20):
        nxt = got[-1].argmax(-1).astype(np.int32)
        seq = np.concatenate([seq, nxt[:, None]], 1)
        logits, cache = decode_step(model, nxt, cache, 5 + t)
        got.append(logits)
    for layer in cache:
        assert layer.c_kv.shape == (batch, 32, 16) and layer.k_rope.shape == (batch, 32, 8)
    got = np.stack(got, 1)                                   # positions 4 .. 24
    assert np.abs(got - uncached(model, seq)[:, 4:25]).max() <= EQ
    np.testing.assert_allclose(got, mla_reference_logits(model, seq)[:, 4:], atol=1e-4)
    with pytest.raises(dx.ConfigError, match="kv_heads=3"):
        mla_config(kv_heads=3)


# ---------------------------------------------------------------------------------------------------------
# Through jit with donation and lax.while_loop, and through dantinox.generation.decode


def test_latent_cache_in_a_compiled_while_loop_with_donation_and_no_cache_copies():
    cfg = mla_config()
    model = spiky_mla(cfg)
    graphdef, state = nnx.split(model)
    prompt, steps = [5, 9, 14, 3, 7, 1], 8

    def run(state, cache, token):
        m = nnx.merge(graphdef, state)

        def body(carry):
            i, cache, token, out = carry
            logits, cache, _ = m(token, use_cache=True, kv_caches=cache, cache_index=len(prompt) + i)
            token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
            return i + 1, cache, token, out.at[:, i].set(token[:, 0])

        init = (jnp.int32(0), cache, token, jnp.zeros((1, steps), jnp.int32))
        _, cache, _, out = jax.lax.while_loop(lambda c: c[0] < steps, body, init)
        return out, cache

    logits, cache = _prefill(model, np.array([prompt], np.int32), dx.init_cache(cfg, 1))
    first = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    compiled = jax.jit(run, donate_argnums=(1,)).lower(state, cache, first).compile()
    copies = [line for line in compiled.as_text().splitlines()
              if " copy(" in line and ("[1,32,16]" in line or "[1,32,8]" in line)]
    assert copies == []
    tokens, cache = compiled(state, cache, first)
    expected, _, expected_cache = decode_greedy(model, prompt, steps)
    np.testing.assert_array_equal(np.asarray(tokens)[0], expected[1:])
    np.testing.assert_allclose(np.asarray(cache[1].c_kv), np.asarray(expected_cache[1].c_kv), atol=1e-6)


def test_generate_with_mla_follows_the_verified_greedy_decode():
    model = spiky_mla(mla_config())
    prompt = [5, 9, 14, 3, 7, 1]
    expected, _, _ = decode_greedy(model, prompt, 9)
    tokens = np.asarray(dx.generate(model, [prompt], max_new_tokens=10)).ravel()
    np.testing.assert_array_equal(tokens, expected)


# ---------------------------------------------------------------------------------------------------------
# Attention windows: the decode loop attends over the first L cache slots while every row fits in them


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_attend_slots_gives_the_same_logits_and_rejects_bad_values(attention):
    if attention == "mla":
        model = spiky_mla(mla_config(max_context=64))
    else:
        model = dx.build_model(dx.ModelConfig.from_preset("tiny-mla", attention="gqa", max_context=64))
    cfg = model.cfg
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
    _, cache, _ = forward(model, ids, use_cache=True, kv_caches=dx.init_cache(cfg, 2), cache_index=0)
    new = jnp.asarray(ids[:, :3], jnp.int32)
    index = jnp.asarray([20, 17], jnp.int32)
    full, full_cache, _ = forward(model, new, use_cache=True, kv_caches=cache, cache_index=index)
    for slots in (20, 32, 64):
        got, got_cache, _ = forward(model, new, use_cache=True, kv_caches=cache, cache_index=index,
                                    attend_slots=slots)
        assert np.abs(np.asarray(got) - np.asarray(full)).max() <= EQ
        for a, b in zip(jax.tree_util.tree_leaves(got_cache), jax.tree_util.tree_leaves(full_cache)):
            assert np.abs(np.asarray(a) - np.asarray(b)).max() <= EQ   # layer 2 writes from layer 1's output
    # numpy integers are accepted (one compiled call: a fresh closure, so the model's argument check runs in its
    # trace; through `forward`, np.int64(32) would hit the program cached for the int 32 without any check)
    same = nnx.jit(lambda m, c: m(new, use_cache=True, kv_caches=c, cache_index=index, attend_slots=np.int64(32))[0])(
        model, cache)
    assert np.abs(np.asarray(same) - np.asarray(full)).max() <= EQ
    for bad in (0, 65, True, 8.0, np.int64(65)):
        with pytest.raises(ValueError, match="attend_slots"):
            model(new, use_cache=True, kv_caches=cache, cache_index=index, attend_slots=bad)
    with pytest.raises(ValueError, match="cache_index 20 > attend_slots=19"):
        model(new, use_cache=True, kv_caches=cache, cache_index=index, attend_slots=19)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_windowed_mla_decode_equals_one_window_and_the_uncached_path_across_window_edges(monkeypatch):
    gen = __import__("sys").modules["dantinox.generation.decode"]
    model = spiky_mla(mla_config(max_context=300))
    assert gen.decode_windows(model.cfg, 1) == (128, 256, 300)
    gqa = model.cfg.replace(attention="gqa")          # 8 query heads on 2 KV heads
    monkeypatch.setattr(gen, "kernel_available", lambda: True)    # decode attention in the compiled kernel:
    assert gen.decode_windows(gqa, 2) == (300,) and gen.decode_windows(model.cfg, 2) == (128, 256, 300)
    assert gen.decode_windows(gqa.replace(cache_dtype="bfloat16"), 2) == (128, 256, 300)   # not for bf16
    monkeypatch.setattr(gen, "kernel_available", lambda: False)   # XLA's attention reads the whole window
    assert gen.decode_windows(gqa, 1) == (300,) and gen.decode_windows(gqa, 2) == (128, 256, 300)
    assert gen.decode_windows(gqa.replace(attention="mha"), 2) == (128, 256, 300)   # any grouping at B >= 2
    assert gen.decode_windows(gqa.replace(attention="mha"), 1) == (300,)
    assert gen.decode_windows(gqa.replace(max_context=128), 2) == (128,)
    assert gen.decode_windows(gqa.replace(max_context=2048), 2) == (128, 256, 384, 512, 1024, 2048)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, 100).tolist(), rng.integers(0, 128, 7).tolist()]
    windowed = dx.generate(model, prompts, 190)                      # slots 100 .. 289 cross 128 and 256
    uncached = dx.generate(model, prompts, 190, use_cache=False)
    np.testing.assert_array_equal(windowed, uncached)
    graphdef, params = gen.split_model(model)
    req = gen._prepare(model, prompts, 190, 0.0, 0, 1.0, 0, None)
    state = gen.prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill)
    one = gen.decode(graphdef, params, state, jnp.int32(190), req.key, req.sampling, req.eos_id, req.fill,
                     windows=(300,))
    np.testing.assert_array_equal(np.asarray(one.out)[:, :190], windowed)
    for bad in ((400,), (256, 128, 300), (0, 300)):   # increasing, within max_context
        with pytest.raises(ValueError, match="windows="):
            gen.decode(graphdef, params, state, jnp.int32(190), req.key, req.sampling, req.eos_id, req.fill,
                       windows=bad)
    state = gen.prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill)
    short = gen.decode(graphdef, params, state, jnp.int32(190), req.key, req.sampling, req.eos_id, req.fill,
                       windows=(128,))   # a window below the request's bound: the loop stops at its end
    assert int(np.max(np.asarray(short.index))) == 128 and int(short.step) == 29
    np.testing.assert_array_equal(np.asarray(short.out)[:, :29], windowed[:, :29])
    with dx.CompileCounter() as warm:  # all windows live in one compiled decode program
        dx.generate(model, [rng.integers(0, 128, 99).tolist(), [3, 4]], 20, temperature=0.8, seed=5)
        dx.generate(model, [rng.integers(0, 128, 120).tolist(), [3]], 170)
    assert warm.compilations == 0, warm


def test_long_calls_run_the_expanded_form_and_mix_exactly_with_absorbed_decode():
    """mla_absorb=True: decode steps and short chunks attend against the latent, calls of T >= C D / (C - D)
    tokens expand it (cheaper there); a prefill of 20 tokens (expanded, C=16, D=8: threshold 16) followed by
    absorbed decode steps matches the independent float64 reference at every position."""
    model = spiky_mla(mla_config())
    attn = model.blocks[0].attn
    assert attn._path(1) == attn._absorbed and attn._path(15) == attn._absorbed
    assert attn._path(16) == attn._naive and attn._path(200) == attn._naive
    naive_only = spiky_mla(mla_config(mla_absorb=False)).blocks[0].attn
    assert naive_only._path(1) == naive_only._naive
    wide = spiky_mla(mla_config(kv_latent_dim=8, head_size=8))          # C <= D: absorbed at every T
    assert wide.blocks[0].attn._path(10_000) == wide.blocks[0].attn._absorbed
    ids = np.random.default_rng(5).integers(0, 128, (2, 26)).astype(np.int32)
    pre, steps = forced_run(model, ids, 20)
    reference = mla_reference_logits(model, ids)
    np.testing.assert_allclose(np.concatenate([pre, steps], 1), reference[:, :26], atol=1e-4)
