"""Tool calls in a chat completion: what the prompt gets (the rendered tools), and how each choice's text
becomes the answer, whole or streamed (``dantinox.serving.tool_calls`` has the parsing and the grammar).

``prepare_tools`` decides, for one request, the tool definitions the template renders, the constraint that
forces a call ("required" or a named function) and the ``ToolAnswer`` that turns a choice's text into an
assistant message: {"role": "assistant", "content": text before the calls or None, "tool_calls": [...]} with
finish_reason "tool_calls" when calls were found, else the plain content with the engine's finish reason.
``tool_events`` is the streamed form (``chat.completion.chunk`` events), as the OpenAI API sends it: content
deltas as the text comes, holding back text that is or may become a call; for each call, once its name is
written, a ``tool_calls`` delta with its index, id, type and name (arguments ""), then ``tool_calls`` deltas
with the pieces of its arguments text as they are generated (index and arguments only); then the finish chunk
("tool_calls" when the finished answer holds calls). The pieces add up to the whole answer's arguments (the
model's raw text, ``tool_calls``). An answer cut by max_tokens ("length") is returned whole as content, since a
partial call is not a call; streamed, the call's text is sent as far as it was written and the finish_reason
is "length" (OpenAI's behaviour). Likewise a streamed call that turns out malformed when an "auto" answer
ends stays sent (finish_reason "stop"), and the held-back text is not sent again as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..generation.grammar import grammar_vocabulary
from .request import RequestError
from .generic_tools import with_generic_tools
from .tool_calls import (HermesParser, PartialCall, ToolParser, ToolRequest, check_no_special_text, new_call_id,
                         parse_forced, parser_for, partial_forced, tool_constraint)


@dataclass
class ToolAnswer:
    """How a choice's text becomes the answer: tools (the request's), parser (None when a grammar forced the
    call), format: the tool format that ran, told to the client in the X-Tool-Format header: "hermes" or
    "llama3_json" (the template rendered the tools; the parser of that name reads the calls), "generic" (the
    generic tool prompt, ``generic_tools``, read by the hermes parser) or "grammar" (tool_choice "required"
    or a named function: a grammar forced the call)."""

    tools: ToolRequest
    parser: ToolParser | None
    format: str = "grammar"

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

    def partial(self, text: str) -> list[PartialCall]:
        """The calls the text so far shows (for streaming)."""
        return partial_forced(text, self.tools) if self.parser is None else self.parser.partial(text)

    def content_end(self, text: str, final: bool) -> int:
        """Characters of the text so far that can be streamed as content now."""
        if self.parser is None:
            return len(text) if final else 0
        return self.parser.content_end(text, final)


def prepare_tools(tools: ToolRequest | None, chat_format, service, messages, tool_parser: str | None):
    """(messages to render, tool definitions to render or None, the forcing Constraint or None, ToolAnswer or
    None) for a chat request. "auto" on a template that cannot render tools gets the generic tool prompt
    (``generic_tools``): the messages carry the tools and the call syntax. Raises RequestError naming the
    field: a template that renders tools in a syntax not recognized and no parser named, special-token text in
    tools or tool calls, parameters that are not a usable schema."""
    if tools is None or tools.choice == "none":
        return messages, None, None, None
    special = [service.tokenizer.hf.id_to_token(i) for i in service.tokenizer.special_ids]
    check_no_special_text(tools, messages, special)
    template = chat_format.template
    rendered = [dict(t) for t in tools.tools] if template.supports_tools else None
    if tools.forced:
        vocabulary = grammar_vocabulary(service.tokenizer, service.stop_ids)
        return messages, rendered, tool_constraint(tools, vocabulary), ToolAnswer(tools, None, "grammar")
    if rendered is None:
        generic = with_generic_tools(messages, tools.tools)   # its syntax is hermes', whatever --tool-call-parser
        return generic, None, None, ToolAnswer(tools, HermesParser(), "generic")
    parser = parser_for(template.source, tool_parser)
    if parser is None:
        raise RequestError("tools", f"the tool-call syntax of model {service.model_name!r} is not recognized from "
                           "its chat template: start the server with --tool-call-parser hermes or llama3_json, or "
                           "send tool_choice 'required' or a named function")
    return messages, rendered, None, ToolAnswer(tools, parser, parser.name)


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
    streams = {c.index: CallStream(session.tool_answer) for c in session.choices}
    for choice in session.choices:
        yield session._chunk(choice.index, {"role": "assistant", "content": ""}, None)
    async for choice, text in session.pieces(request):
        i = choice.index
        if choice.done and choice.finish_reason == "error":
            yield _event({"error": {"message": choice.error or "generation failed", "type": "server_error",
                                    "param": None, "code": None}})
            continue
        for delta in streams[i].feed(text, choice.finish_reason if choice.done else None):
            yield session._chunk(i, delta, None)
        if choice.done:
            yield session._chunk(i, {}, "tool_calls" if streams[i].called else choice.finish_reason)
    if session.body.include_usage():
        yield _event(session._object("chat.completion.chunk", [], session._usage()))
    yield "data: [DONE]\n\n"


class CallStream:
    """One choice's streamed answer with tools: its text so far, the content characters sent, and per call
    streamed its id and the characters of its arguments sent (see the module docstring)."""

    def __init__(self, answer: ToolAnswer):
        self.answer, self.text, self.sent = answer, "", 0
        self.ids: list[str] = []
        self.args_sent: list[str] = []
        self.called = False  # the finished answer holds calls

    def feed(self, piece: str, finish_reason: str | None) -> list[dict]:
        """The deltas to send after ``piece`` (finish_reason: None while the choice goes on, else its reason)."""
        self.text += piece
        if finish_reason is None:
            partial, end = self.answer.partial(self.text), self.answer.content_end(self.text, final=False)
        else:
            content, calls = self.answer.calls(self.text, finish_reason)
            self.called = bool(calls)
            partial = [PartialCall(c["function"]["name"], c["function"]["arguments"], True) for c in calls]
            if calls:
                end = len(content or "")
            elif self.ids:  # a call already streamed, then cut (or malformed): its last piece, no content
                partial, end = self.answer.partial(self.text), self.sent
            else:  # no call after all: the held-back text is content
                end = self.answer.content_end(self.text, final=True)
        deltas = []
        if end > self.sent:
            deltas.append({"content": self.text[self.sent:end]})
            self.sent = end
        return deltas + self._call_deltas(partial)

    def _call_deltas(self, partial: list[PartialCall]) -> list[dict]:
        """A head delta (index, id, type, name, arguments "") when a call's name is known, then each new piece
        of its arguments text."""
        deltas = []
        for k, call in enumerate(partial):
            if k == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_call_id())
                self.args_sent.append("")
                deltas.append({"tool_calls": [{"index": k, "id": self.ids[k], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            args, sent = call.arguments or "", self.args_sent[k]
            if len(args) > len(sent) and args.startswith(sent):
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": args[len(sent):]}}]})
                self.args_sent[k] = args
        return deltas


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
