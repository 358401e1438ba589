"""OpenAI API conformance with the official openai client, on a tiny chat run: chat logprobs (plain and
streamed, checked against the model's own log-softmax), usage.prompt_tokens_details.cached_tokens from the
prefix cache, tools with "auto" on a template without tools (the generic tool prompt), the Responses API,
error statuses and codes (unknown model, too-long prompt, bad or missing API key), GET /v1/models/{id}, the
paths without /v1, and fields the server does not read."""

import json

import httpx
import numpy as np
import openai
import pytest
from chat_util import save_tiny_chat_run
from serving_util import solo, static_logits

from dantinox.runs.chat import load_chat_format
from dantinox.runs.run_dir import load_run
from dantinox.serving.api_keys import exposure_warning, key_matches, parse_api_keys
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.generic_tools import GENERIC_INSTRUCTIONS, with_generic_tools
from dantinox.serving.server import ServerThread, create_app

MESSAGES = [{"role": "system", "content": "Sei Virgilio."}, {"role": "user", "content": "Dove siamo?"}]
TOOL = {"type": "function", "function": {"name": "vai", "description": "go",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                        "required": ["a"], "additionalProperties": False}}}
KEYS = ("sk-one", "sk-two")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    run_dir = save_tiny_chat_run(tmp_path_factory.mktemp("conformance") / "tiny-chat", max_context=1024)
    model, _, tokenizer, _ = load_run(run_dir)
    return model, tokenizer, load_chat_format(run_dir, tokenizer)


def start(loaded, **app_fields) -> ServerThread:
    model, tokenizer, chat = loaded
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=1024, max_running=4, max_batched_tokens=64,
                                             decode_buckets=(1, 4), prefill_buckets=(1, 4), chunk_buckets=(16, 64)))
    return ServerThread(create_app(engine, tokenizer, "tiny-chat", chat, **app_fields)).start()


@pytest.fixture(scope="module")
def server(loaded):
    srv = start(loaded, model_aliases=("gpt-4o",))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_logprobs(model, prompt: list, generated: list) -> np.ndarray:
    """Independent reference: log_softmax of the static-cache forward pass over prompt + generated, the row
    that predicts each generated token. Returns [len(generated), V]."""
    logits = static_logits(model, prompt + generated)[len(prompt) - 1:len(prompt) - 1 + len(generated)]
    logits = logits - logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def test_chat_logprobs_plain_and_streamed_match_the_model_and_completions(client, loaded):
    model, tokenizer, chat = loaded
    prompt = chat.prompt_ids(MESSAGES, tokenizer)
    done = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    entries = done.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == done.choices[0].message.content
    generated = solo(model, prompt, 6)   # batch-1 greedy tokens: dx.generate
    reference = model_logprobs(model, prompt, generated)
    assert [e.token for e in entries] == [tokenizer.decode([t]) for t in generated]
    for e, ref, token in zip(entries, reference, generated):
        assert e.bytes == list(e.token.encode("utf-8")) and len(e.top_logprobs) == 3
        np.testing.assert_allclose(e.logprob, ref[token], atol=2e-4)
        best = np.argsort(-ref, kind="stable")[:3]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], ref[best], atol=2e-4)
        assert [t.token for t in e.top_logprobs] == [tokenizer.decode([int(i)]) for i in best]
    legacy = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    assert legacy.choices[0].text == done.choices[0].message.content
    np.testing.assert_allclose(legacy.choices[0].logprobs.token_logprobs, [e.logprob for e in entries],
                               atol=1e-5)   # the same figures (up to the batch's float order)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in entries], atol=1e-5)
    none = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [({"top_logprobs": 3}, "top_logprobs"),
                                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                         ({"logprobs": "yes"}, "logprobs")])
def test_chat_logprobs_bad_values_name_the_field(server, body, param):
    reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_cached_tokens_come_from_the_prefix_cache_on_both_endpoints(client, loaded):
    _, tokenizer, chat = loaded
    messages = [{"role": "user", "content": "Nel mezzo del cammin di nostra vita, " * 3}]
    prompt = chat.prompt_ids(messages, tokenizer)
    full_blocks = (len(prompt) - 1) // 4 * 4   # whole blocks of 4, never the last token
    first = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens == len(prompt) and again.usage.prompt_tokens_details.cached_tokens == full_blocks
    plain = client.completions.create(model="tiny-chat", prompt=prompt[:-2] + [prompt[0], prompt[1]], max_tokens=2)
    shared = (len(prompt) - 2) // 4 * 4   # the blocks before the changed tail
    assert plain.usage.prompt_tokens_details.cached_tokens == shared
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full_blocks


def test_auto_tools_on_a_template_without_tools_run_the_generic_prompt(server, client, loaded):
    _, tokenizer, chat = loaded
    assert not chat.template.supports_tools
    raw = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                     json={"messages": MESSAGES, "tools": [TOOL], "max_tokens": 4, "temperature": 0})
    assert raw.status_code == 200 and raw.headers["x-tool-format"] == "generic"
    assert raw.json()["tool_format"] == "generic"
    expected = chat.prompt_ids(with_generic_tools(MESSAGES, [TOOL]), tokenizer)
    assert raw.json()["usage"]["prompt_tokens"] == len(expected)
    rendered = chat.template.render(with_generic_tools(MESSAGES, [TOOL]))
    assert GENERIC_INSTRUCTIONS.split("{tools}")[0] in rendered and '"name": "vai"' in rendered
    forced = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=MESSAGES, tools=[TOOL], tool_choice="required", max_tokens=300, temperature=0,
        parallel_tool_calls=False)
    assert forced.headers["x-tool-format"] == "grammar"
    assert forced.parse().choices[0].message.tool_calls[0].function.name == "vai"


def test_generic_prompt_writes_earlier_calls_and_results_as_text():
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "vai", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_2", "content": "fine"}]
    out = with_generic_tools(history, [TOOL])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Sei Virgilio.\n\nYou can call")
    assert out[2] == {"role": "assistant", "content": '<tool_call>{"name": "vai", "arguments": {"a": 1}}</tool_call>'}
    assert out[3] == {"role": "user", "content": '<tool_response>{"tool_call_id": "call_1", "content": "ok"}'
                      '</tool_response>\n<tool_response>{"tool_call_id": "call_2", "content": "fine"}'
                      '</tool_response>'}
    assert len(out) == 4
    assert with_generic_tools([{"role": "user", "content": "x"}], [TOOL])[0]["role"] == "system"


def test_responses_create_stream_instructions_and_previous_response(client):
    want = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=5, temperature=0)
    first = client.responses.create(model="tiny-chat", instructions="Sei Virgilio.", input="Dove siamo?",
                                    max_output_tokens=5, temperature=0)
    assert first.id.startswith("resp_") and first.output[0].id.startswith("msg_")
    assert first.output_text == want.choices[0].message.content
    assert first.usage.input_tokens == want.usage.prompt_tokens
    assert first.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model="tiny-chat", instructions="Sei Virgilio.", input="Dove siamo?",
                                          max_output_tokens=5, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == first.output_text == events[-1].response.output_text
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {events[-1].response.output[0].id}
    follow = client.responses.create(model="tiny-chat", previous_response_id=first.id, input="E poi?",
                                     max_output_tokens=3, temperature=0)
    history = [{"role": "user", "content": "Dove siamo?"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "E poi?"}]   # instructions are not carried over (OpenAI's rule)
    same = client.chat.completions.create(model="tiny-chat", messages=history, max_tokens=3, temperature=0)
    assert follow.output_text == same.choices[0].message.content
    assert follow.usage.input_tokens == same.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_responses_function_tools_whole_and_streamed(client):
    tool = {"type": "function", "name": "vai", "parameters": TOOL["function"]["parameters"]}
    whole = client.responses.create(model="tiny-chat", input="Dove?", tools=[tool], tool_choice="required",
                                    max_output_tokens=300, temperature=0, parallel_tool_calls=False)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "vai" and isinstance(json.loads(calls[0].arguments)["a"], int)
    events = list(client.responses.create(model="tiny-chat", input="Dove?", tools=[tool], tool_choice="required",
                                          max_output_tokens=300, temperature=0, stream=True,
                                          parallel_tool_calls=False))
    final = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == "".join(e.arguments for e in done) == "".join(
        i.arguments for i in final.output if i.type == "function_call")
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [
        (c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("body, param, code", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     None),
    ({"input": "x", "background": True}, "background", None),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found"),
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens", None),
    ({}, "input", None),
])
def test_responses_unsupported_parts_are_a_clear_400(server, body, param, code):
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error", error


def test_unknown_model_is_404_model_not_found_everywhere(client, server):
    calls = [lambda: client.completions.create(model="nope", prompt="Nel", max_tokens=2),
             lambda: client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2),
             lambda: client.responses.create(model="nope", input="Nel", max_output_tokens=2),
             lambda: client.models.retrieve("nope")]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.status_code == 404 and err.value.code == "model_not_found"
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    assert [m.id for m in client.models.list()] == ["tiny-chat"]
    assert client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=1).model == "tiny-chat"
    unversioned = httpx.post(server.url + "/chat/completions", json={"messages": MESSAGES, "max_tokens": 1},
                             timeout=60)
    assert unversioned.status_code == 200 and unversioned.json()["object"] == "chat.completion"


def test_too_long_prompts_are_context_length_exceeded(client):
    long_ids = list(range(5, 205)) * 6   # 1200 ids > 1024
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=long_ids, max_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    long_text = [{"role": "user", "content": "Nel mezzo del cammin " * 400}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-chat", messages=long_text, max_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny-chat", input="Nel mezzo del cammin " * 400, max_output_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.param == "input"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=list(range(5, 105)), max_tokens=1000)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"


def test_api_keys_bad_missing_and_good(loaded):
    srv = start(loaded, api_keys=KEYS)
    try:
        for key in ("sk-wrong", "sk-one-but-longer", "sk-on"):
            bad = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError) as err:
                bad.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=1)
            assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
            assert err.value.body["type"] == "authentication_error"
            assert key not in err.value.body["message"]   # the key sent is never echoed
        missing = httpx.post(srv.url + "/v1/completions", json={"prompt": "Nel", "max_tokens": 1}, timeout=60)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert "Missing API key" in missing.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/models", timeout=60).status_code == 401
        for key in KEYS:
            good = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
            assert good.completions.create(model="tiny-chat", prompt="Nel", max_tokens=1).choices
        anthropic_style = httpx.get(srv.url + "/v1/models", headers={"x-api-key": "sk-two"}, timeout=60)
        assert anthropic_style.status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(srv.url + path, timeout=60).status_code == 200, path
        assert 'dantinox_requests_rejected_total{reason="unauthorized"}' in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    closed = start(loaded, api_keys=KEYS, api_key_all=True)
    try:
        assert httpx.get(closed.url + "/health", timeout=60).status_code == 401
        assert httpx.get(closed.url + "/health", headers={"authorization": "Bearer sk-one"}).status_code == 200
    finally:
        closed.stop()


def test_api_key_sources_comparison_and_exposure_warning():
    assert parse_api_keys(["a", "b", "a"], {}) == ("a", "b")
    assert parse_api_keys(None, {"DANTINOX_API_KEY": "x, y"}) == ("x", "y")
    assert parse_api_keys(["f"], {"DANTINOX_API_KEY": "x"}) == ("f",)
    assert parse_api_keys(None, {}) == ()
    with pytest.raises(ValueError, match="DANTINOX_API_KEY: an API key is empty"):
        parse_api_keys(None, {"DANTINOX_API_KEY": "x,,y"})
    with pytest.raises(ValueError, match="--api-key: an API key is empty"):
        parse_api_keys([""], {})
    assert key_matches("b", ("a", "b")) and not key_matches("bb", ("a", "b")) and not key_matches("", ("a",))
    assert exposure_warning("0.0.0.0", ()) is not None and "--api-key" in exposure_warning("0.0.0.0", ())
    assert exposure_warning("0.0.0.0", ("k",)) is None
    for host in ("127.0.0.1", "::1", "[::1]", "localhost"):
        assert exposure_warning(host, ()) is None, host


def test_fields_the_server_does_not_read_are_named_or_refused(server, loaded):
    body = {"messages": MESSAGES, "max_tokens": 2, "regex": "[0-9]+"}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.headers["x-ignored-fields"] == "regex"
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "Nel", "max_tokens": 1}, timeout=60)
    assert "x-ignored-fields" not in plain.headers
    strict = start(loaded, strict_fields=True)
    try:
        refused = httpx.post(strict.url + "/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "regex" and refused.json()["error"]["code"] == "unknown_field"
        ok = httpx.post(strict.url + "/v1/chat/completions", timeout=60,
                        json={"messages": MESSAGES, "max_tokens": 2, "guided_regex": "[0-9]+"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"].isdigit()
    finally:
        strict.stop()


def test_logit_bias_bans_and_forces_tokens_on_both_endpoints(client, loaded):
    """logit_bias (OpenAI's map of token id to a bias in [-100, 100]): -100 on the greedy continuation's tokens
    keeps them out of the answer, +100 on one token makes every sampled token that one; plain and streamed."""
    model, tokenizer, _ = loaded
    prompt = tokenizer.encode("Nel mezzo del cammin")
    free = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6, temperature=0)
    free_ids = tokenizer.encode(free.choices[0].text)
    banned = {str(t): -100 for t in set(free_ids)}
    biased = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6, temperature=0,
                                       logit_bias=banned, logprobs=1)
    assert not set(biased.choices[0].logprobs.tokens) & {tokenizer.decode([t]) for t in free_ids}
    forced = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=5, temperature=0.9,
                                            seed=3, logit_bias={str(prompt[0]): 100})
    assert tokenizer.encode(forced.choices[0].message.content) == [prompt[0]] * 5
    stream = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                       logit_bias={str(prompt[1]): 100})
    assert "".join(chunk.choices[0].text for chunk in stream) == tokenizer.decode([prompt[1]] * 4)


@pytest.mark.parametrize("bias, message", [({"x": 1}, "logit_bias key 'x'"), ({"5": 101}, "logit_bias\\[5\\]=101"),
                                           ({"999999": 1}, "logit_bias token 999999")])
def test_bad_logit_bias_is_a_400_naming_the_field(server, bias, message):
    answer = httpx.post(server.url + "/v1/completions", json={"model": "tiny-chat", "prompt": "Nel", "max_tokens": 2,
                                                              "logit_bias": bias}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "logit_bias", answer.text
    assert __import__("re").search(message, answer.json()["error"]["message"]), answer.text
