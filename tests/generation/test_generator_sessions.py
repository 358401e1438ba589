"""Generator.save_session / load_session: a Generator with keep_session=True keeps its last one-prompt call's
cache; saved and loaded by another Generator of the same run, the next call that extends it computes only the
new tokens and answers what a Generator without a session answers; a session of another run (other weights) or
with another cache dtype is refused naming the file and the difference; nothing to save is a clear error."""

import pytest
from conftest import tiny_config
from run_util import TEXT
from serving_util import lively_model

from dantinox.generation.generator import Generator
from dantinox.kv.sessions import SessionError
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer


def lively_run(path, seed: int) -> str:
    tokenizer = train_tokenizer(TEXT, "char")
    model = lively_model(tiny_config(attention="gqa", kv_heads=2, max_context=64, vocab_size=tokenizer.vocab_size),
                         seed=seed)
    save_run(path, model, model.cfg, tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sessions")
    return lively_run(root / "a", 3), lively_run(root / "b", 4)


def test_a_saved_session_continues_in_another_generator(runs, tmp_path):
    run, _ = runs
    first = Generator(run, warmup=False, keep_session=True)
    answer = first.complete("Nel mezzo del cammin", 6, temperature=0.0, unknown="replace")
    held = first.session_tokens
    assert len(held) == len(first.encode("Nel mezzo del cammin")) + answer.tokens - 1
    path = tmp_path / "turn1.session"
    assert first.save_session(path) > 0
    second = Generator(run, warmup=False)
    assert second.load_session(path) == len(held)
    follow = "Nel mezzo del cammin di nostra vita"
    got = second.complete(follow, 8, temperature=0.0)
    ids, common = second.encode(follow), 0
    while common < min(len(ids), len(held)) and ids[common] == held[common]:
        common += 1
    assert common >= len("Nel mezzo del cammin") and second.session_reused == common
    assert got.text == Generator(run, warmup=False).complete(follow, 8, temperature=0.0).text


def test_sessions_of_another_model_or_cache_dtype_are_refused_and_nothing_to_save_is_said(runs, tmp_path):
    run_a, run_b = runs
    gen = Generator(run_a, warmup=False, keep_session=True)
    with pytest.raises(ValueError, match="no session to save: create the Generator with keep_session=True"):
        gen.save_session(tmp_path / "none.session")
    gen.complete("Nel mezzo", 4, temperature=0.0)
    path = tmp_path / "a.session"
    gen.save_session(path)
    with pytest.raises(SessionError, match=r"a.session was saved under another model or cache layout: model weights "
                                           r"digest [0-9a-f]{64}\|quantize=None here, [0-9a-f]{64}\|quantize=None"):
        Generator(run_b, warmup=False).load_session(path)
    with pytest.raises(SessionError, match=r"cache dtype int8 here, float32 in the file"):
        Generator(run_a, warmup=False, kv_dtype="int8").load_session(path)
