"""Structured outputs in the serving engine and the HTTP API (issue 21): constrained and free rows in one batch
(the free rows get the tokens they get alone; constrained rows the tokens of the static host-stepped loop with
the same seed), preemption (a recomputed request's matcher is rebuilt from its tokens), logprobs of the masked
distribution, one compiled program for every grammar; then the OpenAI fields (response_format, structured_outputs,
guided_*) through the official openai client, chat.completions.parse with a pydantic model, streaming, n > 1,
finish_reason "length", and 400s naming the field."""

import json
import math
import re
from typing import Literal

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from chat_util import TEXT, chat_tokenizer, save_tiny_chat_run
from conftest import tiny_config
from pydantic import BaseModel, Field
from serving_util import SMALL_BUCKETS, drain, lively_model, make_engine

import dantinox as dx
from dantinox.generation.constrained_decode import constrained_result
from dantinox.generation.grammar import choice_constraint, grammar_vocabulary, json_schema_constraint
from dantinox.runs.chat import load_chat_format
from dantinox.runs.run_dir import load_run
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.request import SamplingOptions
from dantinox.serving.server import ServerThread, create_app

STOP = 261  # <|im_end|> of the chat tokenizer
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "year"],
          "properties": {"city": {"enum": ["Firenze", "Roma", "Ravenna"]},
                         "year": {"type": "integer", "minimum": 1265, "maximum": 1321},
                         "note": {"type": "string", "maxLength": 6}}}
MESSAGES = [{"role": "user", "content": "Dove nacque Dante?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = tiny_config(attention="gqa", kv_heads=2, vocab_size=tokenizer.vocab_size, max_context=96)
    return lively_model(cfg)


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return grammar_vocabulary(tokenizer, (STOP,))


def prompt(tokenizer, start):
    return tokenizer.encode(TEXT[start:start + 12])


def test_mixed_batch_free_rows_unchanged_constrained_rows_as_static(model, tokenizer, vocabulary):
    schema = json_schema_constraint(SCHEMA, vocabulary)
    # one bucket per kind of call, so the warm-up is short: every later step runs one of these two programs
    engine = make_engine(model, decode_buckets=(4,), prefill_buckets=(4,), chunk_buckets=(16,), max_decode_steps=1)
    engine.warmup()
    with dx.CompileCounter() as counted:
        rows = [(prompt(tokenizer, 0), SamplingOptions(40, temperature=1.0, seed=5, stop_token_ids=(STOP,),
                                                       constraint=schema)),
                (prompt(tokenizer, 3), SamplingOptions(20, temperature=1.0, seed=6, logprobs=3)),
                (prompt(tokenizer, 9), SamplingOptions(40, temperature=0.7, seed=7, stop_token_ids=(STOP,),
                                                       constraint=choice_constraint(["sì", "no"], vocabulary))),
                (prompt(tokenizer, 20), SamplingOptions(20))]
        ids = [engine.add_request(p, o) for p, o in rows]
        out = drain(engine)
    assert counted.compilations == 0, counted  # warmed up: no grammar compiles anything
    for rid, (p, o) in zip(ids, rows):
        tokens, reason = out[rid]
        if o.constraint is None:
            want = dx.generate(model, p, o.max_new_tokens, temperature=o.temperature, seed=o.seed).tolist()
            assert tokens == want and reason == "length"
        else:
            static = constrained_result(model, p, [o.constraint], o.max_new_tokens, temperature=o.temperature,
                                        seed=o.seed, eos_id=[STOP])
            assert tokens == static.tokens[0, :static.lengths[0]].tolist() and reason == "stop"
            assert tokens[-1] == STOP
    jsonschema.validate(json.loads(tokenizer.decode(out[ids[0]][0][:-1])), SCHEMA)
    assert tokenizer.decode(out[ids[2]][0][:-1]) in ("sì", "no")


def test_logprobs_are_of_the_masked_distribution(model, tokenizer, vocabulary):
    engine = make_engine(model)
    options = SamplingOptions(12, temperature=1.0, seed=1, logprobs=5, stop_token_ids=(STOP,),
                              constraint=choice_constraint(["rosso", "verde", "blu"], vocabulary))
    rid = engine.add_request(prompt(tokenizer, 4), options)
    logprobs = []
    while engine.has_unfinished():
        for o in engine.step():
            logprobs += o.logprobs or []
    first = logprobs[0]
    allowed = [(t, lp) for t, lp in first.top if lp > -1e29]
    assert {tokenizer.decode([t])[0] for t, _ in allowed} == {"r", "v", "b"}
    assert math.isclose(sum(math.exp(lp) for _, lp in allowed), 1.0, rel_tol=1e-5)  # renormalized over 3 tokens
    assert logprobs[-1].token_id == STOP and math.isclose(logprobs[-1].logprob, 0.0, abs_tol=1e-6)  # forced
    assert rid not in engine.requests


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_preempted_constrained_requests_rebuild_their_matchers(model, tokenizer, vocabulary):
    schema = json_schema_constraint(SCHEMA, vocabulary)
    options = [SamplingOptions(64, temperature=1.0, seed=s, stop_token_ids=(STOP,), constraint=schema)
               for s in range(3)]
    prompts = [prompt(tokenizer, 10 * i) for i in range(3)]
    small = make_engine(model, num_blocks=24, enable_prefix_caching=False, max_running=3)
    ids = [small.add_request(p, o) for p, o in zip(prompts, options)]
    out = drain(small)
    assert small.stats()["preemptions"] >= 1
    rebuilt = [r for r in small.finished if r.num_preemptions]
    assert rebuilt
    for rid, p, o in zip(ids, prompts, options):
        static = constrained_result(model, p, [schema], 64, temperature=1.0, seed=o.seed, eos_id=[STOP])
        assert out[rid] == (static.tokens[0, :static.lengths[0]].tolist(), "stop")
        jsonschema.validate(json.loads(tokenizer.decode(out[rid][0][:-1])), SCHEMA)


def test_length_cut_and_ignore_eos(model, tokenizer, vocabulary):
    engine = make_engine(model)
    schema = json_schema_constraint(SCHEMA, vocabulary)
    cut = engine.add_request(prompt(tokenizer, 0), SamplingOptions(3, temperature=1.0, constraint=schema,
                                                                   stop_token_ids=(STOP,)))
    free = engine.add_request(prompt(tokenizer, 0), SamplingOptions(40, constraint=choice_constraint(["a", "b"],
                                                                                                      vocabulary)))
    out = drain(engine)
    assert out[cut][1] == "length" and tokenizer.decode(out[cut][0]).startswith('{"')
    assert out[free][1] == "stop" and tokenizer.decode(out[free][0]) in ("a", "b")  # no stop id: ends with the grammar


# The HTTP API ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_chat_run(tmp_path_factory.mktemp("structured-serve") / "tiny-chat", max_context=160)


@pytest.fixture(scope="module")
def server(run_dir):
    model, _, tok, _ = load_run(run_dir)
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=200, max_running=8, max_batched_tokens=16,
                                             decode_buckets=(1, 4, 8), **SMALL_BUCKETS))
    srv = ServerThread(create_app(engine, tok, "tiny-chat", load_chat_format(run_dir, tok))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_response_format_json_schema_plain_streamed_and_n(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "birth", "schema": SCHEMA, "strict": True}}
    done = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, response_format=fmt,
                                          temperature=1.0, seed=3, n=3, max_tokens=60)
    for choice in done.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, response_format=fmt,
                                            temperature=1.0, seed=3, max_tokens=60, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    anything = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=1.0, seed=1,
                                              response_format={"type": "json_object"}, max_tokens=120)
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")


class Birth(BaseModel):
    city: Literal["Firenze", "Roma", "Ravenna"]
    year: int = Field(ge=1265, le=1321)
    sure: bool


def test_openai_parse_with_a_pydantic_model(client):
    parsed = client.chat.completions.parse(model="tiny-chat", messages=MESSAGES, response_format=Birth,
                                           temperature=1.0, seed=11, max_tokens=60)
    birth = parsed.choices[0].message.parsed
    assert isinstance(birth, Birth) and 1265 <= birth.year <= 1321


def test_completions_guided_fields_and_structured_outputs(client):
    body = dict(model="tiny-chat", prompt=TEXT[:20], temperature=1.0, seed=2, max_tokens=100)
    regex = r"\d{2}-[a-z]{3}"
    for extra, check in (
            ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
            ({"guided_choice": ["Inferno", "Purgatorio", "Paradiso"]},
             lambda t: t in ("Inferno", "Purgatorio", "Paradiso")),
            ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
            ({"structured_outputs": {"grammar": 'root ::= "si" | "no"'}}, lambda t: t in ("si", "no")),
            ({"structured_outputs": {"regex": "[A-Z]{2,3}"}}, lambda t: re.fullmatch("[A-Z]{2,3}", t)),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)):
        done = client.completions.create(**body, extra_body=extra)
        assert done.choices[0].finish_reason == "stop" and check(done.choices[0].text), (extra, done)
    cut = client.completions.create(**dict(body, max_tokens=2), extra_body={"guided_json": SCHEMA})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].text.startswith("{")
    lp = client.completions.create(**dict(body, logprobs=2), extra_body={"guided_choice": ["ab", "cd"]})
    assert lp.choices[0].text in ("ab", "cd") and all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)


@pytest.mark.parametrize("path, extra, field", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("completions", {"guided_regex": "[a-"}, "guided_regex"),
    ("completions", {"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ("completions", {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("completions", {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ("completions", {"structured_outputs": {}}, "structured_outputs"),
])
def test_bad_constraints_answer_400_naming_the_field(server, path, extra, field):
    body = {"model": "tiny-chat", "max_tokens": 4, **extra}
    body.update({"messages": MESSAGES} if path == "chat" else {"prompt": "Nel"})
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field.split(".")[-1] in error["message"], error


def test_free_and_constrained_requests_at_once(client):
    """Both kinds in flight together (the engine batches them in one step)."""
    import concurrent.futures as futures

    def free(seed):
        return client.completions.create(model="tiny-chat", prompt=TEXT[:20], temperature=1.0, seed=seed,
                                         max_tokens=12).choices[0].text

    def guided(seed):
        return client.completions.create(model="tiny-chat", prompt=TEXT[:20], temperature=1.0, seed=seed,
                                         max_tokens=100, extra_body={"guided_json": SCHEMA}).choices[0].text

    alone = [free(s) for s in range(3)]
    with futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(free, s) for s in range(3)] + [pool.submit(guided, s) for s in range(3)]
        results = [j.result() for j in jobs]
    assert results[:3] == alone
    for text in results[3:]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert np.all([len(t) > 0 for t in results])
