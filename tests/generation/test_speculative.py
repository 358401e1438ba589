"""Speculative decoding with n-gram proposals: greedy output equals plain greedy token for token (MHA, GQA, MLA;
float32 and int8 caches; one row and a ragged batch), sampling draws from the target's distribution (a
chi-square test against the exact marginal, with proposals that are mostly rejected), the cache after
rejections holds what a plain run writes, stop ids end a row inside a verified chunk, no recompilation across
requests, the proposer against a plain-Python reference, and bad settings.

Cost: every case with one model shape compiles its programs (prefill, the decode loop, the speculative loop) once:
the GQA float32 model (``gqa_model``, a module fixture) serves the greedy case, the stop-id, cache and
recompilation tests, which share its batch-1 and batch-2 programs; the default tier runs three greedy cases
(MHA float32, GQA float32, MLA int8) and the other three are marked slow."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward, tiny_config
from flax import nnx
from scipy.stats import chi2

import dantinox as dx
from dantinox.generation.decode import generate_result, prefill, split_model
from dantinox.generation.ngram import propose_ngram
from dantinox.generation.prompts import eos_array
from dantinox.generation.sampling import filtered_probs, make_sampling_params
from dantinox.generation.speculative import PROBE_VERIFIES, accept_proposals, spec_state, speculative_decode
from dantinox.generation.speculative_generate import (SpecSettings, break_even, check_spec_settings, hand_off,
                                                      spec_settings, speculative_generate, speculative_stream)
from dantinox.xla import CompileCounter

ATTENTION = {"mha": dict(attention="mha", kv_heads=None), "gqa": dict(attention="gqa", kv_heads=2),
             "mla": dict(attention="mla", kv_latent_dim=16)}


def varied_model(cfg, seed=0, scale=4.0):
    """A random model with every weight scaled up, so greedy output does not collapse onto one repeated token
    and n-gram proposals are rejected about as often as accepted."""
    model = dx.build_model(cfg, seed)
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v.set_value(v.get_value() * scale)
    return model


def repetitive_prompt(rng, vocab, n=24):
    base = list(rng.integers(0, vocab, 6))
    return (base * 5)[:n - 3] + list(rng.integers(0, vocab, 3))


accepted_any: dict = {}


SLOW = pytest.mark.slow
GREEDY_CASES = [("mha", "float32"), ("gqa", "float32"), pytest.param("mla", "int8", marks=SLOW),
                pytest.param("mha", "int8", marks=SLOW),
                pytest.param("gqa", "int8", marks=SLOW), pytest.param("mla", "float32", marks=SLOW)]
GQA_CFG = tiny_config(max_context=128, **ATTENTION["gqa"])


@pytest.fixture(scope="module")
def gqa_model():
    """The GQA float32 model several tests share (one set of compiled programs per batch size)."""
    return varied_model(GQA_CFG)


@pytest.mark.parametrize("attn, kv_dtype", GREEDY_CASES)
def test_greedy_speculative_equals_plain_greedy(attn, kv_dtype, gqa_model):
    cfg = tiny_config(max_context=128, cache_dtype=kv_dtype, **ATTENTION[attn])
    model = gqa_model if cfg == GQA_CFG else varied_model(cfg)
    rng = np.random.default_rng(1)
    prompts = [repetitive_prompt(rng, cfg.vocab_size), repetitive_prompt(rng, cfg.vocab_size, 11)]
    plain = generate_result(model, prompts, 48)
    spec, stats = speculative_generate(model, prompts, 48, spec_tokens=4, ngram_max=3, ngram_min=1)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.finish_reasons == plain.finish_reasons
    assert stats.verify_calls > 0 and sum(stats.accepted) < sum(stats.proposed), stats   # rejections happened
    accepted_any[(attn, kv_dtype)] = sum(stats.accepted)
    if (attn, kv_dtype) == ("gqa", "float32"):   # one row (B = 1) and another k as well
        one, _ = speculative_generate(model, prompts[1], 30, spec_tokens=3)
        np.testing.assert_array_equal(one.tokens, generate_result(model, prompts[1], 30).tokens)


def test_greedy_cases_accepted_proposals_too():
    """Across the cases above, accepted proposals happened as well (the equality covered both branches)."""
    if len(accepted_any) < 3:
        pytest.skip("runs after the greedy cases in the same process")
    assert sum(v > 0 for v in accepted_any.values()) >= 2, accepted_any


def test_stop_id_inside_a_verified_chunk_ends_the_row_as_plain_decoding_does(gqa_model):
    cfg, model = GQA_CFG, gqa_model
    prompt = repetitive_prompt(np.random.default_rng(2), cfg.vocab_size)
    free = generate_result(model, [prompt], 40).tokens[0]
    eos = int(free[17])                                    # a token the greedy run emits mid-way
    plain = generate_result(model, [prompt], 40, eos_id=eos)
    spec, _ = speculative_generate(model, [prompt], 40, spec_tokens=4, eos_id=eos)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.lengths.tolist() == plain.lengths.tolist() and spec.finish_reasons == ["stop"]


def test_switch_off_rule_stops_verifying_a_losing_request_and_keeps_the_tokens(gqa_model):
    """min_accept = k (every proposal must be accepted to pay): after PROBE_VERIFIES verify calls with a rejection
    among them, the request decodes plainly to the end, with plain greedy's tokens; min_accept 0 keeps verifying."""
    prompt = repetitive_prompt(np.random.default_rng(2), GQA_CFG.vocab_size)
    plain = generate_result(gqa_model, [prompt], 60)
    keep, kept = speculative_generate(gqa_model, [prompt], 60, spec_tokens=4, min_accept=0.0)
    off, stopped = speculative_generate(gqa_model, [prompt], 60, spec_tokens=4, min_accept=4.0)
    np.testing.assert_array_equal(keep.tokens, plain.tokens)
    np.testing.assert_array_equal(off.tokens, plain.tokens)
    assert sum(kept.accepted) < sum(kept.proposed) and kept.verify_calls > PROBE_VERIFIES, kept
    assert stopped.verify_calls == PROBE_VERIFIES and sum(stopped.accepted) < sum(stopped.proposed), stopped
    assert stopped.iterations - stopped.verify_calls > kept.iterations - kept.verify_calls   # more plain steps
    assert kept.handed_off is None and PROBE_VERIFIES < stopped.handed_off < 60, stopped   # mid-request


def test_switched_off_request_finishes_in_the_compiled_decode_loop(gqa_model):
    """After the switch-off rule fires the request continues in ``decode.decode``, the very program plain
    generation compiled (no new compile), with plain greedy's tokens across the hand-off, also when streamed."""
    prompt = repetitive_prompt(np.random.default_rng(4), GQA_CFG.vocab_size)
    plain = generate_result(gqa_model, [prompt], 50)
    speculative_generate(gqa_model, [prompt], 20, spec_tokens=4, min_accept=4.0)
    with CompileCounter() as counted:
        off, stats = speculative_generate(gqa_model, [prompt], 50, spec_tokens=4, min_accept=4.0)
        streamed = np.concatenate([c for c, _ in speculative_stream(
            gqa_model, [prompt], 50, settings=SpecSettings("ngram", 4, 4, 1, 4.0), chunk_size=7)], axis=1)
    assert counted.compilations == 0
    assert stats.handed_off is not None and stats.iterations - stats.verify_calls >= 50 - stats.handed_off
    np.testing.assert_array_equal(off.tokens, plain.tokens)
    np.testing.assert_array_equal(streamed, plain.tokens)


def test_hand_off_only_when_the_rows_are_in_step():
    """decode writes every row at one shared step: rows still running must share their token count, and a row
    that stopped must not be past it (its tokens would be overwritten by the fill id)."""
    state = SimpleNamespace(token="t", index="i", done="d", out="o", cache="c")
    handed = hand_off(state, np.array([7, 7]), np.array([False, False]))
    assert int(handed.step) == 7 and (handed.token, handed.index, handed.cache) == ("t", "i", "c")
    assert int(hand_off(state, np.array([7, 4]), np.array([False, True])).step) == 7
    assert hand_off(state, np.array([7, 5]), np.array([False, False])) is None
    assert hand_off(state, np.array([7, 9]), np.array([False, True])) is None
    assert hand_off(state, np.array([3, 9]), np.array([True, True])) is None


def test_break_even_and_min_accept_bounds():
    assert break_even(1.3, 4) == pytest.approx(0.3) and break_even(0.9, 4) == 0.0 and break_even(9.0, 4) == 4.0
    assert spec_settings("ngram", 4, 4, 1, 0.5).min_accept == 0.5
    for bad in (-0.1, 5.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="min_accept=.* is not allowed"):
            spec_settings("ngram", 4, 4, 1, bad)


def test_cache_after_rejections_equals_a_plain_runs_cache(gqa_model):
    """Every slot below each row's final index holds the keys and values a token-by-token run writes."""
    cfg, model = GQA_CFG, gqa_model
    rng = np.random.default_rng(3)
    prompts = [repetitive_prompt(rng, cfg.vocab_size), repetitive_prompt(rng, cfg.vocab_size, 13)]
    graphdef, params = split_model(model)
    ids = np.zeros((2, 32), np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    sampling, key = make_sampling_params(2), jax.random.key(0)
    eos, fill = jnp.asarray(eos_array(None, cfg.vocab_size)), jnp.int32(0)
    state = prefill(graphdef, params, ids, lengths, key, sampling, eos, fill)
    state = speculative_decode(graphdef, params, spec_state(state, jnp.asarray(ids)), jnp.int32(30), key, sampling,
                               eos, fill, k=4, ngram_max=3, ngram_min=1, min_accept=jnp.float32(0.0))
    assert int(state.verify_calls) > 0 and int(jnp.sum(state.accepted)) < int(jnp.sum(state.proposed))
    tokens = np.asarray(state.out)[:, :30]
    for b, p in enumerate(prompts):
        full = np.array([list(p) + tokens[b, :-1].tolist()], np.int32)
        cache = dx.init_cache(cfg, 1)
        _, cache, _ = forward(model, full, use_cache=True, kv_caches=cache, cache_index=0)
        end = int(state.index[b])
        assert end == len(p) + 29
        for got, want in zip(state.cache, cache):
            np.testing.assert_allclose(np.asarray(got.k)[b, :, :end], np.asarray(want.k)[0, :, :end], atol=2e-5)
            np.testing.assert_allclose(np.asarray(got.v)[b, :, :end], np.asarray(want.v)[0, :, :end], atol=2e-5)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_sampling_draws_from_the_target_distribution():
    """Chi-square over 2000 independent rows: the second generated token's histogram against its exact
    marginal sum_t1 p(t1) p(t2 | t1). The prompt holds every token once, so every row has a proposal (the
    token after its first token's earlier occurrence), which the target mostly rejects. A 32-token vocabulary
    keeps the 2000-row batch small (and gives every bin about 60 expected draws)."""
    cfg = tiny_config(vocab_size=32, max_context=48, **ATTENTION["gqa"])
    model = varied_model(cfg, seed=4, scale=2.0)
    V = cfg.vocab_size
    prompt = list(np.random.default_rng(5).permutation(V))
    rows, settings = 2000, dict(temperature=0.9, top_p=0.95)
    spec, stats = speculative_generate(model, [prompt] * rows, 3, spec_tokens=2, ngram_max=1, seed=7, **settings)
    assert stats.verify_calls >= 1 and stats.acceptance_rate < 0.5, stats
    sampling = make_sampling_params(1, **settings)
    logits, _, _ = forward(model, np.array([prompt], np.int32), use_cache=False)
    p1 = np.asarray(filtered_probs(logits[:, -1], sampling))[0]
    seqs = np.array([prompt + [t] for t in range(V)], np.int32)
    logits2, _, _ = forward(model, seqs, use_cache=False)
    p2 = np.asarray(filtered_probs(logits2[:, -1], make_sampling_params(V, **settings)))
    expected = rows * (p1 @ p2)
    observed = np.bincount(spec.tokens[:, 1], minlength=V)
    big = expected >= 5
    stat = (((observed[big] - expected[big]) ** 2) / expected[big]).sum()
    rest_e, rest_o = expected[~big].sum(), observed[~big].sum()
    stat += (rest_o - rest_e) ** 2 / rest_e if rest_e > 0 else 0.0
    dof = int(big.sum()) - (0 if rest_e > 0 else 1)
    assert chi2.sf(stat, dof) > 1e-3, (stat, dof)
    # the same statistic detects the proposals' own distribution (a point mass per first token): the test can fail
    proposal_of = {prompt[i]: prompt[i + 1] for i in range(V - 1)}
    wrong = np.bincount([proposal_of.get(int(t), int(t)) for t in spec.tokens[:, 0]], minlength=V)
    wstat = (((wrong[big] - expected[big]) ** 2) / expected[big]).sum()
    assert chi2.sf(wstat, dof) < 1e-6


def test_no_recompilation_across_requests(gqa_model):
    cfg, model = GQA_CFG, gqa_model
    rng = np.random.default_rng(6)
    speculative_generate(model, [repetitive_prompt(rng, cfg.vocab_size)], 20, spec_tokens=4, temperature=0.0)
    with CompileCounter() as counted:   # same prompt bucket (17..32 tokens), other lengths, budgets and settings
        speculative_generate(model, [repetitive_prompt(rng, cfg.vocab_size, 20)], 33, spec_tokens=4,
                             temperature=0.7, top_p=0.9, seed=9, eos_id=[3, 5])
        speculative_generate(model, [repetitive_prompt(rng, cfg.vocab_size, 17)], 7, spec_tokens=4)
    assert counted.compilations == 0


def _reference_proposal(seq, k, nmax, nmin):
    last = len(seq) - 1
    for n in range(nmax, nmin - 1, -1):
        if n > len(seq):
            continue
        tail = seq[-n:]
        for end in range(last - 1, n - 2, -1):
            if seq[end - n + 1:end + 1] == tail:
                follow = seq[end + 1:end + 1 + k]
                return follow + [seq[-1]] * (k - len(follow)), True
    return [seq[-1]] * k, False


def test_ngram_proposer_matches_a_plain_python_reference():
    rng = np.random.default_rng(8)
    for _ in range(40):
        length = int(rng.integers(1, 30))
        seq = [int(x) for x in rng.integers(0, 4, length)]
        buf = np.zeros((1, 32), np.int32)
        buf[0, :length] = seq
        got, found = propose_ngram(jnp.asarray(buf), jnp.asarray([length - 1], jnp.int32), 3, 3, 2)
        want, want_found = _reference_proposal(seq, 3, 3, 2)
        assert bool(found[0]) == want_found, (seq,)
        if want_found:
            assert np.asarray(got)[0].tolist() == want, (seq, np.asarray(got)[0].tolist(), want)


@pytest.mark.parametrize("settings, message", [
    (dict(spec_tokens=0), "spec_tokens=0 is not allowed"),
    (dict(spec_tokens=17), "spec_tokens=17 is not allowed: at most 16"),
    (dict(ngram_max=2, ngram_min=3), "ngram_min=3, ngram_max=2 is not allowed"),
    (dict(ngram_max=True), "ngram_max=True is not allowed"),
])
def test_bad_settings_name_the_setting(settings, message):
    full = dict(spec_tokens=4, ngram_max=4, ngram_min=1) | settings
    with pytest.raises(ValueError, match=message):
        check_spec_settings(full["spec_tokens"], full["ngram_max"], full["ngram_min"])


def test_diffusion_model_is_refused():
    cfg = tiny_config(paradigm="diffusion")
    with pytest.raises(ValueError, match="paradigm='diffusion'"):
        speculative_generate(dx.build_model(cfg, 0), [1, 2, 3], 4)


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_acceptance_shortcut_equals_the_rejection_rule_over_point_masses(with_q):
    """accept_proposals takes one argmax when every row is greedy; the rejection rule (the reference) reaches the
    same tokens and counts through the point masses of filtered_probs: rows whose proposals match the argmax for
    0..k positions, tied logits (the first maximum wins in both), limits below k, and a draft's q."""
    from dantinox.generation.speculative import _greedy_accept, _rejection_accept

    B, k, V = 8, 4, 50
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(B, k + 1, V)).astype(np.float32)
    logits[1, :, 7] = logits[1, :, 9] = 10.0                      # ties: argmax is 7
    top = logits.argmax(-1)
    proposals = rng.integers(0, V, (B, k))
    for b in range(B):
        matched = b % (k + 1)
        proposals[b, :matched] = top[b, :matched]
    limit = jnp.asarray([k, k, 2, 0, k, 1, 3, k], jnp.int32)
    q = jnp.asarray(rng.dirichlet(np.ones(V), (B, k)), jnp.float32) if with_q else None
    sampling = make_sampling_params(B)
    got = accept_proposals(jnp.asarray(logits), jnp.asarray(proposals, jnp.int32), jax.random.key(0), sampling,
                           limit=limit, q=q)
    limited = jnp.where(jnp.arange(k)[None, :] < limit[:, None], jnp.asarray(proposals, jnp.int32), -1)
    q_ref = None if q is None else jnp.where((jnp.arange(k)[None, :] < limit[:, None])[..., None], q, 0.0)
    want = _rejection_accept(jnp.asarray(logits), limited, jax.random.key(0), sampling, q_ref)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.asarray(got[1]).tolist() == [min(b % (k + 1), int(limit[b])) for b in range(B)]
    assert int(got[0][1, int(got[1][1])]) == 7   # the tied row emits the first maximum
    direct = _greedy_accept(jnp.asarray(logits), limited)
    np.testing.assert_array_equal(np.asarray(direct[0]), np.asarray(want[0]))


def test_forward_loop_runs_the_cached_forward_in_place(gqa_model):
    """verify_cost times forwards inside one compiled loop (``_forward_loop``): each forward writes the same
    slots, so after 8 of them the cache equals one uncompiled cached forward's, and the returned sum is 8 times
    that forward's last logit."""
    from dantinox.generation.speculative_generate import _forward_loop, forward_seconds

    cfg = gqa_model.cfg
    tokens = jnp.asarray([[5, 9, 2]], jnp.int32)
    index = jnp.asarray([7], jnp.int32)
    logits, want, _ = gqa_model(tokens, use_cache=True, kv_caches=dx.init_cache(cfg, 1), cache_index=index)
    graphdef, params = split_model(gqa_model)
    total, got = _forward_loop(graphdef, params, tokens, dx.init_cache(cfg, 1), index, 8)
    # the loop is one compiled program and the reference runs op by op: XLA fuses the projections differently,
    # which moved 2 of 2,048 cached values by 2.5e-6 on an AVX-512 Xeon (1e-6 held on a Zen 4)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(total), 8 * float(logits[0, -1, 0]), rtol=1e-5)
    assert 0 < forward_seconds(gqa_model, 3, repeats=2, at=7) < 60
