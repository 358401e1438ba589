"""POST /v1/chat/completions with the official openai client (plain, streamed, n, seed, stop, usage) against
Generator.chat on the same run, and its errors: no chat template, unknown role, unsupported fields."""

import json
import httpx
import numpy as np
import openai
import pytest
from chat_util import INJECTION, MARKERS, chatml_literal_ids, save_tiny_chat_run
from serving_util import SMALL_BUCKETS

import dantinox as dx
from dantinox.generation.generator import Generator
from dantinox.runs.chat import load_chat_format
from dantinox.runs.run_dir import load_run
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.server import ServerThread, create_app

MESSAGES = [{"role": "system", "content": "Sei Virgilio."}, {"role": "user", "content": "Dove siamo?"}]


def serve(run_dir, with_template=True) -> ServerThread:
    model, _, tokenizer, _ = load_run(run_dir)
    chat = load_chat_format(run_dir, tokenizer) if with_template else None
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=96, max_running=8, max_batched_tokens=16,
                                             decode_buckets=(1, 4, 8), **SMALL_BUCKETS))
    return ServerThread(create_app(engine, tokenizer, "tiny-chat", chat)).start()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_chat_run(tmp_path_factory.mktemp("chat-serve") / "tiny-chat")


@pytest.fixture(scope="module")
def server(run_dir):
    srv = serve(run_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_chat_plain_and_streamed(client, run_dir):
    gen = Generator(run_dir, warmup=False)
    prompt_tokens = len(gen.chat_format.prompt_ids(MESSAGES, gen.tokenizer))
    want = gen.chat(MESSAGES, 10, temperature=0)
    done = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_completion_tokens=10,
                                          temperature=0)
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant" and done.choices[0].message.content == want
    assert done.usage.prompt_tokens == prompt_tokens and done.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_chat_sampling_n_seed_and_stop(client, run_dir):
    gen = Generator(run_dir, warmup=False)
    sampled = gen.chat(MESSAGES, 8, temperature=1.0, seed=5)
    many = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=1.0,
                                          seed=5, n=2)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].message.content == sampled
    greedy = gen.chat(MESSAGES, 12, temperature=0)
    stop = greedy[3:5]
    cut = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0,
                                         stop=[stop])
    assert cut.choices[0].message.content == greedy[: greedy.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_stops_at_end_of_turn_id(tmp_path):
    probe = Generator(save_tiny_chat_run(tmp_path / "probe"), warmup=False)
    free = np.asarray(dx.generate(probe.model, probe.chat_format.prompt_ids(MESSAGES, probe.tokenizer), 12))
    run = save_tiny_chat_run(tmp_path / "stop", eos_ids=[int(free[2])])
    first = int(np.flatnonzero(np.isin(free, Generator(run, warmup=False).chat_format.stop_ids))[0])
    with serve(run) as srv:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = cl.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == Generator(run, warmup=False).chat(MESSAGES, 12, temperature=0)
    assert out.choices[0].message.content == probe.tokenizer.decode(free[:first].tolist())
    assert out.usage.completion_tokens == first + 1  # the end-of-turn token counts, but is not shown


def test_k12_special_token_text_in_a_message_stays_text(client, run_dir):
    """The user typed ChatML markers: usage.prompt_tokens is the length of the safe encoding (only the
    template's markers are control ids), and the answer is the one Generator.chat gives for those ids."""
    messages = [MESSAGES[0], {"role": "user", "content": INJECTION}]
    gen = Generator(run_dir, warmup=False)
    want = chatml_literal_ids(gen.tokenizer, messages)
    naive = gen.tokenizer.encode(gen.chat_format.template.render(messages))
    assert len(naive) < len(want)  # rendered and encoded in one go, the typed markers became 4 control ids
    done = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0)
    assert done.usage.prompt_tokens == len(want)
    assert gen.chat_prompt_ids(messages) == want
    assert done.choices[0].message.content == gen.chat(messages, 6, temperature=0)
    start, end = (gen.tokenizer.hf.token_to_id(m) for m in MARKERS)
    assert (want.count(start), want.count(end)) == (3, 2)


@pytest.mark.parametrize("body, field, text", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}, "messages[1].role",
     "'wizard' is not allowed"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "is not allowed"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "user", "content": "\udc80 hi"}]}, "messages[0].content",  # JSON's "\udc80"
     "messages[0].content is not valid Unicode: a lone surrogate U+DC80"),
    ({"messages": [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
     "messages[1].content", "U+D800 at character 1"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    ({"messages": MESSAGES, "n": 0}, "n", "n=0"),
    ({"messages": [{"role": "user", "content": "Dove siamo? " * 40}]}, "messages",  # over the context of 96
     "after the chat template, the prompt has"),
])
def test_chat_bad_requests_name_the_field(server, body, field, text):
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(body),   # ASCII: "\ud800" escapes
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and text in error["message"]


def test_model_without_template_answers_400(run_dir):
    with serve(run_dir, with_template=False) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=30)
        assert r.status_code == 400
        assert "has no chat template" in r.json()["error"]["message"]
        plain = httpx.post(srv.url + "/v1/completions", json={"prompt": "Nel", "max_tokens": 2}, timeout=30)
        assert plain.status_code == 200


def test_bundled_dante_has_a_chat_template():
    from dantinox.runs.bundled import bundled_run_dir
    from dantinox.runs.tokenizer import TextTokenizer

    run = bundled_run_dir("dante")
    chat = load_chat_format(run, TextTokenizer.load(f"{run}/tokenizer.json"))
    assert chat.stop_ids == () and chat.template.render([{"role": "system", "content": "a"},
                                                         {"role": "user", "content": "b"}]) == "a\nb\n"


@pytest.mark.slow  # the bundled model's engine compiles for ~40 s on two CPUs
def test_bundled_model_chats():
    """The bundled dante run has a plain chat template (each message's text on its own line), so
    /v1/chat/completions (guidellm's default request) answers on it, as Generator.chat does."""
    from dantinox.runs.bundled import bundled_run_dir

    run = bundled_run_dir("dante")
    messages = [{"role": "user", "content": "Nel mezzo del cammin di nostra vita"}]
    gen = Generator(run, warmup=False)
    assert gen.chat_format.template.render(messages) == "Nel mezzo del cammin di nostra vita\n"
    want = gen.chat(messages, 8, temperature=0)
    engine = PagedEngine(gen.model, EngineConfig(block_size=16, num_blocks=32, max_running=1, max_batched_tokens=16,
                                                 decode_buckets=(1,), prefill_buckets=(1,), chunk_buckets=(16,),
                                                 max_decode_steps=1))
    with ServerThread(create_app(engine, gen.tokenizer, "dante", gen.chat_format)) as srv:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        done = cl.chat.completions.create(model="dante", messages=messages, max_tokens=8, temperature=0)
        chunks = list(cl.chat.completions.create(model="dante", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert done.choices[0].message.content == want and done.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 8
