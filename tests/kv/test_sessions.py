"""Sessions (dantinox.kv.sessions, dantinox.generation.sessions): one sequence's cache with its tokens saved to a
file and read back, for every cache kind (float rows, int8 rows with sinks, int8 per-channel keys with the
residual ring, MLA latents): a Generator session continued after a save and a load generates what a fresh
prefill of the whole prompt generates; a server session's prefix blocks exported from one engine and imported
into another are hit there and give the tokens of an engine without a prefix cache; a file from another model,
cache layout or of the other form is refused naming the file and the difference; a damaged file is refused."""

import numpy as np
import pytest
from conftest import tiered
from serving_util import drain, greedy, make_engine
from test_tiers import KINDS, kind_model, prompts, reference

from dantinox.generation.decode import generate_result
from dantinox.generation.sessions import Session, reusable_prefix, session_generate
from dantinox.kv.sessions import (SessionError, export_prefix, import_prefix, load_block_session, load_static_session,
                                  save_block_session, save_static_session, static_session_arrays)
from dantinox.kv.spec import layer_specs
from dantinox.kv.tier_block import tier_layout


@pytest.fixture(scope="module", params=tiered(KINDS, slow=["mla-int8"]))
def kind(request):
    return request.param, kind_model(request.param)


def test_a_generator_session_saved_loaded_and_continued_equals_a_fresh_prefill(kind, tmp_path):
    name, model = kind
    cfg = model.cfg
    prompt = np.random.default_rng(11).integers(1, 128, 20).tolist()
    first, session, reused = session_generate(model, None, prompt, 8)
    assert reused == 0 and len(session.tokens) == 27   # the prompt and the generated tokens but the last
    path = str(tmp_path / "s.session")
    save_static_session(path, cfg, "model-a", session.tokens, session.cache)
    tokens, cache = load_static_session(path, cfg, "model-a")
    assert tokens == session.tokens
    for a, b in zip(static_session_arrays(cfg, cache, len(tokens)), static_session_arrays(cfg, session.cache, 27)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    follow = tokens + np.random.default_rng(12).integers(1, 128, 7).tolist()
    got, _, reused = session_generate(model, Session(tokens, cache), follow, 8)
    want = generate_result(model, [follow], 8)
    assert reused == (24 if cfg.channel_keys else 27)   # per-channel keys resume at a key-group boundary
    assert got.tokens.tolist() == want.tokens.tolist()


def test_a_session_is_reused_only_as_far_as_its_tokens_agree(kind):
    _, model = kind
    session = Session(list(range(1, 21)), None)
    cut = model.cfg.key_group if model.cfg.channel_keys else 1
    assert reusable_prefix(model.cfg, session, list(range(1, 11)) + [99] * 5) == 10 // cut * cut
    assert reusable_prefix(model.cfg, session, list(range(1, 21))) == 19 // cut * cut   # the last is fed again
    assert reusable_prefix(model.cfg, session, [5, 6, 7]) == 0
    assert reusable_prefix(model.cfg, None, [1, 2, 3]) == 0


def test_a_server_session_moves_a_prefix_from_one_engine_to_another(kind, tmp_path):
    _, model = kind
    prompt = prompts(1, 21)[0]
    first = make_engine(model, num_blocks=10)
    rid = first.add_request(prompt, greedy(6))
    drain(first)
    layout = tier_layout(model.cfg, 4, "model-a")
    blocks = export_prefix(first.cache, prompt)
    assert len(blocks) == 3 and (blocks[0].sinks is not None) == layout.has_sinks
    path = str(tmp_path / "p.session")
    save_block_session(path, layout, prompt, blocks)
    tokens, loaded = load_block_session(path, layout)
    assert tokens == prompt and all(np.array_equal(a, b) for x, y in zip(blocks, loaded)
                                    for a, b in zip(x.arrays(), y.arrays()))
    second = make_engine(model, num_blocks=10)
    assert import_prefix(second.cache, tokens, loaded) == 12
    rid = second.add_request(prompt, greedy(6))
    got = drain(second)[rid][0]
    assert second.finished[-1].num_cached_tokens == 12
    assert export_prefix(second.cache, prompt)[0].arrays()[0].tobytes() == blocks[0].arrays()[0].tobytes()
    assert got == reference(model, prompt)


@pytest.fixture(scope="module")
def float_model():
    return kind_model("float")


def test_a_session_from_another_model_or_layout_or_form_is_refused_naming_the_difference(float_model, tmp_path):
    cfg = float_model.cfg
    session = session_generate(float_model, None, list(range(1, 11)), 3)[1]
    static = str(tmp_path / "static.session")
    save_static_session(static, cfg, "model-a", session.tokens, session.cache)
    with pytest.raises(SessionError, match=r"static.session was saved under another model or cache layout: model "
                                           r"weights digest model-b here, model-a in the file"):
        load_static_session(static, cfg, "model-b")
    with pytest.raises(SessionError, match=r"cache dtype int8 here, float32 in the file"):
        load_static_session(static, cfg.replace(cache_dtype="int8", kv_keys="token"), "model-a")
    layout = tier_layout(cfg, 4, "model-a")
    with pytest.raises(SessionError, match=r"static.session is a Generator session .* not a server session"):
        load_block_session(static, layout)
    blocks_file = str(tmp_path / "blocks.session")
    save_block_session(blocks_file, layout, list(range(1, 9)), [])
    with pytest.raises(SessionError, match=r"blocks.session is a server session .* not a Generator session"):
        load_static_session(blocks_file, cfg, "model-a")
    with pytest.raises(SessionError, match=r"block size 8 here, 4 in the file"):
        load_block_session(blocks_file, tier_layout(cfg, 8, "model-a"))
    data = open(static, "rb").read()
    open(static, "wb").write(data[:-10])
    with pytest.raises(SessionError, match=r"static.session: checksum mismatch .* not a whole session file"):
        load_static_session(static, cfg, "model-a")


def ring_model():
    """A GQA model whose first layer attends to a window of 8 tokens, kept as a ring of 72 slots in a context of
    128 (``dantinox.kv.ring``), the second to everything."""
    from dantinox.config import ModelConfig
    from serving_util import lively_model

    cfg = ModelConfig(attention="gqa", kv_heads=2, dim=64, n_heads=8, head_size=8, num_blocks=2, vocab_size=128,
                      max_context=128, mlp_hidden=128, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
    return lively_model(cfg)


@pytest.mark.parametrize("agree", [90, 10])   # the next prompt agrees with the session that far
def test_a_session_of_a_wrapped_window_ring_continues_as_a_fresh_prefill(tmp_path, agree):
    model = ring_model()
    assert [spec.ring for spec in layer_specs(model.cfg)] == [72, 0]
    rng = np.random.default_rng(13)
    prompt = rng.integers(1, 128, 80).tolist()
    _, session, _ = session_generate(model, None, prompt, 8)      # 87 tokens: the ring of 72 has wrapped
    path = str(tmp_path / "ring.session")
    save_static_session(path, model.cfg, "model-a", session.tokens, session.cache)
    tokens, cache = load_static_session(path, model.cfg, "model-a")
    follow = tokens[:agree] + rng.integers(1, 128, 94 - min(agree, len(tokens))).tolist()
    got, resumed, reused = session_generate(model, Session(tokens, cache), follow, 8)
    # agreeing to the end: all 87 kept; diverging at 10, before 87 - (72 - 8): the ring cannot serve, none kept
    assert reused == (87 if agree >= 87 else 0)
    want, fresh, _ = session_generate(model, None, follow, 8)
    assert got.tokens.tolist() == want.tokens.tolist() == generate_result(model, [follow], 8).tokens.tolist()
    n = len(fresh.tokens)
    assert resumed.tokens == fresh.tokens
    for a, b in zip(resumed.cache, fresh.cache):   # the slots the sequence filled, every layer (the whole ring);
        for x, y in zip(a, b):                     # a resume from a ring that lost the window moves the full
            x, y = np.asarray(x)[..., :n, :], np.asarray(y)[..., :n, :]   # layer's keys by ~0.3
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
