"""Constrained decoding through the static KV cache: a host-stepped loop over one compiled step.

A grammar's token mask depends on every token before it, so the host must see each token before the next
step can run. A constrained batch therefore runs (an unconstrained one keeps ``decode``'s fully compiled
loop):
  1. ``masked_prefill``: the whole static cache is allocated and filled with the right-padded prompts (as
     ``decode.prefill``), and each row's first token is sampled from its masked logits.
  2. On the host: each constrained row's ``TokenMatcher`` advances with its token and writes the next mask
     row; an unconstrained row (constraint None) keeps the all-ones row, so its logits are never changed.
  3. ``masked_step``: every row's last token goes in at its own slot, and the next token is sampled from the
     masked logits; the cache is donated, so XLA updates it in place. Back to 2.
The mask is a traced [B, W] int32 input and the step number, sampling settings and seed are traced too, so
``masked_step`` compiles once per (batch size, model shape, dtype) whatever the grammars, and every grammar
shares it. Keys: step j samples with ``fold_in(key, j)``, as ``decode`` does, so with no constraint this loop
draws the same tokens as ``generate``.
A row ends when it samples one of its stop ids, when its grammar is complete and cannot go on while none of
its stop ids could end it (``TokenMatcher.ends_here``; finish reason "stop" without a stop token), or after
max_new_tokens ("length": the text is then a valid prefix of the grammar's language).
Shape letters: B batch, T prompt bucket, V vocabulary, W mask words.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from flax import nnx

from ..kv.cache import init_cache
from ..parallel.mesh import mesh_of, mesh_scope
from .decode import GenerationResult, _prepare, new_cache, place_on_mesh, split_model
from .grammar import Constraint, all_allowed_mask
from .sampling import SamplingParams, apply_token_mask, sample_next


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def masked_prefill(graphdef, params, ids, lengths, key, sampling: SamplingParams, token_mask, cache=None):
    """Fill the static cache with the prompts and sample each row's first token under its mask.
    ids: [B, T] int32; lengths: [B] int32; token_mask: [B, W] int32; cache: the empty cache
    (``decode.new_cache``, donated: only written pages become resident) or None to allocate it in the call.
    Returns (tokens [B] int32, cache)."""
    model = nnx.merge(graphdef, params)
    if cache is None:
        cache = init_cache(model.cfg, ids.shape[0])
    logits, cache, _ = model(ids, use_cache=True, kv_caches=cache, cache_index=0, logits_at=lengths - 1,
                             valid_tokens=lengths)
    masked = apply_token_mask(logits[:, 0], token_mask)
    return sample_next(masked, jax.random.fold_in(key, 0), sampling), cache


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def masked_step(graphdef, params, cache, token, index, step, key, sampling: SamplingParams, token_mask):
    """One decode step: token [B] int32 goes in at slot index [B] int32, the next token is sampled under
    token_mask [B, W] int32 with ``fold_in(key, step)`` (step: [] int32). Returns (tokens [B] int32, cache)."""
    model = nnx.merge(graphdef, params)
    logits, cache, _ = model(token[:, None], use_cache=True, kv_caches=cache, cache_index=index)
    masked = apply_token_mask(logits[:, 0], token_mask)
    return sample_next(masked, jax.random.fold_in(key, step), sampling), cache


class ConstrainedRows:
    """Host bookkeeping of the loop: every row's matcher, mask row, tokens and how it ended."""

    def __init__(self, constraints: list, stop_ids: tuple, vocab_size: int, max_new_tokens: int, fill: int):
        B = len(constraints)
        self.matchers = [None if c is None else c.matcher() for c in constraints]
        self.mask = all_allowed_mask(B, vocab_size)
        self.stop_ids = stop_ids
        self.out = np.full((B, max_new_tokens), fill, np.int32)
        self.lengths = np.zeros(B, np.int32)
        self.reasons: list = [None] * B
        for b, matcher in enumerate(self.matchers):
            if matcher is not None:
                matcher.fill_mask(self.mask[b])

    def take(self, tokens: np.ndarray) -> bool:
        """Record one step's tokens ([B] ints) of the rows still running and refresh their masks; True when
        every row has ended."""
        for b, token in enumerate(tokens.tolist()):
            if self.reasons[b] is None and not self.push(b, token):
                self.refresh(b)
        return all(r is not None for r in self.reasons)

    def push(self, b: int, token: int) -> bool:
        """Append ``token`` to running row b and advance its matcher (the mask row is not refreshed: see
        ``refresh``); True when the row has ended with it. RuntimeError when the grammar refuses the token."""
        n = int(self.lengths[b])
        self.out[b, n], self.lengths[b] = token, n + 1
        matcher = self.matchers[b]
        if token in self.stop_ids:
            self.reasons[b] = "stop"
        elif matcher is not None and not matcher.advance(token):
            raise RuntimeError(f"row {b} sampled token {token}, which its grammar refuses: {matcher.error}")
        elif matcher is not None and matcher.ends_here(self.stop_ids):
            self.reasons[b] = "stop"
        elif n + 1 == self.out.shape[1]:
            self.reasons[b] = "length"
        return self.reasons[b] is not None

    def refresh(self, b: int) -> None:
        """Write row b's mask of allowed next tokens (an unconstrained row keeps its all-ones row)."""
        if self.matchers[b] is not None:
            self.matchers[b].fill_mask(self.mask[b])


def check_constraints(constraints, B: int, V: int) -> None:
    """ValueError unless ``constraints`` is a list of B Constraints (or None) for a vocabulary of V tokens."""
    if not isinstance(constraints, (list, tuple)) or len(constraints) != B:
        raise ValueError(f"constraints: give one Constraint or None per row ({B} rows)")
    for c in constraints:
        if c is not None and (not isinstance(c, Constraint) or c.vocabulary.vocab_size != V):
            raise ValueError(f"constraints: {c!r} is not a Constraint for a vocabulary of {V} tokens")


def constrained_result(model, prompt_ids, constraints: list, max_new_tokens: int = 64, *, temperature=0.0,
                       top_k=0, top_p=1.0, seed: int = 0, eos_id=None, mesh=None,
                       on_tokens=None) -> GenerationResult:
    """Generate with one Constraint (or None: unconstrained) per row, through the host-stepped loop.

    Arguments as :func:`dantinox.generation.decode.generate_result` (prompt_ids: one prompt or a batch);
    constraints: a list of one ``dantinox.generation.grammar.Constraint`` or None per row, built for this
    model's tokenizer (a vocabulary of V = model.cfg.vocab_size tokens). on_tokens: called after every step
    with (step, tokens [B] int32 of that step), for streaming. Returns a GenerationResult (tokens [B, N];
    after a row ended: the first eos_id, or 0; finish_reasons "stop" or "length").
    Raises ValueError / CapacityError as generate_result, and ValueError when the constraints do not match
    the batch or the model's vocabulary.
    """
    place_on_mesh(model, mesh)
    req = _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    B, V = len(req.ids), model.cfg.vocab_size
    check_constraints(constraints, B, V)
    stops = tuple(int(e) for e in np.asarray(req.eos_id) if e >= 0)
    rows = ConstrainedRows(list(constraints), stops, V, req.max_new_tokens, int(req.fill))
    graphdef, params = split_model(model)
    with mesh_scope(mesh_of(params)):
        token, cache = masked_prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, rows.mask,
                                      new_cache(model.cfg, B, params))
        step = 0
        while True:
            tokens = np.asarray(token)
            if on_tokens is not None:
                on_tokens(step, tokens)
            if rows.take(tokens):
                break
            step += 1
            token, cache = masked_step(graphdef, params, cache, token, req.lengths + step - 1, np.int32(step),
                                       req.key, req.sampling, rows.mask)
    return GenerationResult(rows.out, rows.lengths, list(rows.reasons))
