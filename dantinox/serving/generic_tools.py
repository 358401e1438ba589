"""The generic tool prompt: tool calling ("auto") for a model whose chat template cannot show tools.

A template that does not read the ``tools`` variable (SmolLM2's, the bundled model's, most base chat
templates) gives the model no way to see the tools. For such a template a request with tools and
tool_choice "auto" gets the tools through the conversation itself, as llama-server does with its generic
format (the wording and the syntax here are this server's own):

  1. A system text lists the tools and the call syntax, GENERIC_INSTRUCTIONS with each tool's definition as
     one line of JSON ({"name", "description", "parameters"}). It is appended to the first message when that
     is a system message with text content, else it is a new first system message.
  2. The call syntax is the Hermes one, which ``tool_calls.HermesParser`` reads:
     ``<tool_call>{"name": "<function>", "arguments": {...}}</tool_call>``, one block per call, after any text.
  3. Earlier turns are written in the same syntax, so the template needs no tool support: an assistant
     message's ``tool_calls`` become such blocks after its content, and each run of ``role: tool`` messages
     becomes one user message of ``<tool_response>{"tool_call_id", "name", "content"}</tool_response>``
     blocks (a template that only knows system / user / assistant renders it).
The answer's ``X-Tool-Format`` header (and the non-streamed body's ``tool_format`` field) then says
"generic". The model must follow the instructions: a small model often answers in plain text instead, which
is returned as content (finish_reason "stop"), as with any "auto" answer without a call.
"""

from __future__ import annotations

import json

GENERIC_INSTRUCTIONS = (
    "You can call the following tools (functions). Each line is one tool's definition in JSON:\n"
    "{tools}\n\n"
    "To call a tool, write one block per call, exactly in this form, and nothing after the last block:\n"
    '<tool_call>{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}</tool_call>\n'
    "The result of each call comes back in a <tool_response> block. "
    "When no tool is needed, answer in plain text.")


def generic_tool_prompt(tools) -> str:
    """The system text that shows ``tools`` (checked OpenAI definitions, ``tool_calls.ToolRequest.tools``)
    and the call syntax to the model."""
    lines = []
    for tool in tools:
        fn = tool["function"]
        entry = {"name": fn["name"], "description": fn.get("description", ""), "parameters": fn["parameters"]}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return GENERIC_INSTRUCTIONS.format(tools="\n".join(lines))


def with_generic_tools(messages: list, tools) -> list:
    """``messages`` rewritten for a template without tool support (see the module docstring): the generic
    tool prompt in the system message, earlier calls and results as text. Messages that are not dicts are
    left in place for the template's own checks to name."""
    prompt = generic_tool_prompt(tools)
    out = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)
        elif message.get("role") == "tool":
            block = _response_block(message)
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif message.get("role") == "assistant" and message.get("tool_calls"):
            out.append({"role": "assistant", "content": _calls_text(message)})
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} if isinstance(m, dict) else m for m in out]
    first = out[0] if out else None
    if isinstance(first, dict) and first.get("role") == "system" and isinstance(first.get("content"), str):
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}] + out[1:]
    return [{"role": "system", "content": prompt}] + out


def _calls_text(message: dict) -> str:
    """An assistant message's content followed by its tool calls in the generic syntax."""
    blocks = []
    for call in message["tool_calls"]:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = fn.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass  # kept as the string the client sent
        blocks.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": arguments},
                                                 ensure_ascii=False) + "</tool_call>")
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    return (text + "\n" if text else "") + "\n".join(blocks)


def _response_block(message: dict) -> str:
    """One tool result as a <tool_response> block."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text joined
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    body = {"tool_call_id": message.get("tool_call_id"), "name": message.get("name"), "content": content}
    return "<tool_response>" + json.dumps({k: v for k, v in body.items() if v is not None},
                                          ensure_ascii=False) + "</tool_response>"
