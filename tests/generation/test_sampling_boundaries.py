"""K09 and its class: every sampling filter at its exact boundary, with many draws (one row per draw).

Each sampler is checked: ``sample_next`` (the generate loop and ``Generator`` call it for every token; also end
to end through ``dx.generate`` on a model whose logits are fixed), the
serving engine's per-row sampler ``sample_rows`` (per-request PRNG streams), and the diffusion sampler's
confidence threshold. The reference is the rule itself, written out by hand per case.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dantinox.generation.diffusion import _commit, _Settings
from dantinox.generation.sampling import GREEDY_TEMPERATURE, make_sampling_params, sample_next
from dantinox.serving.runner import sample_rows

DRAWS = 4000

# (probabilities, top_p, the tokens the nucleus holds): the ACCEPTANCE.md K09 cases, then more boundaries
NUCLEUS_CASES = [
    ([0.5, 0.4, 0.1], 0.5, {0}),
    ([0.6, 0.3, 0.1], 0.6, {0}),
    ([0.3, 0.1, 0.1, 0.5], 0.8, {3, 0}),
    ([0.25, 0.25, 0.25, 0.25], 0.5, {0, 1}),
    ([0.7, 0.2, 0.1], 0.9, {0, 1}),
    ([0.1] * 10, 0.3, {0, 1, 2}),
    ([0.5, 0.4, 0.1], 0.501, {0, 1}),  # past the boundary (by more than TOP_P_TOLERANCE): the next token is needed
]


def _draw_next(probs, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    logits = jnp.log(jnp.asarray(np.tile(probs, (DRAWS, 1)), jnp.float32))
    params = make_sampling_params(DRAWS, temperature, top_k, top_p)
    return set(np.asarray(sample_next(logits, jax.random.key(seed), params)).tolist())


def _draw_rows(probs, temperature=1.0, top_k=0, top_p=1.0):
    logits = jnp.log(jnp.asarray(np.tile(probs, (DRAWS, 1)), jnp.float32))
    params = make_sampling_params(DRAWS, temperature, top_k, top_p)
    seeds = jnp.arange(DRAWS, dtype=jnp.uint32)
    return set(np.asarray(sample_rows(logits, seeds, jnp.zeros(DRAWS, jnp.int32), params)).tolist())


@pytest.mark.parametrize("probs,top_p,nucleus", NUCLEUS_CASES)
def test_k09_top_p_exact_boundary(probs, top_p, nucleus):
    for seed in (0, 1):
        assert _draw_next(probs, top_p=top_p, seed=seed) == nucleus
    assert _draw_rows(probs, top_p=top_p) == nucleus


def test_k09_every_sampler_uses_the_fixed_filter():
    """The generate loop samples with the same function (no second copy of the filter to drift)."""
    assert importlib.import_module("dantinox.generation.decode").sample_next is sample_next
    assert importlib.import_module("dantinox.serving.runner").sample_next is sample_next


@pytest.mark.parametrize("top_k,allowed", [(1, {1}), (2, {1, 2}), (3, {1, 2, 0}), (4, {0, 1, 2, 3}), (0, {0, 1, 2, 3})])
def test_k09_top_k_exact_boundary(top_k, allowed):
    probs = [0.2, 0.4, 0.3, 0.1]
    assert _draw_next(probs, top_k=top_k) == allowed
    assert _draw_rows(probs, top_k=top_k) == allowed


def test_k09_top_k_and_top_p_together_at_both_boundaries():
    # top_k 3 renormalises [0.4, 0.3, 0.2] to [4/9, 3/9, 2/9]; top_p 7/9 is reached exactly by two tokens
    assert _draw_next([0.2, 0.4, 0.3, 0.1], top_k=3, top_p=7 / 9) == {1, 2}


@pytest.mark.parametrize("temperature", [0.0, -0.0, GREEDY_TEMPERATURE])
def test_k09_temperature_greedy_boundary(temperature):
    probs = [0.3, 0.3, 0.4]
    assert _draw_next(probs, temperature=temperature) == {2}
    assert _draw_rows(probs, temperature=temperature) == {2}


def test_k09_temperature_just_above_greedy_samples():
    # barely above the greedy threshold: a sampler (every token equally likely at flat logits)
    assert _draw_next([1 / 3] * 3, temperature=float(np.nextafter(np.float32(GREEDY_TEMPERATURE),
                                                                       np.float32(1)))) == {0, 1, 2}


def test_k09_diffusion_threshold_exact_boundary():
    """A confidence equal to the threshold does not exceed it: only the most confident MASK commits."""
    mask, W = 3, 4
    # every slot predicts token 0; confidences 0.5 (x2: exactly the threshold), 0.6, 0.4
    rows = [[0.5, 0.4, 0.1, 0.0], [0.5, 0.25, 0.25, 0.0], [0.6, 0.3, 0.1, 0.0], [0.4, 0.3, 0.3, 0.0]]
    logits = jnp.log(jnp.asarray([rows], jnp.float32) + 1e-30)
    x = jnp.full((1, W), mask, jnp.int32)
    settings = _Settings(jnp.int32(mask), jnp.int32(1), jnp.float32(0.5), jnp.float32(0.0), jnp.int32(W))
    out = np.asarray(_commit(x, logits, 0, settings, jax.random.key(0)))[0]
    assert out.tolist() == [mask, mask, 0, mask]
    settings = settings._replace(threshold=jnp.float32(0.45))
    out = np.asarray(_commit(x, logits, 0, settings, jax.random.key(0)))[0]
    assert out.tolist() == [0, 0, 0, mask]


def fixed_logits_model(probs):
    """A tiny AR model whose logits are log(probs) at every position, whatever the input: every embedding row
    is the same vector, attention and MLP outputs are zero, and the untied head maps the normalised vector
    to log(probs) (tokens beyond len(probs) get -1e4)."""
    import dantinox as dx

    V = 16
    cfg = dx.ModelConfig.from_preset("tiny", vocab_size=V, tie_embeddings=False)
    model = dx.build_model(cfg, seed=0)
    model.embed.embedding[...] = jnp.ones((V, cfg.dim), jnp.float32)
    for blk in model.blocks:
        blk.attn.out.kernel[...] = jnp.zeros_like(blk.attn.out.kernel[...])
        blk.mlp.down.kernel[...] = jnp.zeros_like(blk.mlp.down.kernel[...])
    u = np.asarray(model.final_norm(jnp.ones((1, cfg.dim), jnp.float32)))[0].astype(np.float64)
    target = np.full(V, -1e4)
    target[: len(probs)] = np.log(probs)
    model.lm_head.kernel[...] = jnp.asarray(np.outer(u / (u @ u), target), jnp.float32)
    return model


@pytest.mark.parametrize("probs,top_p,nucleus", NUCLEUS_CASES[:3])
def test_k09_top_p_exact_boundary_through_the_generate_loop(probs, top_p, nucleus):
    """Prefill and the compiled decode loop of dx.generate, 1,000 rows x 4 tokens per case."""
    import dantinox as dx

    model = fixed_logits_model(probs)
    tokens = dx.generate(model, np.zeros((1000, 1), np.int32), 4, temperature=1.0, top_p=top_p, seed=7)
    assert set(np.asarray(tokens).ravel().tolist()) == nucleus


def test_greedy_argmax_equals_numpy_argmax_with_ties_nan_and_infinities():
    """greedy_argmax (two plain reductions) against numpy's argmax, the independent reference: random rows,
    exact ties (the lowest index), NaNs (the first NaN, as numpy and jnp.argmax), rows of -inf, +inf among
    finite values, one entry, and a leading batch of two axes."""
    from dantinox.generation.sampling import greedy_argmax

    rng = np.random.default_rng(11)
    x = rng.normal(size=(3, 16, 257)).astype(np.float32)
    x[0, 1, [4, 200]] = 9.0
    x[0, 2, [7, 3]] = np.nan
    x[0, 3, :] = -np.inf
    x[0, 4, [10, 20]] = np.inf
    x[1, 5, :] = 0.0
    x[2, 6, 256] = 50.0
    got = np.asarray(greedy_argmax(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.shape == (3, 16)
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[0, 1] == 4 and got[0, 2] == 3 and got[0, 3] == 0 and got[0, 4] == 10 and got[2, 6] == 256
    np.testing.assert_array_equal(np.asarray(greedy_argmax(jnp.asarray(x[..., :1]))), np.zeros((3, 16)))
