"""The completion machinery behind ``/v1/completions`` (and extended by the chat route): one request's
validation and submission to the engine worker (``_Service``), its choices as they stream back
(``_Choice``, ``_Completion``), client-disconnect watching (K10) and the mapping of engine rejections to
HTTP answers.

No request stalls the others: a prompt obviously over the context is refused from its length in characters
before it is tokenized (``request_limits.PromptLengthBound``), and tokenizing runs in a worker thread
(``asyncio.to_thread``) with the GIL released for long texts (``dantinox.runs.tokenizer``), so the event loop
keeps answering while a huge prompt is encoded."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import uuid

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from ..runs.tokenizer import StreamDecoder, UnknownCharactersError
from .api_errors import UNKNOWN_FIELD, check_model, request_error_response
from .protocol import (UNSUPPORTED_FIELDS, CompletionRequest, LogprobsLog, StopChecker, choice_body, completion_body,
                       error_body, usage_body)
from .request import QueueFullError, RequestError, RequestOutput, SamplingOptions
from .request_limits import PromptLengthBound
from .request_log import slice_from
from .structured_request import constrained, request_constraint
from .worker import EngineWorker

log = logging.getLogger("dantinox.serving")

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions, cut to what is left of the context


POLL_S = 0.5  # how often a waiting handler checks the worker's health


DISCONNECT_POLL_S = 0.1  # how often the watcher asks whether the client is still connected (K10)


_GONE = ("gone",)  # the event the watcher puts on a request's queue when its client disconnected


class _Service:
    """The completions endpoint's logic (one instance per app)."""

    def __init__(self, worker: EngineWorker, tokenizer, model_name: str, max_context: int, metrics,
                 stop_ids: tuple = (), strict_fields: bool = False, aliases: tuple = ()):
        self.worker, self.tokenizer, self.metrics = worker, tokenizer, metrics
        self.model_name, self.max_context, self.aliases = model_name, max_context, tuple(aliases)
        self.stop_ids = tuple(stop_ids)
        self.length_bound = PromptLengthBound(tokenizer, max_context)
        self.strict_fields = strict_fields

    def ignored_fields(self, body, path: str, checked=()) -> list[str]:
        """The body's fields no part of the server reads (``SamplingRequest.ignored_fields``): logged in one
        warning line and returned (the answer names them in its X-Ignored-Fields header); with
        strict_fields (``serve --strict-fields``, OpenAI's own behaviour) the first one is refused instead
        (RequestError naming it, code unknown_field)."""
        ignored = body.ignored_fields(checked)
        if ignored and self.strict_fields:
            raise RequestError(ignored[0], f"Unrecognized request argument supplied: {', '.join(ignored)} (this "
                               "server was started with --strict-fields)", UNKNOWN_FIELD)
        if ignored:
            log.warning("%s: request fields ignored (this server does not read them): %s", path, ", ".join(ignored))
        return ignored

    def stops_for(self, body) -> tuple:
        """The stop ids of a request: the model's, or none when it asks for ignore_eos."""
        return () if body.ignore_eos else self.stop_ids

    async def complete(self, body: CompletionRequest, request: HttpRequest):
        if not self.worker.alive:
            self.metrics.rejected(reason="unavailable")
            return JSONResponse(error_body("the engine is not running", None, "server_error"),
                                status_code=503)
        try:
            check_model(body.model, self.model_name, self.aliases)
            body.check_supported()
            ignored = self.ignored_fields(body, "/v1/completions", UNSUPPORTED_FIELDS)
            prompt_ids = await self.encode_prompt(body.prompt)
            options = self._options(body, len(prompt_ids))
            # structured outputs: response_format / structured_outputs / guided_* (structured_request)
            options = constrained(options, request_constraint(body.model_extra, self.tokenizer, self.stop_ids))
        except RequestError as err:
            self.metrics.rejected(err)
            return request_error_response(err)
        cid, rids, events, refused = await self.submit("cmpl", prompt_ids, options,
                                                       slice_name=slice_from(body.model_extra))
        if refused is not None:
            return refused
        session = _Completion(self, cid, rids, len(prompt_ids), body, events)
        if body.stream:
            return with_ignored(StreamingResponse(session.sse(request), media_type="text/event-stream"), ignored)
        return with_ignored(await session.respond(request), ignored)

    async def submit(self, kind: str, prompt_ids: list[int], options: list, rejected=lambda err: err,
                     slice_name: str | None = None):
        """Hand one request of len(options) choices to the worker and wait for its admission. Returns (id,
        engine request ids, event queue, None) or, when the engine is dead or refuses the request, a 503 /
        400 / 429 response in the last place (``rejected`` may reword the refusal; the worker counted it)."""
        cid = f"{kind}-{uuid.uuid4().hex}"
        rids = [f"{cid}-{i}" for i in range(len(options))]
        events: asyncio.Queue = asyncio.Queue()
        self.worker.submit(rids, prompt_ids, options, asyncio.get_running_loop(), events, slice_name)
        first = await _next_event(events, self.worker)
        if first[0] == "dead":
            self.metrics.rejected(reason="unavailable")
            return cid, rids, events, JSONResponse(error_body(first[1], None, "server_error"), status_code=503)
        if first[0] == "rejected":
            return cid, rids, events, _rejection(rejected(first[1]))
        return cid, rids, events, None

    async def encode_prompt(self, prompt) -> list[int]:
        """The token ids of a completion's prompt, tokenized in a worker thread; a text that cannot fit the
        context is refused first, from its length (RequestError naming "prompt")."""
        text = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else prompt
        if not isinstance(text, str):
            return list(text)
        self.length_bound.check(len(text), "prompt")
        return await asyncio.to_thread(self._encode, text)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "prompt is empty: give at least one character")
            try:
                return self.tokenizer.encode(prompt, unknown="error")
            except UnknownCharactersError as err:  # no Python or CLI remedy: say what the client can do
                raise RequestError("prompt", f"prompt: {err.detail} This server does not replace them: remove "
                                   "them from 'prompt', or send 'prompt' as a list of token ids.") from err
            except ValueError as err:
                raise RequestError("prompt", f"prompt: {err}") from err
        return list(prompt)

    def _options(self, body: CompletionRequest, prompt_tokens: int) -> list[SamplingOptions]:
        """One SamplingOptions per choice; choice i draws with seed (seed + i) mod 2**32."""
        seed = body.seed if body.seed is not None else secrets.randbelow(2**32)
        default = max(1, min(DEFAULT_MAX_TOKENS, self.max_context - prompt_tokens))
        max_tokens = default if body.max_tokens is None else body.max_tokens
        return [SamplingOptions(max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                top_p=body.top_p, seed=(seed + i) % 2**32, logprobs=body.logprob_count(),
                                stop_token_ids=self.stops_for(body), logit_bias=body.logit_bias_pairs())
                for i in range(body.n)]


def with_ignored(response, ignored: list[str]):
    """``response`` with the header X-Ignored-Fields naming the request fields the server ignored (none: as
    it was)."""
    if ignored:
        response.headers["X-Ignored-Fields"] = ", ".join(ignored)
    return response


def _rejection(err: Exception) -> JSONResponse:
    if isinstance(err, QueueFullError):
        return JSONResponse(error_body(str(err), None, "rate_limit_error", "queue_full"), status_code=429,
                            headers={"Retry-After": str(max(1, math.ceil(err.retry_after)))})
    if isinstance(err, RequestError):
        return request_error_response(err)
    return JSONResponse(error_body(str(err), getattr(err, "field", None)), status_code=400)


async def _next_event(events: asyncio.Queue, worker: EngineWorker):
    """The next reply on ``events``; ("dead", message) if the worker died; None if the client went away."""
    while True:
        try:
            event = await asyncio.wait_for(events.get(), POLL_S)
        except asyncio.TimeoutError:
            if not worker.alive:
                return ("dead", f"engine stopped: {worker.error}")
            continue
        return None if event == _GONE else event


async def _watch_disconnect(request: HttpRequest, events: asyncio.Queue) -> None:
    """Put _GONE on ``events`` once the client has disconnected; polls every DISCONNECT_POLL_S seconds, so a
    disconnect is noticed within that time whether or not tokens are flowing (K10). Cancelled when the
    response is complete."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    events.put_nowait(_GONE)


class _Choice:
    """One choice of a completion (one engine request): its tokens -> text pieces, stop strings, logprobs.
    Tokens in ``hidden`` (the request's stop ids) count as completion tokens but add no text or logprobs."""

    def __init__(self, index: int, rid: str, tokenizer, stops: list[str], logprobs: int | None,
                 hidden: tuple = (), chat: bool = False):
        self.index, self.rid = index, rid
        self.hidden = frozenset(hidden)
        self.decoder = StreamDecoder(tokenizer)
        self.stops = StopChecker(stops)
        self.logprobs = None if logprobs is None else LogprobsLog(tokenizer.decode, chat)
        self.cached_tokens = 0  # prompt tokens the prefix cache served (the engine's first output says)
        self.decoded = 0  # characters the decoder has produced: the text_offset of the next token
        self.completion_tokens = 0
        self.speculative: tuple | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = False  # the engine request is over (finished, or aborted by us)

    def push(self, out: RequestOutput) -> str:
        """Consume one engine output; returns the text now safe to emit. Sets done and finish_reason when the
        choice ends (engine finished, or a stop string: the caller then aborts the engine request)."""
        self.completion_tokens += len(out.new_token_ids)
        self.speculative = out.speculative or self.speculative   # (proposed, accepted) so far
        self.cached_tokens = max(self.cached_tokens, getattr(out, "num_cached_tokens", 0))
        piece = ""
        for i, token in enumerate(out.new_token_ids):
            if token in self.hidden:
                continue
            if self.logprobs is not None and out.logprobs:
                self.logprobs.add(out.logprobs[i], self.decoded)
            text = self.decoder.push(token)
            self.decoded += len(text)
            piece += text
        if out.finished:
            piece += self.decoder.flush()
        text, stopped = self.stops.push(piece)
        if stopped or out.finished:
            self.finish_reason = "stop" if stopped else out.finish_reason
            self.error = None if stopped else out.error
            text += "" if stopped else self.stops.flush()
            self.done = True
        return text

    def fail(self, message: str) -> None:
        self.finish_reason, self.error, self.done = "error", message, True

    def body(self, text: str, finish_reason: str | None, stream: bool) -> dict:
        """This choice's entry of a response (all logprobs) or of a streamed chunk (those not yet sent)."""
        logprobs = None if self.logprobs is None else (self.logprobs.take() if stream else self.logprobs.body())
        return choice_body(self.index, text, finish_reason, logprobs)


class _Completion:
    """One accepted request of n choices: engine outputs -> text pieces -> a JSON body or server-sent events."""

    chat = False  # log-probabilities in the chat format (LogprobsLog)
    shutting_down = False  # the server ended it while shutting down (answered 503, not 500)

    def __init__(self, service: _Service, cid: str, rids: list[str], prompt_tokens: int, body: CompletionRequest,
                 events: asyncio.Queue):
        self.service, self.cid, self.body, self.events = service, cid, body, events
        self.prompt_tokens = prompt_tokens
        self.choices = [_Choice(i, rid, service.tokenizer, body.stop_strings(), body.logprob_count(),
                                service.stops_for(body), self.chat) for i, rid in enumerate(rids)]
        self.by_rid = {c.rid: c for c in self.choices}

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    async def pieces(self, request: HttpRequest | None = None):
        """Yield (choice, text) as text arrives, and (choice, "") once when a choice ends, until every choice
        has ended (or the client went away: then every unfinished choice is aborted and nothing more comes).
        With ``request``, a watcher task notices a disconnect while tokens flow (K10)."""
        watcher = None if request is None else asyncio.create_task(_watch_disconnect(request, self.events))
        try:
            async for item in self._pieces():
                yield item
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _pieces(self):
        while not self.done:
            event = await _next_event(self.events, self.service.worker)
            if event is None:  # the client disconnected
                self._abort()
                return
            if event[0] in ("dead", "shutdown"):   # the engine failed, or the server drains (worker item 6)
                self.shutting_down = event[0] == "shutdown"
                for choice in self.choices:
                    if not choice.done:
                        choice.fail(event[1])
                        yield choice, ""
                return
            out: RequestOutput = event[1]
            choice = self.by_rid.get(out.request_id)
            if choice is None or choice.done:  # e.g. the final "abort" output after a stop string
                continue
            text = choice.push(out)
            if choice.done and not out.finished:  # a stop string: finished by "stop" in the metrics
                self.service.worker.abort(choice.rid, reason="stop")
            if text or choice.done:
                yield choice, text

    def _abort(self) -> None:
        for choice in self.choices:
            if not choice.done:
                choice.done = True
                self.service.worker.abort(choice.rid)

    def _usage(self) -> dict:
        spec = [c.speculative for c in self.choices if c.speculative is not None]
        total = tuple(map(sum, zip(*spec))) if spec else None
        return usage_body(self.prompt_tokens, sum(c.completion_tokens for c in self.choices), total,
                          self.choices[0].cached_tokens)   # the prompt once: the first choice's cache hit

    async def respond(self, request: HttpRequest):
        texts = {c.index: "" for c in self.choices}
        async for choice, text in self.pieces(request):
            texts[choice.index] += text
        failed = next((c for c in self.choices if c.finish_reason == "error"), None)
        if failed is not None:
            return JSONResponse(error_body(failed.error or "generation failed", None, "server_error"),
                                status_code=503 if self.shutting_down else 500)
        if any(c.finish_reason is None for c in self.choices):  # the client went away; nobody reads this
            return JSONResponse(error_body("client disconnected", None), status_code=499)
        return JSONResponse(self._final_body(texts))

    def _final_body(self, texts: dict[int, str]) -> dict:
        """The whole response once every choice has ended; texts: choice index -> its text."""
        choices = [c.body(texts[c.index], c.finish_reason, stream=False) for c in self.choices]
        return completion_body(self.cid, self.service.model_name, choices, self._usage())

    async def sse(self, request: HttpRequest | None = None):
        name = self.service.model_name
        try:
            async for choice, text in self.pieces(request):
                if text:
                    yield _event(completion_body(self.cid, name, [choice.body(text, None, True)], None))
                if not choice.done:
                    continue
                if choice.finish_reason == "error":
                    yield _event(error_body(choice.error or "generation failed", None, "server_error"))
                else:
                    yield _event(completion_body(self.cid, name, [choice.body("", choice.finish_reason, True)],
                                                 None))
            if self.body.include_usage():
                yield _event(completion_body(self.cid, name, [], self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            if not self.done:  # the client disconnected mid-stream (the generator was cancelled or closed)
                self._abort()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
