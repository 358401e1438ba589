"""The compiled decode-attention kernel (``dantinox.kv.decode_kernel``) against a numpy softmax over the
visible slots, against XLA's ``attention.attend``, on every instruction set this CPU has; a row's output does
not depend on the rows beside it; greedy decoding gives the same tokens with the kernel as without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import dantinox as dx
from dantinox.kv import decode_kernel as attention_kernel
from dantinox.kv.attend import attend
from dantinox.kv.static import LayerKV
from dantinox.quant.block_kernel import kernel_isa

pytestmark = pytest.mark.skipif(not attention_kernel.kernel_available(),
                                reason="the compiled extension (with decode attention) is not built")

ISAS = [isa for isa in ("scalar", "avx2", "avx512")
        if kernel_isa() and ["scalar", "avx2", "avx512"].index(isa) <= ["scalar", "avx2", "avx512"].index(kernel_isa())]


def reference(q, k_new, v_new, k_old, v_old, lo, hi):
    """float64 softmax of q [B, K, G, D] over slots [lo, hi) of k_old / v_old [B, K, L, D] and the new row."""
    B, K, G, D = q.shape
    out = np.zeros((B, K, G, D))
    for b in range(B):
        keys = np.concatenate([k_old[b, :, lo[b]:hi[b]], k_new[b, :, None]], axis=1).astype(np.float64)
        values = np.concatenate([v_old[b, :, lo[b]:hi[b]], v_new[b, :, None]], axis=1).astype(np.float64)
        scores = np.einsum("kgd,ksd->kgs", q[b].astype(np.float64), keys)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[b] = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), values)
    return out


def draw(rng, B, K, G, D, L):
    q = rng.normal(size=(B, K, G, D)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(B, K, D)).astype(np.float32) for _ in range(2))
    k_old, v_old = (rng.normal(scale=2.0, size=(B, K, L, D)).astype(np.float32) for _ in range(2))
    return q, k_new, v_new, k_old, v_old


def run(q, k_new, v_new, k_old, v_old, lo, hi, isa="auto"):
    B, K, G, D = q.shape
    y = attention_kernel.decode_attention(jnp.asarray(q)[:, :, :, None], jnp.asarray(k_new)[:, :, None],
                                          jnp.asarray(v_new)[:, :, None], LayerKV(jnp.asarray(k_old),
                                                                                  jnp.asarray(v_old)),
                                          jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32), isa=isa)
    return np.asarray(y)[:, :, :, 0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B, K, G, D, L", [(1, 3, 3, 64, 512), (3, 2, 4, 16, 300), (2, 1, 8, 40, 129),
                                           (1, 2, 2, 128, 200), (2, 2, 2, 32, 150), (4, 4, 1, 8, 7)])
def test_kernel_equals_a_numpy_softmax_over_the_visible_slots(isa, B, K, G, D, L):
    rng = np.random.default_rng(B * 100 + L)
    arrays = draw(rng, B, K, G, D, L)
    hi = rng.integers(0, L + 1, size=B)
    hi[0] = L                                   # a full window, and (below) an empty range and a left padding
    lo = np.minimum(rng.integers(0, 3, size=B), hi)
    if B > 1:
        lo[1], hi[1] = 0, 0
    got = run(*arrays, lo, hi, isa)
    np.testing.assert_allclose(got, reference(*arrays, lo, hi), rtol=2e-5, atol=2e-6)


def test_kernel_equals_xla_attend_with_padding_and_a_sliding_window(monkeypatch):
    rng = np.random.default_rng(7)
    B, K, G, D, L = 3, 2, 3, 32, 260
    q, k_new, v_new, k_old, v_old = draw(rng, B, K, G, D, L)
    cache_index, key_start = jnp.asarray([260, 131, 5], jnp.int32), jnp.asarray([0, 4, 2], jnp.int32)
    args = (jnp.asarray(q)[:, :, :, None], jnp.asarray(k_new)[:, :, None], jnp.asarray(v_new)[:, :, None],
            LayerKV(jnp.asarray(k_old), jnp.asarray(v_old)), cache_index, key_start)
    for window in (None, 100):
        with_kernel = np.asarray(attend(*args, window))[:, :, :, 0]
        monkeypatch.setenv(attention_kernel.ENV, "off")
        without = np.asarray(attend(*args, window))[:, :, :, 0]
        monkeypatch.delenv(attention_kernel.ENV)
        hi = np.asarray(cache_index)
        lo = np.maximum(np.asarray(key_start), hi - window + 1 if window else 0)
        want = reference(q, k_new, v_new, k_old, v_old, lo, hi)
        xla_error = np.abs(without - want).max()
        assert xla_error > 0 and np.abs(with_kernel - want).max() <= 2 * xla_error   # as close as XLA's path
        np.testing.assert_allclose(with_kernel, without, rtol=1e-4, atol=2e-5)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    rng = np.random.default_rng(3)
    q, k_new, v_new, k_old, v_old = draw(rng, 5, 3, 3, 64, 700)
    lo, hi = np.array([0, 2, 0, 1, 0]), np.array([700, 333, 129, 0, 640])
    whole = run(q, k_new, v_new, k_old, v_old, lo, hi)
    for b in range(5):
        alone = run(q[b:b + 1], k_new[b:b + 1], v_new[b:b + 1], k_old[b:b + 1], v_old[b:b + 1], lo[b:b + 1],
                    hi[b:b + 1])
        np.testing.assert_array_equal(whole[b], alone[0])


def test_greedy_tokens_with_the_kernel_equal_those_without(monkeypatch):
    cfg = tiny_config(attention="gqa", kv_heads=2)
    model = dx.build_model(cfg, seed=11)
    prompt = [[5, 9, 40, 77, 3, 12], [8, 1, 2, 0, 0, 0]]
    with_kernel = np.asarray(dx.generate(model, prompt, 12))
    monkeypatch.setenv(attention_kernel.ENV, "off")
    jax.clear_caches()
    without = np.asarray(dx.generate(model, prompt, 12))
    np.testing.assert_array_equal(with_kernel, without)


def verify_reference(q, k_new, v_new, written, index, key_start, window):
    """float64 causal softmax of T new tokens (q [B, K, G, T, D]) at slots index[b] + t over the written cache
    [B, K, L, D]: token t sees slots [max(key_start, slot - window + 1), slot] (its own from k_new / v_new)."""
    B, K, G, T, D = q.shape
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            slot = index[b] + t
            lo = max(key_start[b], slot - window + 1 if window else 0)
            keys = np.concatenate([written[0][b, :, lo:slot], k_new[b, :, t:t + 1]], axis=1).astype(np.float64)
            values = np.concatenate([written[1][b, :, lo:slot], v_new[b, :, t:t + 1]], axis=1).astype(np.float64)
            scores = np.einsum("kgd,ksd->kgs", q[b, :, :, t].astype(np.float64), keys)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, :, t] = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), values)
    return out


def draw_verify(rng, B, K, G, T, D, L, index):
    """q, new keys / values and a cache with the new tokens written at slots index .. index + T - 1."""
    q = (rng.normal(size=(B, K, G, T, D)) / np.sqrt(D)).astype(np.float32)   # scaled, as attend's callers do
    k_new, v_new = (rng.normal(size=(B, K, T, D)).astype(np.float32) for _ in range(2))
    k_old, v_old = (rng.normal(scale=2.0, size=(B, K, L, D)).astype(np.float32) for _ in range(2))
    for b in range(B):
        k_old[b, :, index[b]:index[b] + T], v_old[b, :, index[b]:index[b] + T] = k_new[b], v_new[b]
    return q, k_new, v_new, (k_old, v_old)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [None, 100])
def test_verify_tokens_equal_a_numpy_causal_softmax_over_the_written_cache(isa, window):
    """A verify call (T = 5 new tokens per row): token t sees the cached slots below its own (the earlier new
    tokens among them, read back from the written cache), past the row's padding, inside the window."""
    rng = np.random.default_rng(21)
    B, K, G, T, D, L = 3, 2, 3, 5, 64, 400
    index, key_start = np.array([0, 130, 395]), np.array([0, 3, 200])
    q, k_new, v_new, written = draw_verify(rng, B, K, G, T, D, L, index)
    lo, hi = attention_kernel.visible_slots(jnp.asarray(index, jnp.int32), jnp.asarray(key_start, jnp.int32),
                                            window, T)
    got = attention_kernel.decode_attention(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                                            LayerKV(*map(jnp.asarray, written)), lo, hi, isa=isa)
    want = verify_reference(q, k_new, v_new, written, index, key_start, window)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("window", [None, 300])
def test_a_verify_token_equals_the_decode_step_at_its_slot_bit_for_bit(window):
    """What keeps greedy speculation equal to plain decoding on the kernel path: token t of a verify call gives
    exactly the float32 result of a decode step at slot index + t over the same cache (tokens that share their
    first visible slot share the kernel's tasks; with a sliding window each has its own)."""
    rng = np.random.default_rng(5)
    B, K, G, T, D, L = 2, 3, 3, 9, 64, 700
    index = np.array([250, 509])
    q, k_new, v_new, written = draw_verify(rng, B, K, G, T, D, L, index)
    cache, key_start = LayerKV(*map(jnp.asarray, written)), jnp.asarray([0, 7], jnp.int32)
    verified = np.asarray(attention_kernel.verify_attention(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                                                            cache, jnp.asarray(index, jnp.int32), key_start, window))
    for t in range(T):
        step = attend(jnp.asarray(q[:, :, :, t:t + 1]), jnp.asarray(k_new[:, :, t:t + 1]),
                      jnp.asarray(v_new[:, :, t:t + 1]), cache, jnp.asarray(index + t, jnp.int32), key_start, window)
        np.testing.assert_array_equal(verified[:, :, :, t], np.asarray(step)[:, :, :, 0])


def test_a_cached_call_of_a_few_tokens_equals_xla_and_keeps_its_cache(monkeypatch):
    """A model's cached forward of T = 4 tokens after a prompt: logits within float32 rounding of XLA's
    attention (DANTINOX_ATTENTION_KERNEL=off), the same cache written; a 40-token chunk keeps XLA's path."""
    cfg = tiny_config(attention="gqa", kv_heads=2)
    model = dx.build_model(cfg, seed=4)
    prompt = jnp.asarray([[5, 9, 40, 77, 3, 12, 8, 1], [8, 1, 2, 3, 4, 6, 7, 9]], jnp.int32)
    more = jnp.asarray([[11, 12, 13, 14], [21, 22, 23, 24]], jnp.int32)
    cache = dx.init_cache(cfg, 2)

    def forward():
        _, filled, _ = model(prompt, use_cache=True, kv_caches=cache, cache_index=jnp.zeros((2,), jnp.int32))
        logits, written, _ = model(more, use_cache=True, kv_caches=filled, cache_index=jnp.full((2,), 8, jnp.int32))
        return np.asarray(logits), [np.asarray(a) for layer in written for a in layer]

    with_kernel, cache_kernel = forward()
    monkeypatch.setenv(attention_kernel.ENV, "off")
    without, cache_xla = forward()
    np.testing.assert_allclose(with_kernel, without, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache_kernel, cache_xla):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    q = jnp.zeros((1, 1, 1, attention_kernel.MAX_VERIFY_TOKENS + 1, 8), jnp.float32)
    layer = LayerKV(jnp.zeros((1, 1, 64, 8)), jnp.zeros((1, 1, 64, 8)))
    monkeypatch.delenv(attention_kernel.ENV)
    assert attention_kernel.verify_kernel_applies(q[:, :, :, :4], layer, None)
    assert not attention_kernel.verify_kernel_applies(q, layer, None)            # a prefill chunk: XLA
    assert not attention_kernel.verify_kernel_applies(q[:, :, :, :4], layer, 0)  # nothing cached to read
