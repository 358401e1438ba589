"""Structured outputs in the engine: each constrained request's matcher, the step's token mask, and how a
grammar ends a request (plain Python, numpy).

A request whose options carry a ``Constraint`` gets a ``TokenMatcher`` (``dantinox.generation.grammar``) the
first time one of its chunks samples a token; it lives on the request (``Request.matcher``) and advances with
every token the request generates. A preempted request drops it, and it is rebuilt from the request's output
tokens when the request samples again (whether it was recomputed or swapped), so the matcher always equals one
that has read exactly ``output_ids``.
Every compiled forward takes a [B, W] int32 mask (packed bits, ``dantinox.generation.sampling.
apply_token_mask``): all ones for padding rows, unconstrained rows and prefill chunks that do not reach their
request's last token, the matcher's allowed set for a constrained row that samples. So one compiled program
serves every grammar and every mix of constrained and free rows; a multi-step decode call (which cannot see the
host between its steps) is not used while a constrained request decodes (``step_plan.plan_decode_steps``).
"""

from __future__ import annotations

import numpy as np

from ..generation.grammar import GrammarError, TokenMatcher, all_allowed_mask
from .request import Request


def samples_now(req: Request, start: int, num_tokens: int) -> bool:
    """True when a chunk of ``num_tokens`` tokens from ``start`` reaches ``req``'s last token (its logits then
    give the request's next token)."""
    return start + num_tokens >= req.num_tokens


def matcher_of(req: Request) -> TokenMatcher:
    """``req``'s matcher, built (or rebuilt) from its output tokens when it has none or has read a different
    number of tokens. Raises GrammarError if the grammar refuses those tokens."""
    if req.matcher is None or req.matcher.consumed != len(req.output_ids):
        req.matcher = req.options.constraint.matcher(req.output_ids)
    return req.matcher


def step_mask(part: list, B: int, vocab_size: int) -> np.ndarray:
    """The token mask of one compiled call: [B, W] int32 for ``part`` (the call's chunks) padded to B rows."""
    mask = all_allowed_mask(B, vocab_size)
    for b, chunk in enumerate(part):
        req = chunk.request
        if req.options.constraint is not None and samples_now(req, chunk.start, chunk.num_tokens):
            matcher_of(req).fill_mask(mask[b])
    return mask


def grammar_finish(req: Request, token: int) -> tuple[str | None, str | None]:
    """Advance a constrained request's matcher with ``token`` (just appended to its output, which did not end
    it). Returns (finish reason, error): ("stop", None) when the grammar is complete and cannot go on while
    none of the request's stop ids may end it; ("error", message) if the grammar refused the token (the mask
    should make that impossible); (None, None) otherwise, and for an unconstrained request."""
    if req.options.constraint is None:
        return None, None
    matcher = req.matcher
    if matcher is not None and matcher.consumed == len(req.output_ids) - 1:
        if not matcher.advance(token):
            return "error", f"the sampled token {token} is not allowed by the request's grammar: {matcher.error}"
    else:
        try:
            matcher = matcher_of(req)
        except GrammarError as err:
            return "error", str(err)
    if matcher.ends_here(req.options.stop_token_ids):
        return "stop", None
    return None, None
