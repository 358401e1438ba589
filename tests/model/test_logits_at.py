"""The model's ``logits_at`` option (the head at one position per row, as prefill and the serving step use it)
and the tied head's direct contraction against the numpy reference forward."""

import numpy as np
import pytest
from conftest import forward, reference_logits, spiky_model, tiny_config

import dantinox as dx


@pytest.mark.parametrize("use_cache", [False, True])
def test_logits_at_picks_each_rows_position(use_cache):
    model = spiky_model(tiny_config(attention="gqa", kv_heads=2))
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (3, 9)).astype(np.int32)
    at = np.array([8, 0, 4], np.int32)
    cache = dx.init_cache(model.cfg, 3) if use_cache else None
    logits, _, _ = forward(model, ids, use_cache=use_cache, kv_caches=cache, cache_index=0, logits_at=at)
    want = reference_logits(model, ids)[np.arange(3), at]
    assert logits.shape == (3, 1, model.cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], want, atol=2e-4, rtol=1e-4)


def test_tied_head_matches_reference_at_every_position():
    model = spiky_model(tiny_config())
    assert model.lm_head is None
    ids = np.arange(12, dtype=np.int32)[None] % model.cfg.vocab_size
    logits, _, _ = forward(model, ids)
    np.testing.assert_allclose(np.asarray(logits), reference_logits(model, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("at, message", [(np.array([0, 1]), r"shape \(3,\)"), (np.array([0, 9, 1]), r"\[0, T=9\)"),
                                         (np.array([-1, 0, 0]), r"\[0, T=9\)")])
def test_logits_at_rejects_bad_positions(at, message):
    model = dx.build_model(tiny_config())
    ids = np.zeros((3, 9), np.int32)
    with pytest.raises(ValueError, match=message):
        model(ids, logits_at=at)
