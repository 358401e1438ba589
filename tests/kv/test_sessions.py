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
