"""Speculative decoding with a draft model: greedy output equals plain greedy token for token (a smaller random
draft that is mostly rejected, and the target as its own draft, where every proposal is accepted and the draft's
cache must follow k + 1 tokens a round), no recompilation across requests, a draft whose vocabulary or context
differs is refused naming the field, and sampling draws from the target's distribution (chi-square against the
exact marginal, with a draft that disagrees often; the same statistic rejects the draft's own distribution).

Cost: the GQA target of test_speculative.py's shape and one 1-block draft; every case that generates compiles a
speculative program of its own (10-30 s on the shared host), so the default tier runs only the refusals and the
rest is slow."""

import numpy as np
import pytest
from conftest import forward, tiny_config
from scipy.stats import chi2
from test_speculative import ATTENTION, GQA_CFG, repetitive_prompt, varied_model

from dantinox.generation.decode import generate_result
from dantinox.generation.sampling import filtered_probs, make_sampling_params
from dantinox.generation.speculative_generate import SpecSettings, speculative_generate, speculative_stream
from dantinox.xla import CompileCounter

DRAFT_CFG = tiny_config(max_context=128, num_blocks=1, dim=32, n_heads=4, head_size=8, mlp_hidden=64,
                        **ATTENTION["gqa"])


@pytest.fixture(scope="module")
def target():
    return varied_model(GQA_CFG)


@pytest.fixture(scope="module")
def draft():
    return varied_model(DRAFT_CFG, seed=11)


@pytest.mark.slow   # ~20 s on the shared host: compiles the target's and the draft's programs
def test_greedy_with_a_draft_model_equals_plain_greedy_and_compiles_once(target, draft):
    rng = np.random.default_rng(1)
    prompt = repetitive_prompt(rng, GQA_CFG.vocab_size)
    plain = generate_result(target, [prompt], 40)
    spec, stats = speculative_generate(target, [prompt], 40, spec_tokens=3, draft=draft)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert stats.verify_calls > 0 and sum(stats.proposed) == 3 * stats.verify_calls, stats
    other = repetitive_prompt(rng, GQA_CFG.vocab_size, 20)
    with CompileCounter() as counted:   # another prompt, budget and sampling settings: nothing new to compile
        again, _ = speculative_generate(target, [other], 25, spec_tokens=3, draft=draft)
        speculative_generate(target, [other], 9, spec_tokens=3, draft=draft, temperature=0.8, seed=3)
        streamed = np.concatenate([c for c, _ in speculative_stream(
            target, [other], 25, settings=SpecSettings("draft", 3), chunk_size=6, draft=draft)], axis=1)
    assert counted.compilations == 0
    np.testing.assert_array_equal(again.tokens, generate_result(target, [other], 25).tokens)
    np.testing.assert_array_equal(streamed, again.tokens)


@pytest.mark.slow   # compiles the batch-2 and the self-draft programs
def test_greedy_with_a_draft_batch_and_with_the_target_as_its_own_draft(target, draft):
    rng = np.random.default_rng(2)
    prompts = [repetitive_prompt(rng, GQA_CFG.vocab_size), repetitive_prompt(rng, GQA_CFG.vocab_size, 11)]
    plain = generate_result(target, prompts, 36)
    spec, _ = speculative_generate(target, prompts, 36, spec_tokens=4, draft=draft)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    self_spec, stats = speculative_generate(target, prompts[:1], 36, spec_tokens=4, draft=target)
    np.testing.assert_array_equal(self_spec.tokens, plain.tokens[:1])
    assert stats.acceptance_rate > 0.9 and stats.mean_accepted_length > 4.5, stats


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 64, "draft vocab_size=64 differs from the target's vocab_size=128"),
    ("max_context", 64, "draft max_context=64 is below the target's max_context=128"),
])
def test_a_draft_that_does_not_fit_is_refused_naming_the_field(target, field, value, message):
    import dantinox as dx

    bad = dx.build_model(tiny_config(**(dict(max_context=128) | {field: value})), 0)
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, [1, 2, 3], 4, draft=bad)


def _chi_square(observed, expected):
    big = expected >= 5
    stat = (((observed[big] - expected[big]) ** 2) / expected[big]).sum()
    rest_e, rest_o = expected[~big].sum(), observed[~big].sum()
    stat += (rest_o - rest_e) ** 2 / rest_e if rest_e > 0 else 0.0
    return chi2.sf(stat, int(big.sum()) - (0 if rest_e > 0 else 1))


def _next_probs(model, prompt, settings):
    """(p1 [V]: the next token's distribution after prompt, p2 [V, V]: row t1 the one after prompt + [t1]),
    float64, from uncached forwards."""
    V = model.cfg.vocab_size
    logits, _, _ = forward(model, np.array([prompt], np.int32), use_cache=False)
    p1 = np.asarray(filtered_probs(logits[:, -1], make_sampling_params(1, **settings)), np.float64)[0]
    logits2, _, _ = forward(model, np.array([prompt + [t] for t in range(V)], np.int32), use_cache=False)
    return p1, np.asarray(filtered_probs(logits2[:, -1], make_sampling_params(V, **settings)), np.float64)


@pytest.mark.slow   # a 2000-row batch through its own speculative program
def test_sampling_with_a_draft_draws_from_the_target_distribution():
    """2000 rows: the second generated token (the first the draft proposes) against its exact marginal under
    the target; the draft is an unrelated random model, so most proposals are rejected and resampled from the
    residual. The same statistic against the draft's own marginal fails: the test can tell them apart."""
    cfg = tiny_config(vocab_size=32, max_context=48, **ATTENTION["gqa"])
    model = varied_model(cfg, seed=4, scale=2.0)
    draft = varied_model(tiny_config(vocab_size=32, max_context=48, num_blocks=1, **ATTENTION["gqa"]), seed=9,
                         scale=2.0)
    prompt = list(np.random.default_rng(5).permutation(cfg.vocab_size))
    rows, settings = 2000, dict(temperature=0.9, top_p=0.95)
    spec, stats = speculative_generate(model, [prompt] * rows, 3, spec_tokens=2, seed=7, draft=draft, **settings)
    assert stats.verify_calls >= 1 and 0.05 < stats.acceptance_rate < 0.7, stats
    observed = np.bincount(spec.tokens[:, 1], minlength=cfg.vocab_size)
    p1, p2 = _next_probs(model, prompt, settings)
    _, q2 = _next_probs(draft, prompt, settings)
    assert _chi_square(observed, rows * (p1 @ p2)) > 1e-3
    assert _chi_square(observed, rows * (p1 @ q2)) < 1e-6   # what accepting every proposal would give
