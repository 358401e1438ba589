"""Speculative decoding over per-channel int8 keys (KIVI, issue 19 item 3): the residual ring of 2 G slots
(``dantinox.kv.channel_keys``, Rollback) lets a verify call's rejected tokens complete a key group that the
rollback un-completes. At G = 4 with k = 3 proposals: a rolled-back write reads as the plain uncached run;
greedy speculation (n-gram and draft proposers) emits the plain greedy tokens; a second request compiles
nothing; spec_tokens + 1 > G is refused naming both flags."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import spiky_model, tiny_config
from flax import nnx

import dantinox as dx
from dantinox.generation.speculative_generate import speculative_generate

G = 4
CFG = tiny_config(attention="gqa", kv_heads=2, cache_dtype="int8", kv_keys="channel", kv_key_group=G,
                  kv_sink_tokens=1, max_context=64)   # one sink: group 0's other slots are read from the cache


@pytest.fixture(scope="module")
def model():
    return spiky_model(CFG)


@partial(jax.jit, static_argnames=("graphdef", "use_cache"))
def _call(graphdef, state, ids, cache, index, *, use_cache=True):
    return nnx.merge(graphdef, state)(ids, use_cache=use_cache, kv_caches=cache, cache_index=index)[:2]


def run(model, ids, cache=None, index=0):
    graphdef, state = nnx.split(model)
    logits, cache = _call(graphdef, state, jnp.asarray(ids, jnp.int32), cache, jnp.full((1,), index, jnp.int32),
                          use_cache=cache is not None)
    return np.asarray(logits), cache


@pytest.mark.parametrize("c, accepted", [(2, 1), (5, 2), (6, 1)])
def test_a_rolled_back_verify_write_reads_as_the_plain_run(model, c, accepted):
    """A verify call writes [token c, 3 junk proposals] at slots c .. c + 3 (c = 2: it completes group 0 at
    slot 3; c = 5, 6: group 1 at slot 7) and the row continues from c + accepted (3, 7, 7), inside the group
    the junk completed: the logits of the continuation equal the uncached forward of the real tokens."""
    ids = np.random.default_rng(c).integers(0, CFG.vocab_size, (1, 14))
    want, _ = run(model, ids)
    _, cache = run(model, ids[:, :c], dx.init_cache(CFG, 1), 0)
    junk = np.concatenate([ids[:, c:c + 1], (ids[:, c + 1:c + 4] + 7) % CFG.vocab_size], axis=1)
    _, cache = run(model, junk, cache, c)
    t = c + accepted
    if accepted > 1:                                          # the accepted proposals, rewritten as real ones
        _, cache = run(model, ids[:, c:t], cache, c)
    parts = []
    for a in range(t, 14):                                    # then one token at a time, as decoding does
        logits, cache = run(model, ids[:, a:a + 1], cache, a)
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate(parts, 1), want[:, t:], rtol=0, atol=2e-5)


def cyclic(n, period, seed):
    base = np.random.default_rng(seed).integers(0, CFG.vocab_size, period).tolist()
    return (base * (n // period + 1))[:n]


@pytest.mark.slow   # 8 s: two speculative runs
def test_greedy_ngram_speculation_equals_plain_greedy_and_compiles_once(model):
    prompts = [cyclic(9, 3, 1), cyclic(6, 5, 2)]
    plain = dx.generate(model, prompts, 20)
    got, stats = speculative_generate(model, prompts, 20, spec_tokens=3)
    assert np.array_equal(got.tokens, plain)
    assert sum(stats.proposed) > sum(stats.accepted) > 0      # rejections happened, some across group edges
    with dx.CompileCounter() as again:
        speculative_generate(model, [cyclic(8, 4, 3), cyclic(7, 2, 4)], 20, spec_tokens=3)
    assert again.compilations == 0, again


@pytest.mark.slow   # 10 s: a draft model's programs too
def test_greedy_draft_speculation_equals_plain_greedy(model):
    draft = spiky_model(CFG.replace(num_blocks=1), seed=5)   # another model: it proposes, the target rejects
    prompts = [cyclic(7, 3, 6)]
    got, stats = speculative_generate(model, prompts, 16, spec_tokens=3, draft=draft)
    assert np.array_equal(got.tokens, dx.generate(model, prompts, 16))
    assert sum(stats.proposed) > sum(stats.accepted)


def test_spec_tokens_that_do_not_fit_a_key_group_are_refused_naming_both_flags(model):
    with pytest.raises(ValueError, match="--spec-tokens 4 is not allowed with --kv-key-group 4"):
        speculative_generate(model, [[1, 2, 3]], 4, spec_tokens=4)
