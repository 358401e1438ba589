"""prefill writes into a static cache made outside the call (``decode.new_cache``): the same state, tokens and
cache contents as the cache allocated inside the call, for every cache layout (float32 MHA, GQA with an int8
cache in both key layouts, MLA); the given cache is donated (written in place, not copied); and only the pages
of the slots written become resident, so a long-context model's generate no longer holds its whole cache."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dantinox as dx
from dantinox.generation import decode as gen
from dantinox.kv import zero_pages

CASES = {
    "mha float32": dict(preset="tiny"),
    "gqa int8, channel keys": dict(preset="tiny", attention="gqa", kv_heads=2, cache_dtype="int8",
                                   kv_keys="channel", kv_key_group=16, max_context=64),
    "gqa int8, token keys": dict(preset="tiny", attention="gqa", kv_heads=2, cache_dtype="int8", kv_keys="token"),
    "mla": dict(preset="tiny-mla"),
}


def _model(case: dict):
    overrides = dict(case)
    return dx.build_model(dx.ModelConfig.from_preset(overrides.pop("preset"), **overrides), seed=1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_given_cache_gives_the_state_of_one_allocated_inside(name, monkeypatch):
    monkeypatch.setattr(gen, "pages_available", lambda: True)   # init_cache's own fallback still applies
    model = _model(CASES[name])
    graphdef, params = gen.split_model(model)
    rng = np.random.default_rng(0)
    req = gen._prepare(model, [rng.integers(1, 128, 11).tolist(), rng.integers(1, 128, 5).tolist()], 8,
                       0.0, 0, 1.0, 0, None)
    args = (graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill)
    inside = gen.prefill(*args)
    given_cache = gen.new_cache(model.cfg, 2, params)
    given = gen.prefill(*args, given_cache)
    for a, b in zip(jax.tree_util.tree_leaves(inside), jax.tree_util.tree_leaves(given), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(given_cache))   # donated: written in place


@pytest.mark.parametrize("name", ["mha float32", "mla"])
def test_generation_through_a_given_cache_matches_the_uncached_model(name):
    """generate and stream (both prefill into new_cache) give the uncached model's greedy tokens."""
    model = _model(CASES[name])
    prompts = [np.random.default_rng(2).integers(1, 128, 9).tolist()]
    uncached = dx.generate(model, prompts, 12, temperature=0.0, use_cache=False)
    np.testing.assert_array_equal(dx.generate(model, prompts, 12, temperature=0.0), uncached)
    streamed = np.concatenate(list(dx.stream_tokens(model, prompts, 12, chunk_size=5)), axis=1)
    np.testing.assert_array_equal(streamed, uncached)


def test_new_cache_is_made_in_the_call_on_a_mesh_and_without_pages(monkeypatch):
    """On a mesh, and where pages cannot be left to the OS (no extension, another backend: a cache made
    outside would be written in full there, twice during a two-thread warm-up), prefill allocates the cache
    inside its call as before."""
    model = _model(CASES["mha float32"])
    graphdef, params = gen.split_model(model)
    monkeypatch.setattr(gen, "pages_available", lambda: True)
    assert gen.new_cache(model.cfg, 1, params) is not None and gen.cache_shapes(model.cfg, 1, params) is not None
    monkeypatch.setattr(gen, "pages_available", lambda: False)
    assert gen.new_cache(model.cfg, 1, params) is None and gen.cache_shapes(model.cfg, 1, params) is None
    monkeypatch.setattr(gen, "pages_available", lambda: True)
    monkeypatch.setattr(gen, "mesh_of", lambda params: object())   # parameters on a mesh
    assert gen.new_cache(model.cfg, 1, params) is None and gen.cache_shapes(model.cfg, 1, params) is None


@pytest.mark.skipif(not zero_pages.pages_available() or not sys.platform.startswith("linux"),
                    reason="pages are left to the OS on Linux with the compiled extension")
def test_only_the_written_slots_become_resident():
    """A 256 MiB static cache (2 layers x K and V of 64 MiB: 4 KV heads x 524,288 slots x 8 floats) and a
    16-token prompt: the prefill leaves far less than the cache resident (the cache allocated and zero-filled
    inside the call made all of it resident)."""
    model = _model(dict(preset="tiny", max_context=2**19, kv_heads=4, attention="gqa"))
    req = gen._prepare(model, [list(range(1, 17))], 1, 0.0, 0, 1.0, 0, None)
    graphdef, params = gen.split_model(model)
    cache_bytes = dx.cache_nbytes(dx.init_cache(model.cfg, 1))
    assert cache_bytes == 256 * 2**20
    args = (graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill)
    jax.block_until_ready(gen.prefill(*args, gen.new_cache(model.cfg, 1, params)))   # compiled; pages freed
    before = _resident_bytes()
    state = gen.prefill(*args, gen.new_cache(model.cfg, 1, params))
    jax.block_until_ready(state)
    assert _resident_bytes() - before < cache_bytes // 4
    assert int(state.token[0]) == int(jnp.argmax(model(req.ids)[0][0, 15]))   # greedy first token of the prompt


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_the_constrained_prefill_takes_the_cache_too():
    """masked_prefill (structured outputs) with a cache made outside: the same token and cache as with the
    cache allocated inside, the given one donated."""
    from dantinox.generation.constrained_decode import masked_prefill
    from dantinox.generation.grammar import all_allowed_mask

    model = _model(CASES["gqa int8, token keys"])
    graphdef, params = gen.split_model(model)
    req = gen._prepare(model, [[5, 9, 11, 3], [7, 2]], 4, 0.9, 0, 1.0, 4, None)
    mask = all_allowed_mask(2, model.cfg.vocab_size)
    args = (graphdef, params, req.ids, req.lengths, req.key, req.sampling, mask)
    given_cache = gen.init_cache(model.cfg, 2)
    inside, given = masked_prefill(*args), masked_prefill(*args, given_cache)
    for a, b in zip(jax.tree_util.tree_leaves(inside), jax.tree_util.tree_leaves(given), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(given_cache))
