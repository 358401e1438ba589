"""OpenAI tool calling (issue 21): the tool definitions rendered through a Hermes-style chat template, tool
results as ``role: tool`` messages, the Hermes and Llama 3 JSON parsers, "required" and named functions forced
by a grammar (arguments always valid for the tool's schema, checked with ``jsonschema``), streamed tool_calls
deltas equal to the whole answer, and 400s: a template without tool support, an unknown function, bad
definitions, special-token text in tools."""

import json

import httpx
import jsonschema
import openai
import pytest
from chat_util import CHATML, save_tiny_chat_run

from dantinox.runs.chat import load_chat_format
from dantinox.runs.chat_template import ChatTemplate
from dantinox.runs.run_dir import load_run
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.request import RequestError
from dantinox.serving.server import ServerThread, create_app
from dantinox.serving.tool_calls import HermesParser, Llama3JsonParser, parse_tool_request, parser_for
from dantinox.serving.tool_chat import CallStream, ToolAnswer

# A small Hermes / Qwen style template: the tools in a system turn (by name only, to keep the prompt within the
# tiny model's context), assistant tool calls in <tool_call> tags, tool results as <tool_response> in a user turn.
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "</tools> <tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Firenze", "Roma"]}, "unit": {"enum": ["C", "F"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "Che tempo fa a Firenze?"}]


def serve(run_dir):
    model, _, tok, _ = load_run(run_dir)
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=300, max_running=4, max_batched_tokens=32,
                                             decode_buckets=(1, 4), prefill_buckets=(1, 4), chunk_buckets=(8, 32)))
    return ServerThread(create_app(engine, tok, "tiny-tools", load_chat_format(run_dir, tok))).start()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    return {"hermes": save_tiny_chat_run(root / "hermes", template=HERMES, max_context=256),
            "plain": save_tiny_chat_run(root / "plain", template=CHATML, max_context=256)}


@pytest.fixture(scope="module")
def server(runs):
    srv = serve(runs["hermes"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_are_valid(client):
    for seed in range(4):  # one call each (a random model rarely closes an open-ended array of calls)
        done = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, seed=seed,
                                              tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                              max_tokens=120)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1
    several = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                             tool_choice="required", seed=4, max_tokens=150).choices[0]
    if several.finish_reason == "tool_calls":  # parallel calls: a JSON array of 1 or more, each valid
        check_calls(several.message.tool_calls)
    else:
        assert several.finish_reason == "length" and several.message.content.startswith('[{"name": "')
    named = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           seed=5, max_tokens=60)
    check_calls(named.choices[0].message.tool_calls, names=("get_time",))


def test_streamed_tool_calls_equal_the_whole_answer(client):
    kwargs = dict(model="tiny-tools", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
                  seed=7, max_tokens=120, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, reasons, pieces = {}, [], 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": "", "id": None})
            assert (part.id is None) == (entry["id"] is not None)  # the id and name come once, first
            entry["id"] = part.id or entry["id"]
            entry["name"] += (part.function.name or "") if part.function else ""
            entry["arguments"] += (part.function.arguments or "") if part.function else ""
            pieces += bool(part.function and part.function.arguments)
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]  # same seed: the same text
    assert pieces > len(calls)  # the arguments came in pieces as they were generated, not whole at the end
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_renders_tools_and_a_tool_result_round_trip(client, runs):
    model, _, tok, _ = load_run(runs["hermes"])
    chat = load_chat_format(runs["hermes"], tok)
    with_tools = len(chat.prompt_ids(MESSAGES, tok, tools=TOOLS))
    done = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, temperature=0,
                                          max_tokens=8)
    assert done.usage.prompt_tokens == with_tools > len(chat.prompt_ids(MESSAGES, tok))
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    call = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=120)
    made = call.choices[0].message.tool_calls[0]
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
                          {"role": "tool", "tool_call_id": made.id, "content": "18 gradi, sereno"}]
    rendered = chat.template.render(history, tools=TOOLS)
    assert f'<tool_call>\n{{"name": "{made.function.name}", "arguments": ' in rendered
    assert "<tool_response>\n18 gradi, sereno\n</tool_response>" in rendered
    answer = client.chat.completions.create(model="tiny-tools", messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=6)
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)


def test_template_without_tools_runs_auto_with_the_generic_prompt_and_forces_required(runs):
    srv = serve(runs["plain"])
    try:
        url = srv.url + "/v1/chat/completions"
        r = httpx.post(url, json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}, timeout=60)
        # "auto" renders the generic tool prompt into the messages, which this 256-token context cannot hold
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(url, json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120,
                                  "temperature": 1.0, "seed": 2, "parallel_tool_calls": False}, timeout=60)
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    finally:
        srv.stop()


@pytest.mark.parametrize("extra, field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_answer_400_naming_the_field(server, extra, field):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_hermes_parser():
    parser = HermesParser()
    text = ('Vediamo.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Roma", "unit": "C"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>')
    content, calls = parser.parse(text)
    assert content == "Vediamo.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Roma", "unit": "C"}), ("get_time", {"zone": 1})]
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert parser.content_end("ciao <tool_", final=False) == len("ciao ")
    assert parser.content_end("ciao <tool_call>{", final=False) == len("ciao ")
    assert parser.content_end("ciao <", final=True) == len("ciao <")


def test_llama3_json_parser():
    parser = Llama3JsonParser()
    content, calls = parser.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}; '
                                  '{"name": "get_weather", "parameters": {"city": "Roma", "unit": "F"}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Roma", "unit": "F"}
    assert parser.parse("Fa bel tempo.") == ("Fa bel tempo.", [])
    assert parser.parse('{"name": "x"} trailing') == ('{"name": "x"} trailing', [])
    assert parser.content_end(" {", final=False) == 0 and parser.content_end("Fa", final=False) == 2


def test_parser_choice_template_support_and_request_checks():
    assert isinstance(parser_for(HERMES), HermesParser)
    assert isinstance(parser_for("{{ '<|python_tag|>' }}"), Llama3JsonParser)
    assert parser_for(CHATML) is None and isinstance(parser_for(CHATML, "llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="one of"):
        parser_for(CHATML, "mistral")
    assert ChatTemplate(HERMES).supports_tools and not ChatTemplate(CHATML).supports_tools
    tools = parse_tool_request({"tools": TOOLS})
    assert tools.choice == "auto" and tools.parallel and tools.names == ["get_weather", "get_time"]
    assert parse_tool_request({"tools": [], "tool_choice": "none"}) is None
    with pytest.raises(RequestError) as err:
        parse_tool_request({"tools": TOOLS + TOOLS[:1]})
    assert err.value.field == "tools"


def stream_by_characters(answer, text, finish_reason="stop"):
    """(content, [(id, name, arguments)], number of argument pieces) of ``text`` fed to a CallStream one
    character at a time, as the OpenAI client's stream helper would add the deltas up."""
    stream, content, calls, pieces = CallStream(answer), "", {}, 0
    for i, ch in enumerate(text):
        for delta in stream.feed(ch, finish_reason if i == len(text) - 1 else None):
            content += delta.get("content", "")
            for part in delta.get("tool_calls", []):
                entry = calls.setdefault(part["index"], ["", "", ""])
                if "id" in part:
                    assert entry == ["", "", ""]  # the head comes first and once
                    entry[0], entry[1] = part["id"], part["function"]["name"]
                else:
                    pieces += 1
                entry[2] += part["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)], pieces, stream.called


@pytest.mark.parametrize("choice, parser, text, want_content, want", [
    ("auto", HermesParser(), 'Vediamo.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Roma", '
     '"unit": "C"}}\n</tool_call><tool_call>{"arguments": {"zone": -3}, "name": "get_time"}</tool_call>',
     "Vediamo.\n", [("get_weather", '{"city": "Roma", "unit": "C"}'), ("get_time", '{"zone": -3}')]),
    ("auto", Llama3JsonParser(), '<|python_tag|>{"name": "get_time", "parameters": {"zone": 12}}; {"name": '
     '"get_weather", "parameters": {"unit": "F", "city": "Roma"}}', "",
     [("get_time", '{"zone": 12}'), ("get_weather", '{"unit": "F", "city": "Roma"}')]),
    ("required", None, '[{"name": "get_weather", "parameters": {"city": "Firenze", "unit": "C"}}, {"name": '
     '"get_time", "parameters": {"zone": 0}}]', "",
     [("get_weather", '{"city": "Firenze", "unit": "C"}'), ("get_time", '{"zone": 0}')]),
    ("get_time", None, '{"zone": 14}', "", [("get_time", '{"zone": 14}')]),
])
def test_streamed_deltas_add_up_to_the_parsed_calls(choice, parser, text, want_content, want):
    answer = ToolAnswer(parse_tool_request({"tools": TOOLS, "tool_choice": choice if choice in ("auto", "required")
                                            else {"type": "function", "function": {"name": choice}}}), parser)
    content, calls, pieces, called = stream_by_characters(answer, text)
    assert called and content == want_content
    assert [(name, args) for _, name, args in calls] == want  # the raw argument text, exactly
    assert all(i.startswith("call_") for i, _, _ in calls) and len({i for i, _, _ in calls}) == len(calls)
    assert pieces > len(want)  # pieces as the text comes (arguments written before the name come at once)
    whole, parsed = answer.calls(text, "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed] == want
    for _, name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_streamed_content_without_calls_and_a_cut_call():
    auto = ToolAnswer(parse_tool_request({"tools": TOOLS}), HermesParser())
    assert stream_by_characters(auto, "Fa bel tempo <tool") == ("Fa bel tempo <tool", [], 0, False)
    forced = ToolAnswer(parse_tool_request({"tools": TOOLS, "tool_choice": "required"}), None)
    content, calls, _, called = stream_by_characters(forced, '[{"name": "get_time", "parameters": {"zo', "length")
    assert content == "" and not called  # the part already streamed stays: OpenAI's finish_reason "length"
    assert calls[0][1:] == ("get_time", '{"zo')
    assert forced.message('[{"name": "get_time", "parameters": {"zo', "length") == (
        {"role": "assistant", "content": '[{"name": "get_time", "parameters": {"zo'}, "length")


def test_partial_json_spans_against_json_loads():
    from dantinox.serving.partial_json import scan_objects
    calls = [{"name": "f.x", "parameters": {"s": "a\"}{,]", "n": [1, {"k": None}], "e": "\u00e8\\"}},
             {"parameters": {}, "name": "g"}]
    text = "[" + ", ".join(json.dumps(c, ensure_ascii=False) for c in calls) + "]"
    final = scan_objects(text, 1)
    assert [json.loads(o.raw(text, "parameters")) for o in final] == [c["parameters"] for c in calls]
    assert [json.loads(o.raw(text, "name")) for o in final] == ["f.x", "g"] and all(o.closed for o in final)
    for cut in range(1, len(text)):  # every prefix: each span so far is a prefix of its final text
        for obj, whole in zip(scan_objects(text[:cut], 1), final):
            for key in obj.fields:
                assert whole.raw(text, key).startswith(obj.raw(text[:cut], key))
                assert obj.done(key) == (whole.fields[key][1] <= cut)
    assert scan_objects('{"a" 1}')[0].broken and scan_objects('{1: 2}')[0].broken
