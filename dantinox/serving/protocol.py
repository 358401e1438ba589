"""The OpenAI completions protocol: the request body, response bodies, and stop-string handling.

Supported fields of ``POST /v1/completions``: model, prompt (a string, a list of token ids, or a list of one
string), max_tokens (default: 16, or what is left of the context if less), temperature (default 1.0; 0 =
greedy), top_p, top_k (an extension; 0 = off), seed, stop (a string or up to 4), stream,
stream_options.include_usage, n (1..MAX_CHOICES choices per prompt), logprobs (null or
0..MAX_COMPLETION_LOGPROBS), echo (must be false), user (ignored), ignore_eos (vLLM's extension, default
false). Types are strict: max_tokens: "5" or true, stream: "yes" get 400 naming the field (every error is
OpenAI's error object, ``api_errors``). seed must be in [0, 2**32); model, when given, must be the served
model's name (else 404 model_not_found); stop strings must not be empty. OpenAI fields this server does not
implement (best_of, suffix, frequency_penalty, presence_penalty) are rejected with 400 naming the
field unless they hold their no-op value (null, best_of 1, penalties 0); any other field no
part of the server reads (a misspelt "max_token", another server's extension) is ignored, named in one warning
line of the server's log and in the answer's ``X-Ignored-Fields`` header (``SamplingRequest.ignored_fields``;
vLLM ignores and logs such fields, llama-server ignores them); ``serve --strict-fields`` refuses them with 400
naming the field, as OpenAI does.

Stop ids. Every choice ends at the model's stop ids (its end-of-turn / end-of-text tokens,
``dantinox.runs.stop_ids``; case K11) with finish_reason "stop"; the stop token is counted in usage but not
shown in the text (nor in logprobs). ``ignore_eos: true`` turns them off for the request (generation then runs
to max_tokens, and a stop token it meets is text like any other).

n > 1: choice i is its own engine request with seed (seed + i) mod 2**32, so with a seed every choice is
reproducible and choice 0 equals the n = 1 completion; at temperature 0 all choices are equal. Usage counts
the prompt once and the completion tokens of every choice. Streamed chunks carry one choice each, tagged by
its ``index``.

logprobs (OpenAI's legacy completions format): choice.logprobs = {tokens, token_logprobs, top_logprobs,
text_offset}, one entry per generated token. The figures are the model's raw log-probabilities, log_softmax
of the logits before temperature, top-k and top-p, not the probabilities a sampled token was drawn with.
tokens[i] is token i decoded alone (a token holding part of a multi-byte character shows U+FFFD);
top_logprobs[i] maps the text of the ``logprobs`` most likely tokens, and of the chosen token, to their
log-probabilities (so up to logprobs + 1 entries; a text shared by two tokens keeps the likelier);
text_offset[i] is the number of characters of the choice's text completed before token i, i.e. the offset of
the first character token i contributes to (counted in the choice's text, not including the prompt). When a
stop string ends the text, the entries run up to the token that completed it. Streamed chunks carry the
entries of the tokens consumed since the previous chunk.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from .request import RequestError, TokenLogprobs

MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions' logprobs (chat's top_logprobs: 20)
MAX_CHOICES = 16  # most choices (n) per request
# OpenAI completions fields this server does not implement -> the values that change nothing
UNSUPPORTED_FIELDS = {"best_of": (None, 1), "suffix": (None,), "frequency_penalty": (None, 0),
                      "presence_penalty": (None, 0)}


# fields beyond SamplingRequest's own that the server reads: structured outputs (structured_request), tools
# (tool_calls) and the request log's slice (request_log.slice_from)
READ_EXTRA_FIELDS = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex",
                               "guided_grammar", "guided_choice", "tools", "tool_choice", "parallel_tool_calls",
                               "metadata", "user"})


class SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share (OpenAI's names and defaults), with the stop
    strings and the stream_options reading both use. Unknown fields are kept (``model_extra``) so each endpoint
    can name the OpenAI fields it does not implement."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: dict[str, StrictBool] | None = None   # include_usage: true / false
    n: StrictInt = 1
    ignore_eos: StrictBool = False  # vLLM's extension: generate past the model's stop ids
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None   # token id (as text) -> bias

    def logit_bias_pairs(self) -> tuple:
        """``logit_bias`` as (token id, bias) pairs; RequestError("logit_bias", ...) for a key that is not a
        token id written in decimal (the bounds are SamplingOptions.validate's)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise RequestError("logit_bias", f"logit_bias key {key!r} is not allowed: a token id (an integer "
                                   "written as a string, e.g. \"50256\")")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def logprob_count(self) -> int | None:
        """How many most likely alternatives each token's log-probabilities carry; None: no log-probabilities
        (the endpoints' own fields decide: completions' logprobs, chat's logprobs and top_logprobs)."""
        return None

    def ignored_fields(self, checked=()) -> list[str]:
        """Sorted names of the body's fields that no part of the server reads: every field beyond the model's
        own, READ_EXTRA_FIELDS and ``checked`` (the endpoint's unimplemented OpenAI fields, which
        check_supported refuses unless they hold their no-op value). The server logs them and names them in
        the answer's X-Ignored-Fields header (``completions._Service.ignored_fields``)."""
        return sorted(set(self.model_extra or {}) - READ_EXTRA_FIELDS - set(checked))


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    echo: StrictBool = False
    logprobs: StrictInt | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        """Raise RequestError naming the field for values this server does not offer (n outside
        [1, MAX_CHOICES], logprobs outside [0, MAX_COMPLETION_LOGPROBS], echo, several prompts, too many
        stops)."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise RequestError("n", f"n={self.n} is not allowed: an integer in [1, {MAX_CHOICES}]")
        if self.echo:
            raise RequestError("echo", "echo=true is not supported")
        for name, no_op in UNSUPPORTED_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if not any(value == v and type(value) is not bool for v in no_op) and value is not None:
                raise RequestError(name, f"{name}={value!r} is not supported by this server (allowed: "
                                   f"{' or '.join('null' if v is None else repr(v) for v in no_op)})")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise RequestError("seed", f"seed={self.seed} is not allowed: null or an integer in [0, 2**32)")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise RequestError("stop", f"stop={self.stop!r} is not allowed: stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise RequestError("logprobs", f"logprobs={self.logprobs} is not allowed: null or an integer in "
                               f"[0, {MAX_COMPLETION_LOGPROBS}]")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise RequestError("prompt", f"a batch of {len(self.prompt)} prompts is not supported: send "
                                   "one prompt per request")
        if len(self.stop_strings()) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"{len(self.stop_strings())} stop strings given; at most "
                               f"{MAX_STOP_STRINGS}")


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


class LogprobsLog:
    """One choice's token log-probabilities, collected token by token, in either OpenAI format.

    ``add(lp, offset)`` records a TokenLogprobs at character ``offset`` of the choice's text. The legacy
    completions format: ``take()`` returns the entries added since the previous take as {tokens,
    token_logprobs, top_logprobs, text_offset}; ``body()`` returns them all. The chat format (``chat=True``):
    ``take()`` / ``body()`` return {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}, ...]}, ...], "refusal": None}, top_logprobs holding the request's top_logprobs most likely
    tokens, most likely first (a list: two tokens of the same text both appear). ``decode``: the tokenizer's
    decode (list of ids -> str); a token's text is its id decoded alone and its bytes that text's UTF-8
    bytes (a token holding part of a multi-byte character shows U+FFFD).
    """

    def __init__(self, decode, chat: bool = False):
        self.decode, self.chat = decode, chat
        self.entries: list[tuple] = []  # (TokenLogprobs, offset)
        self.taken = 0

    def add(self, lp: TokenLogprobs, offset: int) -> None:
        self.entries.append((lp, offset))

    def take(self) -> dict:
        part, self.taken = self.entries[self.taken:], len(self.entries)
        return self._body(part)

    def body(self) -> dict:
        return self._body(self.entries)

    def _body(self, entries: list[tuple]) -> dict:
        return _chat_logprobs(entries, self.decode) if self.chat else _logprobs_body(entries, self.decode)


def _logprobs_body(entries: list[tuple], decode) -> dict:
    """The legacy completions format: top_logprobs[i] maps the text of the asked-for most likely tokens and
    of the chosen token to their log-probabilities (a text shared by two tokens keeps the likelier)."""
    tops = []
    for lp, _ in entries:
        top: dict[str, float] = {}
        for token_id, logprob in lp.top:  # most likely first: a shared text keeps the likelier token
            top.setdefault(decode([token_id]), logprob)
        top.setdefault(decode([lp.token_id]), lp.logprob)
        tops.append(top)
    return {"tokens": [decode([lp.token_id]) for lp, _ in entries],
            "token_logprobs": [lp.logprob for lp, _ in entries], "top_logprobs": tops,
            "text_offset": [offset for _, offset in entries]}


def _chat_logprobs(entries: list[tuple], decode) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}
               for lp, _ in entries]
    return {"content": content, "refusal": None}


def choice_body(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One entry of a completion's ``choices``: {index, text, logprobs, finish_reason}."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(request_id: str, model: str, choices: list[dict], usage: dict | None) -> dict:
    """A ``text_completion`` object (the whole response, or one streamed chunk). choices: from
    ``choice_body``."""
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def usage_body(prompt_tokens: int, completion_tokens: int, speculative: tuple | None = None,
               cached_tokens: int = 0) -> dict:
    """OpenAI's usage object (prompt tokens counted once; completion tokens of every choice), with
    prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served (whole KV blocks, never the
    prompt's last token, which is computed for its logits); with ``speculative`` (proposed, accepted) summed
    over the choices, from a speculating engine, also "speculative": {"proposed": ..., "accepted": ...}
    (tokens proposed by the n-gram lookup and accepted)."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(cached_tokens)}}
    if speculative is not None:
        body["speculative"] = {"proposed": int(speculative[0]), "accepted": int(speculative[1])}
    return body


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code=None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
