"""OpenAI's Responses API for text: ``POST /v1/responses`` and ``GET /v1/responses/{id}``, on the chat path.

A body is read as a chat request (``responses_request``: input items -> messages, instructions -> a system
message, previous_response_id -> the earlier conversation, function tools -> chat tools) and run through
``chat_endpoint.start_chat``, so it renders, tokenizes, samples, stops and calls tools exactly as
/v1/chat/completions does (one choice). The answer is a ``response`` object (OpenAI API reference,
"The response object"): id "resp_<hex>", status "completed" (or "incomplete" with incomplete_details.reason
"max_output_tokens" when max_output_tokens cut it), output items: a "message" {id "msg_<hex>", role
"assistant", content [{"type": "output_text", "text", "annotations": [], "logprobs": []}]} when there is
text, then one "function_call" item {id "fc_<hex>", call_id, name, arguments} per tool call; output_text is
left to the client (the openai client derives it); usage {input_tokens, input_tokens_details.cached_tokens,
output_tokens, output_tokens_details.reasoning_tokens (0), total_tokens}.

Streamed (``stream: true``), server-sent events, each "event: <type>" and "data: <json>" with a
sequence_number, as OpenAI sends them: response.created and response.in_progress (status "in_progress"), for
the text response.output_item.added (the message), response.content_part.added, response.output_text.delta
(one per piece), response.output_text.done, response.content_part.done, response.output_item.done; for each
tool call response.output_item.added (the function_call), response.function_call_arguments.delta (the pieces
of its arguments text), response.function_call_arguments.done and response.output_item.done; then
response.completed (or response.incomplete) with the whole response, or response.failed if generation
failed. There is no "[DONE]" line (the Responses API has none).

Stored responses (``store``, default true) live in this server's memory, at most MAX_STORED (the oldest
dropped first), and end with it: GET /v1/responses/{id} returns one, and previous_response_id continues one
(an unknown id: 400 previous_response_not_found, param previous_response_id).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from .api_errors import check_model, request_error_response
from .chat_endpoint import ChatCompletionRequest, _ChatCompletion, start_chat
from .completions import with_ignored
from .protocol import error_body
from .request import RequestError
from .responses_request import ResponsesRequest, chat_tools, input_messages
from .tool_chat import CallStream

MAX_STORED = 1024  # stored responses kept for previous_response_id and GET /v1/responses/{id}
# chat field -> the Responses field a client sent (for the param of an error)
_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponseStore:
    """Responses of this server's lifetime: id -> (the response object, the conversation after it as chat
    messages, without instructions). At most ``limit``; the oldest is dropped first."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit, self.items = limit, OrderedDict()

    def put(self, response: dict, conversation: list) -> None:
        self.items[response["id"]] = (response, conversation)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> tuple | None:
        return self.items.get(response_id)


def add_responses_route(app, service, chat_format, tool_parser: str | None = None) -> None:
    """Register POST /v1/responses and GET /v1/responses/{id} on ``app`` (see the module docstring)."""
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: HttpRequest):
        try:
            check_model(body.model, service.model_name, service.aliases)
            body.check_supported()
            ignored = service.ignored_fields(body, "/v1/responses")
            history = _history(body, store)
            chat = _chat_body(body, history)
        except RequestError as err:
            service.metrics.rejected(err)
            return request_error_response(err)
        session = await start_chat(service, chat_format, tool_parser, chat, _rename)
        if not isinstance(session, _ChatCompletion):
            return session
        run = _Run(session, body, history, store)
        if body.stream:
            return with_ignored(StreamingResponse(run.events(request), media_type="text/event-stream"), ignored)
        return with_ignored(await run.respond(request), ignored)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        found = store.get(response_id)
        if found is None:
            return JSONResponse(error_body(f"No response with id {response_id!r} is stored on this server "
                                           "(responses live in its memory until it stops)", "response_id"),
                                status_code=404)
        return found[0]


def _rename(err: RequestError) -> RequestError:
    """A chat-path error restated with the Responses field the client sent (messages -> input, ...)."""
    head, dot, rest = err.field.partition(".") if err.field else ("", "", "")
    base = head.split("[")[0]
    if base not in _FIELDS:
        return err
    field = _FIELDS[base] + head[len(base):] + dot + rest
    return RequestError(field, str(err), getattr(err, "code", None))


def _history(body: ResponsesRequest, store: ResponseStore) -> list:
    """The conversation before this response: the previous response's, then this input."""
    before: list = []
    if body.previous_response_id is not None:
        found = store.get(body.previous_response_id)
        if found is None:
            raise RequestError("previous_response_id", f"Previous response with id {body.previous_response_id!r} "
                               "not found (responses are kept in this server's memory while it runs, when stored)",
                               "previous_response_not_found")
        before = list(found[1])
    return before + input_messages(body)


def _chat_body(body: ResponsesRequest, history: list) -> ChatCompletionRequest:
    """The chat request a Responses body stands for (instructions first, one choice, never streamed: the
    events are this module's)."""
    extra = body.model_extra or {}
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fields = dict(messages=system + history, max_completion_tokens=body.max_output_tokens,
                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                  **chat_tools(extra))
    for key in ("metadata", "user"):
        if extra.get(key) is not None:
            fields[key] = extra[key]
    return ChatCompletionRequest(**fields)


class _Run:
    """One accepted Responses request: its chat session's text -> output items, a response object, events."""

    def __init__(self, session: _ChatCompletion, body: ResponsesRequest, history: list, store: ResponseStore):
        self.session, self.body, self.history, self.store = session, body, history, store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = 0

    def response(self, status: str, output: list, usage: dict | None = None, finish: str | None = None) -> dict:
        """The response object (OpenAI's "The response object") in ``status``."""
        extra = self.body.model_extra or {}
        tools = extra.get("tools") or []
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
                "model": self.session.service.model_name, "output": output,
                "parallel_tool_calls": extra.get("parallel_tool_calls", True) is not False,
                "previous_response_id": self.body.previous_response_id, "temperature": self.body.temperature,
                "top_p": self.body.top_p, "tool_choice": extra.get("tool_choice") or "auto", "tools": tools,
                "text": extra.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
                "metadata": extra.get("metadata") or {}, "user": extra.get("user"), "usage": usage,
                "store": extra.get("store", True) is not False}
        if self.session.tool_answer is not None:
            body["tool_format"] = self.session.tool_answer.format
        return body

    def usage(self) -> dict:
        chat = self.session._usage()
        return {"input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat["total_tokens"]}

    def finish(self, output: list, finish_reason: str | None) -> dict:
        """The final response object; stored (with the conversation after it) unless store is false."""
        status = "incomplete" if finish_reason == "length" else "completed"
        final = self.response(status, output, self.usage(), finish_reason)
        if final["store"]:
            self.store.put(final, self.history + [_assistant_turn(output)])
        return final

    async def respond(self, request: HttpRequest):
        text = ""
        async for _choice, piece in self.session.pieces(request):
            text += piece
        choice = self.session.choices[0]
        if choice.finish_reason == "error":
            return JSONResponse(error_body(choice.error or "generation failed", None, "server_error"),
                                status_code=500)
        if choice.finish_reason is None:  # the client went away; nobody reads this
            return JSONResponse(error_body("client disconnected", None), status_code=499)
        answer = self.session.tool_answer
        content, calls = answer.calls(text, choice.finish_reason) if answer is not None else (text, [])
        output = ([_message(f"msg_{uuid.uuid4().hex}", content or "", "completed")] if content or not calls
                  else [])
        output += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                   for c in calls]
        return JSONResponse(self.finish(output, choice.finish_reason))

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, request: HttpRequest):
        try:
            async for event in self._events(request):
                yield event
        finally:
            if not self.session.done:  # the client disconnected mid-stream
                self.session._abort()

    async def _events(self, request: HttpRequest):
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        out = _StreamedOutput(self)
        calls = CallStream(self.session.tool_answer) if self.session.tool_answer is not None else None
        choice = self.session.choices[0]
        async for _choice, piece in self.session.pieces(request):
            if choice.done and choice.finish_reason == "error":
                failed = self.response("failed", out.items)
                failed["error"] = {"code": "server_error", "message": choice.error or "generation failed"}
                yield self.event("response.failed", response=failed)
                return
            reason = choice.finish_reason if choice.done else None
            deltas = calls.feed(piece, reason) if calls is not None else ([{"content": piece}] if piece else [])
            for delta in deltas:
                for event in out.delta(delta):
                    yield event
        if choice.finish_reason is None:   # the client disconnected
            return
        for event in out.close():
            yield event
        final = self.finish(out.items, choice.finish_reason)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=final)


class _StreamedOutput:
    """The output items of a streamed response as its deltas arrive (chat-style {"content"} and {"tool_calls"}
    deltas, ``tool_chat.CallStream``), and the events that announce them."""

    def __init__(self, run: _Run):
        self.run, self.items = run, []
        self.message: dict | None = None   # the open message item
        self.calls: dict[int, dict] = {}   # tool call index -> its function_call item

    def delta(self, delta: dict) -> list[str]:
        events = []
        if delta.get("content"):
            if self.message is None:
                self.message = _message(f"msg_{uuid.uuid4().hex}", "", "in_progress")
                self.items.append(self.message)
                events += [self._item("response.output_item.added", self.message),
                           self._part("response.content_part.added", "")]
            self.message["content"][0]["text"] += delta["content"]
            events.append(self.run.event("response.output_text.delta", item_id=self.message["id"],
                                         output_index=self._index(self.message), content_index=0,
                                         delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        return events

    def _call(self, call: dict) -> list[str]:
        events = []
        if call.get("id") is not None:   # a new call: the text before it is complete
            events += self._close_message()
            item = _call_item(call["id"], call["function"]["name"], "", "in_progress")
            self.calls[call["index"]] = item
            self.items.append(item)
            events.append(self._item("response.output_item.added", item))
        arguments = call["function"].get("arguments") or ""
        if arguments:
            item = self.calls[call["index"]]
            item["arguments"] += arguments
            events.append(self.run.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self._index(item), delta=arguments))
        return events

    def close(self) -> list[str]:
        """The closing events of every open item."""
        events = self._close_message()
        for item in self.calls.values():
            item["status"] = "completed"
            events += [self.run.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=self._index(item), arguments=item["arguments"]),
                       self._item("response.output_item.done", item)]
        return events

    def _close_message(self) -> list[str]:
        if self.message is None or self.message["status"] == "completed":
            return []
        self.message["status"] = "completed"
        text = self.message["content"][0]["text"]
        return [self.run.event("response.output_text.done", item_id=self.message["id"],
                               output_index=self._index(self.message), content_index=0, text=text, logprobs=[]),
                self._part("response.content_part.done", text),
                self._item("response.output_item.done", self.message)]

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def _item(self, kind: str, item: dict) -> str:
        return self.run.event(kind, output_index=self._index(item), item=json.loads(json.dumps(item)))

    def _part(self, kind: str, text: str) -> str:
        return self.run.event(kind, item_id=self.message["id"], output_index=self._index(self.message),
                              content_index=0, part=_text_part(text))


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _assistant_turn(output: list) -> dict:
    """The chat message of a response's output items (for a later previous_response_id)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        return {"role": "assistant", "content": text or None, "tool_calls": calls}
    return {"role": "assistant", "content": text}
