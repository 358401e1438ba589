"""One request: its options, its tokens and where it stands (plain Python).

The engine never keeps a "phase" for a request. It keeps two numbers: ``num_tokens`` (prompt + generated)
and ``num_computed`` (how many of those have their keys and values in the cache). A step feeds tokens
``all_tokens[num_computed : num_computed + n]``; when that reaches the last token, the step's logits give the
next token. Prefill, chunked prefill, decode and re-prefill after a recompute preemption (num_computed reset
to 0 while the generated tokens are kept) are all the same operation.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..generation.grammar import Constraint
from ..generation.sampling import temperature_problem

FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's limit for chat top_logprobs)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a request longer than the context


class RequestError(ValueError):
    """A request is invalid or can never be served. ``field`` names the offending input; ``code`` is OpenAI's
    error code for it when there is one (CONTEXT_LENGTH_EXCEEDED), else None."""

    def __init__(self, field: str, message: str, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request generation settings.

    max_new_tokens: tokens to generate (>= 1).  temperature: >= 0, 0 = greedy.  top_k: >= 0, 0 = off.
    top_p: in (0, 1], 1 = off.  seed: in [0, 2**32): the request's PRNG stream (the same tokens as
    ``dantinox.generate`` with that seed).  stop_token_ids: generation ends after any of these ids
    (finish reason "stop"; the id is part of the output).  logprobs: None, or 0..MAX_LOGPROBS: each output
    token then carries its log-probability and that many most likely alternatives (``TokenLogprobs``).
    constraint: None, or a ``dantinox.generation.grammar.Constraint`` (structured outputs): every token is
    then drawn from the tokens its grammar allows (``dantinox.serving.grammar_rows``).
    logit_bias: (token id, bias) pairs, at most MAX_LOGIT_BIAS, each bias in [-100, 100], added to the token's
    logit before sampling (OpenAI's ``logit_bias``; -100 in effect bans a token, +100 forces it); a request with
    one runs single-step calls.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple = ()
    logprobs: int | None = None
    constraint: Constraint | None = None
    logit_bias: tuple = ()

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError naming the field, the value and what is allowed."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RequestError("max_tokens", f"max_tokens={self.max_new_tokens!r} is not allowed: an "
                               "integer >= 1")
        problem = temperature_problem(self.temperature)
        if problem is not None:
            raise RequestError("temperature", f"temperature={self.temperature!r} is not allowed: {problem}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError("top_k", f"top_k={self.top_k!r} is not allowed: an integer >= 0 (0 = off)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise RequestError("top_p", f"top_p={p!r} is not allowed: a number in (0, 1]")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise RequestError("seed", f"seed={self.seed!r} is not allowed: an integer in [0, 2**32)")
        for token in self.stop_token_ids:
            if not _is_int(token) or not 0 <= token < vocab_size:
                raise RequestError("stop_token_ids", f"stop token id {token!r} is not allowed: an integer in "
                                   f"[0, {vocab_size})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError("logprobs", f"logprobs={self.logprobs!r} is not allowed: null or an integer in "
                               f"[0, {MAX_LOGPROBS}]")
        check_logit_bias(self.logit_bias, vocab_size)
        if self.constraint is not None and (not isinstance(self.constraint, Constraint)
                                            or self.constraint.vocabulary.vocab_size != vocab_size):
            raise RequestError("constraint", f"constraint={self.constraint!r} is not allowed: None or a Constraint "
                               f"built for this model's vocabulary of {vocab_size} tokens")


MAX_LOGIT_BIAS = 300   # (token, bias) pairs one request may give (OpenAI's own limit is undocumented)


def no_bias(B: int, vocab_size: int) -> tuple:
    """The forward call's logit-bias arguments for B rows without biases: (ids [B, MAX_LOGIT_BIAS] int32 all V,
    values [B, MAX_LOGIT_BIAS] float32 zeros)."""
    return np.full((B, MAX_LOGIT_BIAS), vocab_size, np.int32), np.zeros((B, MAX_LOGIT_BIAS), np.float32)


def check_logit_bias(pairs, vocab_size: int) -> None:
    """RequestError("logit_bias", ...) unless ``pairs`` are at most MAX_LOGIT_BIAS (token id in [0, V), bias a
    finite number in [-100, 100]) pairs."""
    if len(pairs) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"logit_bias has {len(pairs)} entries; allowed: at most {MAX_LOGIT_BIAS}")
    for token, bias in pairs:
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise RequestError("logit_bias", f"logit_bias token {token!r} is not allowed: a token id in "
                               f"[0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError("logit_bias", f"logit_bias[{token}]={bias!r} is not allowed: a number in "
                               "[-100, 100]")


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued: never started, or preempted with recompute (num_computed = 0)
    RUNNING = "running"      # holds blocks and is scheduled every step
    SWAPPED = "swapped"      # preempted with swap: its blocks' contents wait in host memory
    FINISHED = "finished"


@dataclass
class Request:
    """A request inside the engine. Times are ``time.perf_counter()`` seconds."""

    request_id: str
    prompt_ids: list
    options: SamplingOptions
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list = field(default_factory=list)
    num_computed: int = 0            # tokens of all_tokens whose keys/values are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0       # prompt tokens served by the prefix cache at the last admission
    num_prompt_cached: int = 0       # prompt tokens not computed at the first admission: the prefix cache's hit
                                     # as far as the scheduler used it (whole blocks, at most the prompt - 1)
    swap_data: Any = None            # host copy while SWAPPED: (per layer a tuple of its block arrays, numpy;
                                     # the int8 sink slot's rows per layer, or None)
    prompt_parent: "Request | None" = None  # a request with the same prompt whose prompt blocks this one
                                     # waits for and reuses from the prefix cache (n > 1 choices)
    first_token_time: float | None = None
    last_token_time: float | None = None
    events: list = field(default_factory=list)  # ("chunk", start, n), ("token", id), ("preempt", policy), ...
    matcher: Any = None              # the TokenMatcher of options.constraint, advanced with output_ids; None
                                     # until first needed and after a preemption (then rebuilt from them)
    spec: Any = None                 # speculation.SpecRowStats of a speculative engine (None until it verifies)

    @property
    def all_tokens(self) -> list:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability under the model's raw distribution: log_softmax of the logits
    before temperature, top-k and top-p (so a sampled token's figure is not the probability it was drawn
    with).

    token_id: the generated token.  logprob: log p(token_id), float.  top: the most likely tokens as
    ((token id, log p), ...), most likely first, as many as the request's ``logprobs`` option asked for
    (the generated token is among them only if it is that likely).
    """

    token_id: int
    logprob: float
    top: tuple = ()


@dataclass
class RequestOutput:
    """What one engine step produced for one request.

    new_token_ids: tokens generated in this step (0 or 1 of them).  finished: no more output will come;
    finish_reason is then one of FINISH_REASONS and error holds the message for "error".  logprobs: one
    TokenLogprobs per new token when the request asked for logprobs, else None.  speculative: (proposed,
    accepted), the request's speculative proposals so far, from an engine that speculates (None otherwise).
    num_cached_tokens: prompt tokens the prefix cache served at the request's first admission (not computed
    again; ``Request.num_prompt_cached``), as OpenAI's ``usage.prompt_tokens_details.cached_tokens``.
    """

    request_id: str
    new_token_ids: list
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list | None = None
    speculative: tuple | None = None
    num_cached_tokens: int = 0   # prompt tokens whose keys and values came from the prefix cache (first admission)
