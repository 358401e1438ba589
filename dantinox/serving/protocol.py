"""The OpenAI completions protocol: the request body, response bodies, and stop-string handling.

Supported fields of ``POST /v1/completions``: model, prompt (a string, a list of token ids, or a list of one
string), max_tokens (default: 16, or what is left of the context if less), temperature (default 1.0;
0 = greedy), top_p, top_k (an extension; 0 = off), seed, stop (a string or up to 4), stream,
stream_options.include_usage, n (must be 1), echo (must be false), logprobs (must be null). Other fields are
accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from .request import RequestError

MAX_STOP_STRINGS = 4


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    echo: bool = False
    logprobs: int | None = None

    def check_supported(self) -> None:
        """Raise RequestError naming the field for features this server does not offer."""
        if self.n != 1:
            raise RequestError("n", f"n={self.n} is not supported: one completion per request (n=1)")
        if self.echo:
            raise RequestError("echo", "echo=true is not supported")
        if self.logprobs is not None:
            raise RequestError("logprobs", "logprobs are not supported: leave logprobs null")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise RequestError("prompt", f"a batch of {len(self.prompt)} prompts is not supported: send "
                                   "one prompt per request")
        if len(self.stop_strings()) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"{len(self.stop_strings())} stop strings given; at most "
                               f"{MAX_STOP_STRINGS}")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class StopChecker:
    """Finds the first stop string in streamed text and holds back text that may begin one.

    ``push(text)`` returns (text safe to emit, stopped); after a stop, the stop string and everything after it
    are dropped. ``flush()`` returns the text held back at the end.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(stop[:n]):
                    keep = n
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None,
                    usage: dict | None) -> dict:
    """A ``text_completion`` object (the whole response, or one streamed chunk)."""
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return body


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code=None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
