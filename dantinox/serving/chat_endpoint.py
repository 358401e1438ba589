"""OpenAI ``POST /v1/chat/completions`` for a model with a chat template.

The conversation (``messages``) is rendered with the model's template (``dantinox.runs.chat``), encoded, and run
through the same worker, engine and per-choice text pipeline as ``/v1/completions`` (``dantinox.serving.
completions``): stop strings, n choices with seeds seed + i, streaming, client disconnects. What differs:
  - the conversation is encoded so that text in a message that looks like a special token stays text, and only
    the template's own markup yields control ids (``ChatFormat.prompt_ids``, case K12);
  - the answer is ``choices[i].message = {"role": "assistant", "content": text}``; streamed chunks are
    ``chat.completion.chunk`` objects whose ``delta`` holds the role first, then content pieces, and a last
    chunk per choice with an empty delta and the finish_reason;
  - max_completion_tokens (or the older max_tokens; the former wins) defaults to what is left of the context.
Like a completion, each choice stops at the model's stop ids (counted in usage, not shown; finish_reason
"stop"), unless the request sets ignore_eos. Supported fields: model, messages, max_tokens,
max_completion_tokens, temperature (default 1.0), top_p, top_k (an extension), seed, stop, stream,
stream_options.include_usage, n, ignore_eos (vLLM's extension), user (ignored), logprobs and top_logprobs
(0..MAX_LOGPROBS), the structured-output fields (response_format, structured_outputs, guided_*:
``dantinox.serving.structured_request``), tools, tool_choice and parallel_tool_calls (``dantinox.serving.
tool_calls``, ``tool_chat``; "auto" on a template without tools: ``generic_tools``), with ``role: tool``
messages and assistant messages that carry ``tool_calls``. Fields this server does not implement (penalties,
...) are rejected with 400 naming the field unless they hold their no-op value. logprobs: each choice's
``logprobs`` is {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null} (``protocol.
LogprobsLog``), the same figures as /v1/completions' for the same tokens (the target model's raw
log-probabilities, with speculation too); streamed, each content chunk carries the entries of the tokens
consumed since the previous one (a streamed answer with tools carries none). Usage has
prompt_tokens_details.cached_tokens. A model without a template answers 400 (param "model"), another model
name 404 model_not_found, a message with an unknown role 400 naming
``messages[i].role``. The conversation is rendered and encoded in a worker thread, and a rendered prompt too
long for the context by its characters alone is refused (400 on "messages") before it is encoded
(``dantinox.serving.request_limits``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import StrictBool, StrictInt

from ..runs.chat_template import ChatTemplateError
from .api_errors import check_model, request_error_response
from .completions import _Completion, with_ignored
from .protocol import MAX_CHOICES, MAX_STOP_STRINGS, SamplingRequest, error_body
from .request import MAX_LOGPROBS, RequestError, SamplingOptions
from .request_log import slice_from
from .structured_request import request_constraint
from .tool_calls import parse_tool_request
from .tool_chat import prepare_tools, tool_events

# fields this endpoint does not implement -> the values that change nothing
UNSUPPORTED_CHAT_FIELDS = {"frequency_penalty": (None, 0), "presence_penalty": (None, 0),
                           "functions": (None, []), "audio": (None,), "modalities": (None, ["text"])}


class ChatCompletionRequest(SamplingRequest):
    messages: list
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    def logprob_count(self) -> int | None:
        """top_logprobs alternatives per token (0 when not given) with logprobs true, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        """Raise RequestError naming the field for n, seed, stop, top_logprobs or an unimplemented OpenAI
        field."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise RequestError("n", f"n={self.n} is not allowed: an integer in [1, {MAX_CHOICES}]")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise RequestError("top_logprobs", f"top_logprobs={self.top_logprobs} is not allowed: null or an "
                                   f"integer in [0, {MAX_LOGPROBS}]")
            if not self.logprobs:
                raise RequestError("top_logprobs", "top_logprobs needs logprobs=true")
        for name, no_op in UNSUPPORTED_CHAT_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and not any(_same(value, v) for v in no_op if v is not None):
                raise RequestError(name, f"{name}={value!r} is not supported by this server")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise RequestError("seed", f"seed={self.seed} is not allowed: null or an integer in [0, 2**32)")
        stops = self.stop_strings()
        if len(stops) != len([self.stop] if isinstance(self.stop, str) else list(self.stop or [])):
            raise RequestError("stop", f"stop={self.stop!r} is not allowed: stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"{len(stops)} stop strings given; at most {MAX_STOP_STRINGS}")

    def token_limit(self) -> tuple[str, int | None]:
        """(field name, value) of the completion token limit: max_completion_tokens, else max_tokens."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


def _same(value, no_op) -> bool:
    """value == no_op, where true/false never stand for 1/0."""
    return value == no_op and isinstance(value, bool) == isinstance(no_op, bool)


class _ChatCompletion(_Completion):
    """One accepted chat request of n choices -> a ``chat.completion`` body or ``chat.completion.chunk`` events
    (its choices, as a completion's, hide the stop ids; with logprobs they carry them in the chat format)."""

    chat = True

    def _object(self, kind: str, choices: list, usage: dict | None) -> dict:
        body = {"id": self.cid, "object": kind, "created": int(time.time()), "model": self.service.model_name,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    tool_answer = None  # a tool_chat.ToolAnswer when the request has tools (set by start_chat)
    ignored: list = []  # the request's fields no part of the server reads (the X-Ignored-Fields header)

    def _final_body(self, texts: dict[int, str]) -> dict:
        if self.tool_answer is not None:  # tool calls parsed from the text (tool_chat)
            answers = [self.tool_answer.message(texts[c.index], c.finish_reason) for c in self.choices]
        else:
            answers = [({"role": "assistant", "content": texts[c.index]}, c.finish_reason) for c in self.choices]
        choices = [{"index": c.index, "message": message,
                    "logprobs": None if c.logprobs is None else c.logprobs.body(), "finish_reason": reason}
                   for c, (message, reason) in zip(self.choices, answers)]
        body = self._object("chat.completion", choices, self._usage())
        if self.tool_answer is not None:
            body["tool_format"] = self.tool_answer.format
        return body

    def _chunk(self, index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return _event(self._object("chat.completion.chunk", [choice], None))

    async def sse(self, request: HttpRequest | None = None):
        if self.tool_answer is not None:  # content and tool_calls deltas (tool_chat)
            async for event in tool_events(self, request):
                yield event
            return
        try:
            for choice in self.choices:
                yield self._chunk(choice.index, {"role": "assistant", "content": ""}, None)
            async for choice, text in self.pieces(request):  # with request: disconnects noticed (K10)
                if text:
                    logprobs = None if choice.logprobs is None else choice.logprobs.take()
                    yield self._chunk(choice.index, {"content": text}, None, logprobs)
                if not choice.done:
                    continue
                if choice.finish_reason == "error":
                    yield _event(error_body(choice.error or "generation failed", None, "server_error"))
                else:
                    yield self._chunk(choice.index, {}, choice.finish_reason)
            if self.body.include_usage():
                yield _event(self._object("chat.completion.chunk", [], self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            if not self.done:
                self._abort()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def add_chat_route(app, service, chat_format, tool_parser: str | None = None) -> None:
    """Register ``POST /v1/chat/completions`` on ``app``. service: the app's completions service (worker,
    tokenizer, model name, max_context); chat_format: a ``dantinox.runs.chat.ChatFormat`` or None (then every chat
    request answers 400 naming the reason); tool_parser: the tool-call syntax to read (one of
    ``tool_calls.TOOL_PARSERS``), None: the one the template shows."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HttpRequest):
        return await chat_response(service, chat_format, tool_parser, body, request)


async def chat_response(service, chat_format, tool_parser, body: ChatCompletionRequest, request: HttpRequest):
    """The answer to one chat request: 200 with a ``chat.completion`` body or its events, or OpenAI's error
    object (``api_errors``). With tools, the X-Tool-Format header names the tool format that ran."""
    session = await start_chat(service, chat_format, tool_parser, body)
    if not isinstance(session, _ChatCompletion):
        return session   # the refusal
    if body.stream:
        response = StreamingResponse(session.sse(request), media_type="text/event-stream")
    else:
        response = await session.respond(request)
    if session.tool_answer is not None:
        response.headers["X-Tool-Format"] = session.tool_answer.format
    return with_ignored(response, session.ignored)


async def start_chat(service, chat_format, tool_parser, body: ChatCompletionRequest, rename=lambda err: err):
    """Validate, render and submit one chat request: the accepted ``_ChatCompletion`` or the error response
    (400 / 404 / 429 / 503). rename: RequestError -> RequestError, restating a refusal in the fields of the
    API the client used (the Responses API's)."""
    if not service.worker.alive:
        service.metrics.rejected(reason="unavailable")
        return JSONResponse(error_body("the engine is not running", None, "server_error"), status_code=503)
    try:  # rendering and tokenizing in a worker thread: the event loop keeps serving (request_limits)
        prompt_ids, options, tool_answer, ignored = await asyncio.to_thread(_prepare, service, chat_format, body,
                                                                            tool_parser)
    except RequestError as err:
        service.metrics.rejected(err)
        return request_error_response(rename(err))
    cid, rids, events, refused = await service.submit("chatcmpl", prompt_ids, options,
                                                      lambda err: _renamed(rename, _as_messages_error(err)),
                                                      slice_name=slice_from(body.model_extra))
    if refused is not None:
        return refused
    session = _ChatCompletion(service, cid, rids, len(prompt_ids), body, events)
    session.tool_answer, session.ignored = tool_answer, ignored
    return session


def _renamed(rename, err: Exception) -> Exception:
    return rename(err) if isinstance(err, RequestError) else err


def _as_messages_error(err: Exception) -> Exception:
    """An admission error on ``prompt`` (too many tokens) restated for the JSON field a chat client sent,
    ``messages``; other errors unchanged."""
    if isinstance(err, RequestError) and err.field == "prompt":
        return RequestError("messages", f"messages: after the chat template, the {err}", err.code)
    return err


def _prepare(service, chat_format, body: ChatCompletionRequest, tool_parser: str | None = None) -> tuple:
    """(prompt ids, one SamplingOptions per choice, the ToolAnswer or None, the ignored fields). Raises
    RequestError naming the field."""
    check_model(body.model, service.model_name, service.aliases)
    if chat_format is None:
        raise RequestError("model", f"model {service.model_name!r} has no chat template, so it cannot answer "
                           "chat requests: use /v1/completions with a plain prompt")
    body.check_supported()
    ignored = service.ignored_fields(body, "/v1/chat/completions", UNSUPPORTED_CHAT_FIELDS)
    tools = parse_tool_request(body.model_extra)  # tools, tool_choice, parallel_tool_calls (tool_calls)
    messages, rendered, tool_grammar, tool_answer = prepare_tools(tools, chat_format, service, body.messages,
                                                                  tool_parser)

    def fits(num_chars: int) -> None:
        service.length_bound.check(num_chars, "messages", "the prompt rendered from messages")

    try:
        prompt_ids = chat_format.prompt_ids(messages, service.tokenizer, before_encoding=fits, tools=rendered)
    except ChatTemplateError as err:
        raise RequestError(err.field, str(err)) from None
    field, limit = body.token_limit()
    if limit is None:
        limit = max(1, service.max_context - len(prompt_ids))
    elif limit < 1:
        raise RequestError(field, f"{field}={limit} is not allowed: an integer >= 1")
    seed = body.seed if body.seed is not None else secrets.randbelow(2**32)
    constraint = request_constraint(body.model_extra, service.tokenizer, service.stop_ids)  # structured outputs
    if tool_grammar is not None and constraint is not None:
        raise RequestError("tool_choice", "tool_choice 'required' or a named function forces a tool call, which "
                           "cannot also follow response_format / structured_outputs: give one of them")
    constraint = constraint or tool_grammar
    return prompt_ids, [SamplingOptions(max_new_tokens=limit, temperature=body.temperature, top_k=body.top_k,
                                        top_p=body.top_p, seed=(seed + i) % 2**32, logprobs=body.logprob_count(),
                                        stop_token_ids=service.stops_for(body), constraint=constraint,
                                        logit_bias=body.logit_bias_pairs())
                        for i in range(body.n)], tool_answer, ignored
