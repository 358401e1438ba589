"""Tool calls in a chat completion: what the prompt gets (the rendered tools), and how each choice's text
becomes the answer, whole or streamed (``dantinox.serving.tool_calls`` has the parsing and the grammar).

``prepare_tools`` decides, for one request, the tool definitions the template renders, the constraint that
forces a call ("required" or a named function) and the ``ToolAnswer`` that turns a choice's text into an
assistant message: {"role": "assistant", "content": text before the calls or None, "tool_calls": [...]} with
finish_reason "tool_calls" when calls were found, else the plain content with the engine's finish reason.
``tool_events`` is the streamed form (``chat.completion.chunk`` events): content deltas as the text comes,
holding back text that is or may become a call; once a choice ends, one ``tool_calls`` delta per call with its
index, id, type and name (arguments ""), then one with its whole arguments text, then the finish chunk. An
answer cut by max_tokens ("length") is returned as content: a partial call is not a call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..generation.grammar import grammar_vocabulary
from .request import RequestError
from .tool_calls import ToolParser, ToolRequest, check_no_special_text, parse_forced, parser_for, tool_constraint


@dataclass
class ToolAnswer:
    """How a choice's text becomes the answer: tools (the request's), parser (None when a grammar forced the
    call)."""

    tools: ToolRequest
    parser: ToolParser | None

    def calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict]]:
        """(content, calls) of a finished choice's text."""
        if finish_reason != "stop":
            return text, []
        if self.parser is None:
            calls = parse_forced(text, self.tools)
            return (None, calls) if calls else (text, [])
        return self.parser.parse(text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, finish_reason) of a finished choice."""
        content, calls = self.calls(text, finish_reason)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def content_end(self, text: str, final: bool) -> int:
        """Characters of the text so far that can be streamed as content now."""
        if self.parser is None:
            return len(text) if final else 0
        return self.parser.content_end(text, final)


def prepare_tools(tools: ToolRequest | None, chat_format, service, messages, tool_parser: str | None):
    """(tool definitions to render or None, the forcing Constraint or None, ToolAnswer or None) for a chat
    request. Raises RequestError naming the field: tools for a template that cannot render them ("auto"),
    a template whose tool-call syntax is unknown and no parser named, special-token text in tools or tool
    calls, parameters that are not a usable schema."""
    if tools is None or tools.choice == "none":
        return None, None, None
    special = [service.tokenizer.hf.id_to_token(i) for i in service.tokenizer.special_ids]
    check_no_special_text(tools, messages, special)
    template = chat_format.template
    rendered = [dict(t) for t in tools.tools] if template.supports_tools else None
    if tools.forced:
        vocabulary = grammar_vocabulary(service.tokenizer, service.stop_ids)
        return rendered, tool_constraint(tools, vocabulary), ToolAnswer(tools, None)
    if rendered is None:
        raise RequestError("tools", f"model {service.model_name!r} has a chat template that does not render tools, "
                           "so it cannot choose to call one: send tool_choice 'required' or a named function "
                           "(a grammar then forces the call), or no tools")
    parser = parser_for(template.source, tool_parser)
    if parser is None:
        raise RequestError("tools", f"the tool-call syntax of model {service.model_name!r} is not recognized from "
                           "its chat template: start the server with --tool-call-parser hermes or llama3_json, or "
                           "send tool_choice 'required' or a named function")
    return rendered, None, ToolAnswer(tools, parser)


async def tool_events(session, request):
    """Server-sent events of a chat completion with tools (see the module docstring). ``session``: the
    ``_ChatCompletion`` (its choices, ``pieces``, ``_chunk``, ``_object``, ``tool_answer``)."""
    try:
        async for event in _tool_events(session, request):
            yield event
    finally:
        if not session.done:  # the client disconnected mid-stream
            session._abort()


async def _tool_events(session, request):
    answer: ToolAnswer = session.tool_answer
    texts = {c.index: "" for c in session.choices}
    sent = dict.fromkeys(texts, 0)
    for choice in session.choices:
        yield session._chunk(choice.index, {"role": "assistant", "content": ""}, None)
    async for choice, text in session.pieces(request):
        i = choice.index
        texts[i] += text
        if choice.done and choice.finish_reason == "error":
            yield _event({"error": {"message": choice.error or "generation failed", "type": "server_error",
                                    "param": None, "code": None}})
            continue
        content, calls = answer.calls(texts[i], choice.finish_reason) if choice.done else (None, [])
        end = answer.content_end(texts[i], final=choice.done)
        if calls:  # the text after the content is the calls
            end = max(sent[i], len(content or ""))
        if end > sent[i]:
            yield session._chunk(i, {"content": texts[i][sent[i]:end]}, None)
            sent[i] = end
        if not choice.done:
            continue
        for k, call in enumerate(calls):
            head = {"index": k, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            yield session._chunk(i, {"tool_calls": [head]}, None)
            yield session._chunk(i, {"tool_calls": [{"index": k, "function": {
                "arguments": call["function"]["arguments"]}}]}, None)
        yield session._chunk(i, {}, "tool_calls" if calls else choice.finish_reason)
    if session.body.include_usage():
        yield _event(session._object("chat.completion.chunk", [], session._usage()))
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
