"""``verify_speculative`` / ``dantinox verify --speculative ngram``: greedy n-gram speculation one verify call at
a time passes the cached-vs-uncached check at every accepted position (float32 and int8 caches), emits plain
greedy's tokens, accepts some proposals and rejects others; the check fails when the cache is corrupted between
calls (it can fail); the CLI prints the acceptance and exits 0."""

import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import dantinox as dx
from dantinox.cli import entrypoint as cli
from dantinox.generation.decode import generate_result
from dantinox.quality import verify_speculative as vs

GQA = dict(attention="gqa", kv_heads=2)


def varied_model(cfg, seed=0, scale=4.0):
    """A random model with its weights scaled up, so greedy output varies and proposals are both accepted and
    rejected (as tests/generation/test_speculative.py builds it)."""
    model = dx.build_model(cfg, seed)
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v.set_value(v.get_value() * scale)
    return model


def repetitive_prompt(rng, vocab, n=24):
    base = list(rng.integers(0, vocab, 6))
    return (base * 5)[:n - 3] + list(rng.integers(0, vocab, 3))


@pytest.mark.slow   # ~6 s each on the shared host (compiles the prompt, verify and reference programs)
@pytest.mark.parametrize("kv_dtype, keys", [("float32", {}), ("int8", dict(kv_keys="token")),
                                            ("int8", dict(kv_key_group=8))], ids=["float32", "int8", "int8-channel"])
def test_accepted_positions_match_the_uncached_forward(kv_dtype, keys):
    """int8: per-token keys, and per-channel keys (the default) in groups of 8, so verify calls complete and,
    on rejection, re-complete key groups (k + 1 = 4 <= G)."""
    cfg = tiny_config(max_context=64, cache_dtype=kv_dtype, **GQA, **keys)
    model = varied_model(cfg, scale=2.0)   # scale 2: most proposals accepted, some rejected (4: almost none)
    prompt = repetitive_prompt(np.random.default_rng(1), cfg.vocab_size)
    report, accepted, proposed = vs.verify_speculative(model, prompt, 36, spec_tokens=3, ngram_max=3,
                                                       tolerance=1e-4, relative_tolerance=1e-5)
    assert report.passed, report.max_diff.max()
    assert len(report.positions) == len(prompt) + 35
    assert report.tokens == generate_result(model, [prompt], 36).tokens[0].tolist()
    assert 0 < accepted < proposed, (accepted, proposed)


def test_a_corrupted_cache_fails_the_check(monkeypatch):
    """Scaling the cache's values between calls (what a wrong rollback would leave) is caught."""
    cfg = tiny_config(max_context=64, **GQA)
    model = varied_model(cfg)
    prompt = repetitive_prompt(np.random.default_rng(1), cfg.vocab_size)
    step = vs._step

    def corrupting(graphdef, params, ids, cache, index):
        logits, cache = step(graphdef, params, ids, cache, index)
        return logits, tuple(type(layer)(layer.k, layer.v * 1.01) for layer in cache)

    monkeypatch.setattr(vs, "_step", corrupting)
    report, _, _ = vs.verify_speculative(model, prompt, 20, spec_tokens=3, ngram_max=3)
    assert not report.passed


@pytest.mark.slow   # loads the bundled model and compiles its verify programs
def test_cli_verify_speculative_passes_on_the_bundled_model(capsys):
    assert cli.main(["verify", "--new_tokens", "40", "--speculative", "ngram", "--spec-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "n-gram speculation (k=4:" in out and "PASS" in out, out
