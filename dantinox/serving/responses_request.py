"""A ``POST /v1/responses`` body (OpenAI's Responses API) read as the chat request it stands for.

The Responses API is served on the chat path (``dantinox.serving.responses_endpoint``): its body becomes a
``ChatCompletionRequest`` with these correspondences (OpenAI API reference, "Responses: create"):

  input                 a string (one user message), or a list of items: messages {"role": "user" |
                        "assistant" | "system" | "developer", "content": a string or a list of "input_text" /
                        "output_text" parts} (with or without "type": "message"), "function_call" items
                        {call_id, name, arguments} (an assistant turn's tool_calls) and "function_call_output"
                        items {call_id, output} (role "tool" messages)
  instructions          a system message put first (not carried to later responses, as OpenAI documents)
  previous_response_id  the earlier response's conversation (its input and output items) before ``input``
  max_output_tokens     max_completion_tokens
  temperature, top_p    the same; top_k (an extension), seed (an extension)
  tools                 function tools {"type": "function", "name", "description", "parameters"} become chat
                        tools; tool_choice "auto" / "none" / "required" / {"type": "function", "name"}
  parallel_tool_calls   the same
  text.format           {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema"}
                        -> response_format
  stream, metadata, user, store, truncation ("disabled"), include ([] only), reasoning (null only)

Anything else the API defines and this server does not do answers 400 naming the field (``UNSUPPORTED``: a
non-function tool, an image or file input, background mode, a conversation object, ...); fields no part of the
server reads are ignored and named, as on the other endpoints (``SamplingRequest.ignored_fields``).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from .request import RequestError

# Responses API fields this server does not implement -> the values that change nothing
UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,), "include": (None, []),
               "reasoning": (None,), "max_tool_calls": (None,), "top_logprobs": (None, 0),
               "truncation": (None, "disabled"), "service_tier": (None, "auto", "default"),
               "prompt_cache_key": (None,), "safety_identifier": (None,)}
# fields read here (beyond the typed ones below) or by the chat path
READ = frozenset({"tools", "tool_choice", "parallel_tool_calls", "text", "metadata", "user", "store"})
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The typed fields of a Responses API body; the rest are kept (``model_extra``)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    input: StrictStr | list
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stream: StrictBool = False

    def check_supported(self) -> None:
        """Raise RequestError naming the first field this server does not implement (see UNSUPPORTED)."""
        extra = self.model_extra or {}
        for name, no_op in UNSUPPORTED.items():
            value = extra.get(name)
            if value is not None and not any(value == v and type(value) is type(v) for v in no_op):
                raise RequestError(name, f"{name}={value!r} is not supported by this server (the Responses API "
                                   "here serves text and function tools)")

    def ignored_fields(self, checked=()) -> list[str]:
        """Sorted names of the fields no part of the server reads (``checked``: more names that are read)."""
        return sorted(set(self.model_extra or {}) - READ - set(UNSUPPORTED) - set(checked))


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages of ``input`` (without instructions or an earlier response). Raises RequestError
    naming ``input[i]...`` for an item or a content part this server does not read."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(where, f"{where} must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)   # several calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output, ensure_ascii=False)
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": output})
        else:
            raise RequestError(f"{where}.type", f"{where}.type={kind!r} is not supported by this server: "
                               "'message', 'function_call' or 'function_call_output'")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise RequestError(f"{where}.role", f"{where}.role={role!r} is not allowed: 'user', 'assistant', "
                           "'system' or 'developer'")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{j}]", f"{where}.content[{j}] of type {kind!r} is not "
                                   "supported by this server: text parts only ('input_text', 'output_text')")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key}", f"{where}.{key} must be a string; got {value!r}")
    return value


def chat_tools(extra: dict) -> dict:
    """The chat fields (tools, tool_choice, parallel_tool_calls, response_format) of a Responses body's tools,
    tool_choice and text.format. Raises RequestError naming the field for a non-function tool or format."""
    out: dict = {}
    tools = extra.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise RequestError("tools", "tools must be a list of function tools")
        out["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = extra.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice", f"tool_choice={choice!r} is not supported: 'auto', 'none', "
                               "'required' or {'type': 'function', 'name': ...}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if extra.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = extra["parallel_tool_calls"]
    fmt = (extra.get("text") or {}).get("format") if isinstance(extra.get("text"), dict) else None
    if fmt is not None:
        out.update(_response_format(fmt))
    return out


def _chat_tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise RequestError(f"{where}.type", f"{where}: a tool of type {kind!r} is not supported by this server: "
                           "function tools only")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _response_format(fmt) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise RequestError("text.format", f"text.format={fmt!r} is not supported: type 'text', 'json_object' or "
                       "'json_schema'")
