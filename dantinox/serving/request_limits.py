"""Limits that keep one request from stalling the server, checked before any heavy work is done for it.

1. The request body (``serve --max-request-bytes``, default DEFAULT_MAX_REQUEST_BYTES = 1 MiB): a body whose
   Content-Length is over the limit is answered 413 before a byte of it is read; a body sent without one
   (chunked) is counted as it arrives and answered 413 as soon as it passes the limit (``BodySizeLimit``).
   Either way the answer is OpenAI's error object naming the size and the limit, and the rest of the body
   is never buffered.
2. A prompt obviously over the context: a text of N characters needs at least ceil(N / C) tokens when no
   token of the vocabulary stands for more than C characters (``dantinox.runs.chars_per_token``); when that
   lower bound already exceeds the context, the prompt is refused with 400 before it is tokenized
   (``PromptLengthBound``). The bound is exact: a prompt that fits is never refused by it. A tokenizer whose
   pipeline allows no such bound gets no early check (its prompts are tokenized, off the event loop).
3. A prompt of token ids obviously over the context: parsing and validating a body of millions of ids holds
   the event loop for about a second, so a /v1/completions body over LARGE_BODY bytes whose "prompt" is a list
   of ids longer than the context is refused with 400 from its bytes alone, before it is parsed
   (``TokenListBound``, counting the commas between the list's brackets).
"""

from __future__ import annotations

import json
import re

from ..runs.chars_per_token import fewest_tokens, max_chars_per_token
from .protocol import error_body
from .request import CONTEXT_LENGTH_EXCEEDED, RequestError

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: a 250,000-token prompt at 4 bytes per token fits
LARGE_BODY = 1 << 20                 # bytes: bodies above this get TokenListBound's check before parsing
_ID_PROMPT = re.compile(rb'(?<!\\)"prompt"\s*:\s*\[\s*-?[0-9]')


def check_max_bytes(max_bytes, name: str = "max_bytes") -> int:
    """``max_bytes`` itself when it is an integer >= 1; ValueError naming ``name`` and the value otherwise."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"{name}={max_bytes!r} is not allowed: an integer number of bytes >= 1")
    return max_bytes


class BodySizeLimit:
    """ASGI middleware: HTTP request bodies over ``max_bytes`` get 413 with OpenAI's error object.

    app: the ASGI app; max_bytes: the largest body allowed (bytes, >= 1); on_reject: called with the reason
    of each request refused here, "body_too_large" (413) or "invalid_<param>" (400 from ``precheck``), which
    the server counts in ``dantinox_requests_rejected_total`` under that label as it counts the endpoints'
    own refusals; precheck: (path, body bytes) -> an error body to answer 400 with, or None. A body within the
    limit is read whole here and handed to the app unchanged; later ``receive`` calls (the disconnect
    watcher's) go to the server as before.
    """

    def __init__(self, app, max_bytes: int, on_reject=None, precheck=None):
        self.app, self.max_bytes, self.on_reject = app, check_max_bytes(max_bytes), on_reject
        self.precheck = precheck

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(scope, receive, send, f"the request body has {declared:,} bytes")
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away while sending
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, f"the request body passed {size:,} bytes "
                                          "(sent without a Content-Length)")
            if not message.get("more_body", False):
                break
        refusal = None
        if self.precheck is not None and size > LARGE_BODY:
            refusal = self.precheck(scope.get("path", ""), b"".join(m.get("body", b"") for m in messages))
        if refusal is not None:
            if self.on_reject is not None:
                self.on_reject(f"invalid_{refusal['error']['param']}")
            return await _answer(send, 400, refusal)
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope, receive, send, what: str) -> None:
        if self.on_reject is not None:
            self.on_reject("body_too_large")
        body = error_body(f"{what}; this server accepts request bodies of at most {self.max_bytes:,} bytes",
                          "body", "invalid_request_error", "request_too_large")
        await _answer(send, 413, body)


async def _answer(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode("ascii"))]})
    await send({"type": "http.response.body", "body": payload})


def token_list_length(body: bytes) -> int | None:
    """How many token ids a completion body's ``"prompt": [ids]`` holds, counted from its bytes (the commas
    between the list's brackets: a list of integers holds no other comma and no bracket); None when the body
    has no such list. A body is read as JSON only if it is small; this is for the large ones (module
    docstring, item 3)."""
    found = _ID_PROMPT.search(body)
    if found is None:
        return None
    end = body.find(b"]", found.end())
    return None if end < 0 else body.count(b",", found.end(), end) + 1


class TokenListBound:
    """``BodySizeLimit``'s precheck for /v1/completions: a body whose prompt is a list of more than max_tokens
    token ids (the context) gets OpenAI's error object naming "prompt", without being parsed."""

    def __init__(self, max_tokens: int, path: str = "/v1/completions"):
        self.max_tokens, self.path = max_tokens, path

    def __call__(self, path: str, body: bytes) -> dict | None:
        if path != self.path:
            return None
        count = token_list_length(body)
        if count is None or count <= self.max_tokens:
            return None
        return error_body(f"prompt has {count:,} tokens; the context holds {self.max_tokens:,} tokens: send a "
                          "shorter prompt", "prompt", code=CONTEXT_LENGTH_EXCEEDED)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(messages: list, receive):
    """A ``receive`` that returns ``messages`` first, then defers to ``receive``."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


class PromptLengthBound:
    """Refuses a text that cannot fit the context, from its length in characters alone.

    tokenizer: the served TextTokenizer (its bound is computed once here; None when its pipeline has none);
    max_tokens: the most prompt tokens the engine accepts (its context, in tokens).
    """

    def __init__(self, tokenizer, max_tokens: int):
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.max_tokens = max_tokens

    def check(self, num_chars: int, field: str, what: str | None = None) -> None:
        """Raise RequestError naming ``field`` when a text of ``num_chars`` characters needs more than
        max_tokens tokens whatever its content. what: how the message names the text (default: the field)."""
        per = self.max_chars_per_token
        if per is None:
            return
        fewest = fewest_tokens(num_chars, per)
        if fewest > self.max_tokens:
            raise RequestError(field, f"{what or field} has {num_chars:,} characters, so at least {fewest:,} "
                               f"tokens (no token of this model stands for more than {per} characters); the "
                               f"context holds {self.max_tokens:,} tokens: shorten the {field}",
                               CONTEXT_LENGTH_EXCEEDED)
