"""The compiled prefill-attention kernel (``dantinox.kv.prefill_attention``) against a float64 numpy softmax over
each token's visible keys, on every instruction set this CPU has (causal, sliding window, left padding, right
padding, prompt lengths that are not multiples of its blocks, head sizes 32 / 64 / 128, MHA and GQA); a token's
output does not depend on the tokens after it; ``attend`` hands long causal prompts to it and nothing else; a model's
prefill logits agree with XLA's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import dantinox as dx
from dantinox.kv import prefill_attention as pa
from dantinox.kv.attend import attend
from dantinox.quant.block_kernel import kernel_isa

ORDER = ["scalar", "avx2", "avx512"]
ISAS = [isa for isa in ORDER if kernel_isa() and ORDER.index(isa) <= ORDER.index(kernel_isa())]
pytestmark = pytest.mark.skipif(not ISAS or not pa.prefill_kernel_applies(
    jnp.zeros((1, 1, 1, 64, 32)), jnp.zeros((1, 1, 64, 32)), jnp.zeros((1, 1, 64, 32)), True),
    reason="the compiled extension (with prefill attention) is not built")


def reference(q, k, v, lo, hi):
    """float64 softmax of q [B, K, G, T, D] over keys [lo[b, t], hi[b, t]) of k, v [B, K, T, D]; zeros where the
    range is empty."""
    B, K, G, T, D = q.shape
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            a, e = lo[b, t], hi[b, t]
            if a >= e:
                continue
            s = np.einsum("kgd,ksd->kgs", q[b, :, :, t].astype(np.float64), k[b, :, a:e].astype(np.float64))
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, :, t] = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), v[b, :, a:e])
    return out


def bounds(B, T, key_start=None, window=None, valid=None):
    """Numpy [lo, hi) per token, written independently of ``visible_keys``: the causal rule and its limits."""
    lo, hi = np.zeros((B, T), int), np.tile(np.arange(1, T + 1), (B, 1))
    for b in range(B):
        for t in range(T):
            if key_start is not None:
                lo[b, t] = max(lo[b, t], key_start[b])
            if window is not None:
                lo[b, t] = max(lo[b, t], t - window + 1)
            if valid is not None and t >= valid[b]:
                hi[b, t] = lo[b, t]
    return lo, hi


def draw(B, K, G, T, D, seed):
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(B, K, G, T, D)) / np.sqrt(D)).astype(np.float32)
    k, v = (rng.normal(scale=1.5, size=(B, K, T, D)).astype(np.float32) for _ in range(2))
    return q, k, v


def run(q, k, v, key_start=None, window=None, valid=None, isa="auto"):
    B = q.shape[0]
    ks = None if key_start is None else jnp.asarray(key_start, jnp.int32)
    vd = None if valid is None else jnp.asarray(valid, jnp.int32)
    fn = jax.jit(lambda q, k, v: pa.prefill_attention(q, k, v, jnp.zeros((B,), jnp.int32), ks, window, vd, isa))
    return np.asarray(fn(q, k, v))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B, K, G, T, D", [(1, 3, 3, 200, 64), (2, 2, 4, 77, 32), (1, 4, 1, 33, 128),
                                           (2, 1, 2, 300, 64)])
def test_kernel_equals_a_numpy_causal_softmax(isa, B, K, G, T, D):
    q, k, v = draw(B, K, G, T, D, seed=T + D)
    lo, hi = bounds(B, T)
    assert np.abs(run(q, k, v, isa=isa) - reference(q, k, v, lo, hi)).max() < 2e-5


@pytest.mark.parametrize("isa", ISAS)
def test_window_left_and_right_padding(isa):
    """A sliding window of 50, rows left-padded by 0 and 37 slots, and right padding after 260 / 150 tokens: the
    padding tokens get zeros."""
    B, K, G, T, D = 2, 2, 3, 290, 64
    q, k, v = draw(B, K, G, T, D, seed=1)
    for kwargs in ({"window": 50}, {"key_start": [0, 37]}, {"valid": [260, 150]},
                   {"window": 130, "key_start": [5, 0], "valid": [290, 200]}):
        lo, hi = bounds(B, T, **kwargs)
        got = run(q, k, v, isa=isa, **kwargs)
        assert np.abs(got - reference(q, k, v, lo, hi)).max() < 2e-5, kwargs
        if "valid" in kwargs:
            assert not got[1, :, :, kwargs["valid"][1]:].any()


def test_visible_keys_matches_the_rule():
    B, T = 3, 70
    cache_index = jnp.asarray([0, 4, 10], jnp.int32)
    key_start = jnp.asarray([0, 9, 30], jnp.int32)   # as slots: tokens before slot key_start are padding
    lo, hi = pa.visible_keys(T, cache_index, key_start, 16, jnp.asarray([70, 60, 5], jnp.int32))
    want_lo, want_hi = bounds(B, T, key_start=[0, 5, 20], window=16, valid=[70, 60, 5])
    assert np.array_equal(np.asarray(lo), want_lo) and np.array_equal(np.asarray(hi), want_hi)


def test_a_token_does_not_depend_on_the_tokens_after_it():
    """The first 100 tokens of a 230-token prompt get the same float32 values, bit for bit, as the 100-token
    prompt alone: the blocks after a token change nothing it computes (so a prompt's bucket does not matter)."""
    q, k, v = draw(1, 3, 3, 230, 64, seed=2)
    for isa in ISAS:
        whole, part = run(q, k, v, isa=isa), run(q[:, :, :, :100], k[:, :, :100], v[:, :, :100], isa=isa)
        assert np.array_equal(whole[:, :, :, :100], part), isa


def test_attend_takes_the_kernel_only_for_long_causal_float32_prompts():
    """attend with no old cache lowers to the custom call from PREFILL_KERNEL_MIN_TOKENS causal float32 tokens
    with a head size divisible by 32, and equals XLA's attention there; shorter prompts, bidirectional
    (diffusion) calls, bfloat16 and a head size of 48 keep XLA's path."""
    T = pa.PREFILL_KERNEL_MIN_TOKENS

    def lowered(T, D=64, dtype=jnp.float32, causal=True):
        q, k, v = jnp.zeros((1, 2, 2, T, D), dtype), jnp.zeros((1, 2, T, D), dtype), jnp.zeros((1, 2, T, D), dtype)
        fn = lambda q, k, v: attend(q, k, v, None, jnp.zeros((1,), jnp.int32), None, None, causal)  # noqa: E731
        return jax.jit(fn).lower(q, k, v).as_text()

    assert "dantinox_prefill_attention" in lowered(T)
    for text in (lowered(T - 1), lowered(T, causal=False), lowered(T, dtype=jnp.bfloat16), lowered(T, D=48)):
        assert "dantinox_prefill_attention" not in text
    q, k, v = draw(2, 2, 2, 150, 64, seed=3)
    ci = jnp.zeros((2,), jnp.int32)
    got = np.asarray(jax.jit(lambda q, k, v: attend(q, k, v, None, ci, None, None))(q, k, v))
    lo, hi = bounds(2, 150)
    assert np.abs(got - reference(q, k, v, lo, hi)).max() < 2e-5


def test_bad_head_size_is_refused():
    q, k, v = draw(1, 1, 1, 64, 48, seed=4)
    with pytest.raises(ValueError, match="multiple of 32; got 48"):
        pa.prefill_attention(q, k, v, jnp.zeros((1,), jnp.int32), None, None)


def test_model_prefill_logits_agree_with_xla_attention(monkeypatch):
    """A GQA model with 32-wide heads: the logits of a 100-token prompt (its last 30 positions right padding,
    valid_tokens = 70) through the kernel agree with XLA's attention at the real positions, and greedy decoding
    from it gives the same tokens."""
    cfg = tiny_config(attention="gqa", n_heads=4, kv_heads=2, head_size=32, dim=128, max_context=160,
                      vocab_size=96)
    model = dx.build_model(cfg, seed=0)
    ids = np.random.default_rng(5).integers(0, 96, (1, 100)).astype(np.int32)
    lengths = jnp.asarray([70], jnp.int32)

    def logits():
        cache = dx.init_cache(cfg, 1)
        out, _, _ = jax.jit(lambda ids: model(ids, use_cache=True, kv_caches=cache, cache_index=0,
                                              valid_tokens=lengths))(ids)
        return np.asarray(out)[0, :70]

    def tokens():
        return np.asarray(dx.generate(model, ids[0, :70].tolist(), max_new_tokens=8))

    with_kernel, tokens_kernel = logits(), tokens()
    monkeypatch.setenv("DANTINOX_ATTENTION_KERNEL", "off")
    without = logits()
    assert np.abs(with_kernel - without).max() < 1e-4 * np.abs(without).max()
    assert np.array_equal(tokens(), tokens_kernel)
