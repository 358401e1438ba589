"""n choices per prompt and token log-probabilities: in the engine (raw log_softmax equal to an uncached forward's,
choices sharing the prompt's blocks through the prefix cache) and over HTTP (OpenAI's `n` and legacy `logprobs`
fields, non-streamed and streamed, and through the official openai client)."""

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest
from conftest import tiny_config
from flax import nnx
from serving_util import drain, lively_mla_model, lively_model, make_engine, solo
from test_serving_server import save_tiny_bpe_run, start_server

import dantinox as dx
from dantinox.runs.run_dir import load_run
from dantinox.serving.request import QueueFullError, RequestError, SamplingOptions
from dantinox.serving.worker import EngineWorker

TOL = 1e-4


@nnx.jit
def _uncached(model, ids):
    return model(ids, use_cache=False)[0]


def reference_logprobs(model, prompt, tokens) -> np.ndarray:
    """log_softmax of a plain forward (no cache) over prompt + tokens, at the positions that predicted each
    token: [len(tokens), V] float64."""
    seq = list(prompt) + list(tokens)
    padded = np.zeros((1, model.cfg.max_context), np.int32)  # right padding: causal, so it changes nothing
    padded[0, :len(seq)] = seq
    logits = np.asarray(_uncached(model, padded)[0], np.float64)[len(prompt) - 1:len(seq) - 1]
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def check_token_logprobs(model, prompt, tokens, logprobs, k):
    """Each TokenLogprobs equals the uncached reference: the chosen token's log-probability and the k most
    likely tokens (ids and values)."""
    want = reference_logprobs(model, prompt, tokens)
    assert [lp.token_id for lp in logprobs] == tokens
    for t, lp in enumerate(logprobs):
        assert abs(lp.logprob - want[t, tokens[t]]) <= TOL, t
        order = np.argsort(-want[t], kind="stable")[:k]
        assert len(lp.top) == k
        np.testing.assert_allclose([v for _, v in lp.top], want[t, order], atol=TOL, rtol=0)
        assert all(abs(want[t, i] - v) <= TOL for i, v in lp.top)  # each id carries its own figure


@pytest.mark.parametrize("attention", ["gqa", pytest.param("mla", marks=pytest.mark.slow)])
def test_engine_logprobs_equal_log_softmax_of_an_uncached_forward(attention):
    if attention == "mla":
        model = lively_mla_model(dx.ModelConfig.from_preset("tiny-mla", max_context=64))
    else:
        model = lively_model(tiny_config(attention="gqa", kv_heads=2, max_context=64))
    engine = make_engine(model, num_blocks=40)
    rng = np.random.default_rng(4)
    batch = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (3, 10, 21)]
    settings = [dict(logprobs=5), dict(logprobs=2), dict(logprobs=0, temperature=1.5, top_k=20, seed=9),
                dict()]
    ids = [engine.add_request(p, SamplingOptions(max_new_tokens=10, **s))
           for p, s in zip(batch + batch[:1], settings)]
    got = {rid: [] for rid in ids}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.new_token_ids:
                got[out.request_id].append(out.logprobs)
    for rid, prompt, s in zip(ids, batch + batch[:1], settings):
        sampling = {k: v for k, v in s.items() if k != "logprobs"}
        tokens = solo(model, prompt, 10, **sampling)
        if "logprobs" not in s:
            assert got[rid] == [None] * 10
            continue
        logprobs = [entry[0] for entry in got[rid]]
        # Raw figures even for the sampled request (temperature 1.5): the model's distribution, not the draw's.
        check_token_logprobs(model, prompt, tokens, logprobs, s["logprobs"])
        if "temperature" not in s:  # greedy: the chosen token is the most likely one
            assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in logprobs)


def test_choices_share_the_prompt_blocks_through_the_prefix_cache():
    model = lively_model(tiny_config(attention="gqa", kv_heads=2, max_context=64))
    prompt = np.random.default_rng(5).integers(0, model.cfg.vocab_size, 13).tolist()  # 3 full blocks of 4
    options = [SamplingOptions(max_new_tokens=8), SamplingOptions(max_new_tokens=8, temperature=1.0, seed=1),
               SamplingOptions(max_new_tokens=8, temperature=1.0, seed=2)]
    stats, outputs = {}, {}
    for share in (True, False):
        engine = make_engine(model, num_blocks=40)
        ids = [engine.add_request(prompt, opts, request_id=f"c{i}", share_prompt_with="c0" if share else None)
               for i, opts in enumerate(options)]
        results = drain(engine)
        outputs[share] = [results[rid][0] for rid in ids]
        stats[share] = engine.stats()
    assert outputs[True] == outputs[False] == [solo(model, prompt, 8, temperature=o.temperature, seed=o.seed)
                                               for o in options]
    # Shared: the prompt is computed once, each other choice computes only its last, partial block's token;
    # then 7 decode feeds per choice. Without sharing, the second choice computes the prompt a second time.
    assert stats[True]["prefix_cache_hits"] == 2 * 3
    assert stats[True]["computed_tokens"] == 13 + 2 * 1 + 3 * 7 < stats[False]["computed_tokens"]
    assert stats[True]["blocks_used"] == 0


def test_the_worker_adds_all_choices_of_a_request_or_none():
    model = lively_model(tiny_config(attention="gqa", kv_heads=2, max_context=64))
    engine = make_engine(model, num_blocks=40, max_queued=3)
    worker = EngineWorker(engine)  # not started: the test runs its commands on this thread
    loop, events = asyncio.new_event_loop(), asyncio.Queue()
    prompt, opts = [5, 6, 7], SamplingOptions(max_new_tokens=4)
    try:
        worker._execute(("submit", ["a0", "a1"], prompt, [opts] * 2, loop, events, 0.0, None))
        worker._execute(("submit", ["b0", "b1"], prompt, [opts] * 2, loop, events, 0.0, None))  # b1: queue full
        loop.run_until_complete(asyncio.sleep(0))
        replies = [events.get_nowait() for _ in range(events.qsize())]
    finally:
        loop.close()
    assert replies[0] == ("accepted",) and replies[1][0] == "rejected" and len(replies) == 2
    assert isinstance(replies[1][1], QueueFullError)
    results = drain(engine)
    assert results["a0"] == results["a1"] == (solo(model, prompt, 4), "length")
    assert results["b0"] == ([], "abort") and "b1" not in results  # b0 left the queue again
    assert engine.stats()["blocks_used"] == 0 and set(worker._streams) == {"a0", "a1"}


def test_more_choices_than_the_queue_holds_is_a_400_on_n_not_a_429():
    # n > max_queued can never be admitted, even on an idle server: "retry later" would be false
    # (new-user walk-through, 2026-12-04: serve --max-queued 2 answered n=3 with 429 every time)
    engine = make_engine(lively_model(tiny_config(max_context=64)), num_blocks=40, max_queued=2)
    worker = EngineWorker(engine)
    loop, events = asyncio.new_event_loop(), asyncio.Queue()
    opts = SamplingOptions(max_new_tokens=2)
    try:
        worker._execute(("submit", ["c0", "c1", "c2"], [5, 6], [opts] * 3, loop, events, 0.0, None))
        worker._execute(("submit", ["d0", "d1"], [5, 6], [opts] * 2, loop, events, 0.0, None))
        loop.run_until_complete(asyncio.sleep(0))
        replies = [events.get_nowait() for _ in range(events.qsize())]
    finally:
        loop.close()
    assert replies[0][0] == "rejected" and isinstance(replies[0][1], RequestError)
    assert replies[0][1].field == "n" and "max_queued=2" in str(replies[0][1])
    assert replies[1] == ("accepted",)   # n = max_queued still fits an empty queue
    assert set(drain(engine)) == {"d0", "d1"}


# HTTP ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    model, _, tokenizer, _ = load_run(save_tiny_bpe_run(tmp_path_factory.mktemp("choices") / "tiny-bpe"))
    return model, tokenizer


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded)
    yield srv
    srv.stop()


def complete(server, **body) -> dict:
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(server, **body) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def generated(loaded, prompt_ids, n, **sampling) -> list[int]:
    return np.asarray(dx.generate(loaded[0], prompt_ids, n, **sampling)).tolist()


def test_n_greedy_choices_are_identical_and_usage_counts_them_all(server, loaded):
    prompt = "Nel mezzo del"
    ids = loaded[1].encode(prompt)
    want = loaded[1].decode(generated(loaded, ids, 10))
    reply = complete(server, prompt=prompt, max_tokens=10, temperature=0, n=3)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["text"] for c in reply["choices"]] == [want] * 3
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in reply["choices"])
    cached = reply["usage"].pop("prompt_tokens_details")["cached_tokens"]   # the prompt counted once
    assert reply["usage"] == dict(prompt_tokens=len(ids), completion_tokens=30, total_tokens=len(ids) + 30)
    assert cached == (len(ids) - 1) // 4 * 4 or cached == 0   # block size 4: a hit on whole blocks, or none


def test_n_seeded_choices_are_reproducible_and_differ(server, loaded):
    ids = loaded[1].encode("ché la diritta")
    body = dict(prompt=ids, max_tokens=12, temperature=1.0, top_k=50, seed=21, n=3)
    first, again = complete(server, **body), complete(server, **body)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) == 3
    for i, text in enumerate(texts):  # choice i draws with seed + i
        assert text == loaded[1].decode(generated(loaded, ids, 12, temperature=1.0, top_k=50, seed=21 + i))
    one = complete(server, **{**body, "n": 1})
    assert one["choices"][0]["text"] == texts[0]


def test_n_choices_stream_chunks_tagged_by_index(server, loaded):
    body = dict(prompt="Nel mezzo", max_tokens=10, temperature=1.0, seed=4, n=2, logprobs=1,
                stream_options={"include_usage": True})
    whole = complete(server, **{k: v for k, v in body.items() if k != "stream_options"})
    chunks = stream(server, **body)
    texts, finish, logprobs = {0: "", 1: ""}, {}, {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["text"]
        logprobs[choice["index"]] += choice["logprobs"]["token_logprobs"]
        if choice["finish_reason"] is not None:
            assert choice["index"] not in finish
            finish[choice["index"]] = choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    assert finish == {0: "length", 1: "length"}
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"]
        np.testing.assert_allclose(logprobs[c["index"]], c["logprobs"]["token_logprobs"], atol=TOL, rtol=0)
    assert whole["choices"][0]["text"] != whole["choices"][1]["text"]


def test_logprobs_equal_log_softmax_of_an_uncached_forward(server, loaded):
    model, tokenizer = loaded
    prompt = "Nel mezzo del cammin"
    ids = tokenizer.encode(prompt)
    tokens = generated(loaded, ids, 12)
    reply = complete(server, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    want = reference_logprobs(model, ids, tokens)
    assert lp["tokens"] == [tokenizer.decode([t]) for t in tokens]
    np.testing.assert_allclose(lp["token_logprobs"], want[np.arange(12), tokens], atol=TOL, rtol=0)
    for t, top in enumerate(lp["top_logprobs"]):
        assert lp["tokens"][t] in top and abs(top[lp["tokens"][t]] - lp["token_logprobs"][t]) <= TOL
        assert max(top.values()) == top[lp["tokens"][t]]  # greedy: the chosen token is the likeliest
        expected = {}  # the 3 likeliest tokens by text; a text shared by two tokens keeps the likelier
        for i in np.argsort(-want[t], kind="stable")[:3]:
            expected.setdefault(tokenizer.decode([int(i)]), want[t, i])
        assert top.keys() == expected.keys()
        np.testing.assert_allclose([top[k] for k in expected], list(expected.values()), atol=TOL, rtol=0)
    assert tokenizer.decode(tokens) == choice["text"]
    # Offsets: characters completed before token t (an unfinished multi-byte character at the end decodes to
    # U+FFFD and is not complete yet).
    assert lp["text_offset"] == [len(tokenizer.decode(tokens[:t]).rstrip("\ufffd")) for t in range(12)]
    # Later requests reuse the prompt's cached blocks, so their figures differ by float rounding only.
    zero = complete(server, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)["choices"][0]["logprobs"]
    assert [list(top) for top in zero["top_logprobs"]] == [[tok] for tok in lp["tokens"]]
    np.testing.assert_allclose([v for top in zero["top_logprobs"] for v in top.values()], lp["token_logprobs"],
                               atol=TOL, rtol=0)
    streamed = stream(server, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    joined = {key: sum((c["choices"][0]["logprobs"][key] for c in streamed), []) for key in lp}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    np.testing.assert_allclose(joined["token_logprobs"], lp["token_logprobs"], atol=TOL, rtol=0)
    assert [list(top) for top in joined["top_logprobs"]] == [list(top) for top in lp["top_logprobs"]]


def test_openai_client_reads_n_and_logprobs(server, loaded):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids = loaded[1].encode("Nel mezzo")
    want = loaded[1].decode(generated(loaded, ids, 8))
    done = client.completions.create(model="tiny", prompt="Nel mezzo", max_tokens=8, temperature=0, n=2,
                                     logprobs=2)
    assert [c.index for c in done.choices] == [0, 1] and [c.text for c in done.choices] == [want, want]
    assert len(done.choices[1].logprobs.token_logprobs) == 8 and len(done.choices[1].logprobs.text_offset) == 8
    assert done.usage.completion_tokens == 16
    chunks = list(client.completions.create(model="tiny", prompt="Nel mezzo", max_tokens=8, temperature=0, n=2,
                                            stream=True))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == index) == want
