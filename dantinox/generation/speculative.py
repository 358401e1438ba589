"""Speculative decoding with n-gram proposals through the static KV cache: one compiled loop.

Each iteration of the loop proposes k tokens per row by prompt lookup (``ngram.propose_ngram``) and verifies
them in one forward of the target over [last token, d_1 .. d_k] at each row's own cache slot: T = k + 1 new
tokens, keys and values written at slots index .. index + k. From the target's logits at the k + 1 positions:

  greedy      accept the longest prefix of proposals equal to the target's argmax, then emit the target's own
              next token: the output is token for token what plain greedy decoding gives.
  sampling    the rejection rule of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
              Decoding", section 2.3) and Chen et al. 2023 (algorithm 2) with a point-mass proposal q = d:
              accept d_j with probability p_j(d_j); at the first rejection draw from the residual
              max(p_j - q_j, 0) normalised, i.e. p_j without d_j; when all k are accepted draw one more token
              from p_{k+1}. p is the target's distribution after temperature, top-k and top-p
              (``sampling.filtered_probs``), so the output distribution is the target's.

The cache needs no rollback: after a emitted tokens the row's index moves by a, the slots past it hold keys
of rejected proposals that no query reads (attention sees only slots below a query's own position) and the
next call overwrites them. A row emits at most its remaining budget and stops at its first stop id.
When no row has a proposal (no n-gram match), the iteration is one plain decode step instead (``lax.cond``):
speculation switches itself off where lookup finds nothing. It also switches off where it measurably loses: a
verify call costs c times a plain step (c > 1, measured by ``speculative_generate.verify_cost``) and emits
1 + a tokens for a accepted proposals, so it pays only while a > c - 1 = ``min_accept``. After PROBE_VERIFIES
verify calls a row whose accepted proposals per verify call fall below min_accept stops proposing for the rest
of the request (min_accept 0: never; the iteration verifies while any live row still has a proposal and pays);
once no live row pays, the loop leaves the speculative body (its ``lax.cond``) and the host hands the request to
the compiled ``decode`` loop (``speculative_generate.hand_off``; a ragged batch finishes in this program's own
plain loop instead).
Near the end of the cache (fewer than k + 1 free slots) the loop finishes with plain steps. k, the n-gram bounds
and the batch size are static; the step bound, sampling settings, seed, stop ids and min_accept are traced, so
one program serves every request of that shape.

Shapes: B batch, S max_context, V vocabulary, k proposed tokens.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..kv.static import KVCache
from .draft import propose_draft
from .ngram import propose_ngram
from .prompts import is_eos
from .sampling import GREEDY_TEMPERATURE, SamplingParams, filtered_probs, greedy_argmax, sample_next

MAX_SPEC_TOKENS = 16
PROBE_VERIFIES = 8   # verify calls a row makes before its measured acceptance can switch speculation off


class SpecState(NamedTuple):
    """Loop state of the speculative loop (a pytree)."""

    produced: jax.Array   # [B] int32: tokens generated per row; out[b, :produced[b]] is filled
    token: jax.Array      # [B] int32: newest token, not yet in the cache
    index: jax.Array      # [B] int32: cache slot (and seq position) of `token`
    done: jax.Array       # [B] bool: the row met a stop id (a row is live while not done and below the step bound)
    out: jax.Array        # [B, S] int32: generated tokens
    seq: jax.Array        # [B, S] int32: prompt + generated tokens, valid at 0..index
    cache: KVCache
    iteration: jax.Array  # [] int32: loop iterations (the PRNG stream of each)
    proposed: jax.Array   # [B] int32: proposals verified
    accepted: jax.Array   # [B] int32: proposals accepted
    verify_calls: jax.Array  # [] int32: iterations that verified (the rest were plain steps)
    draft_cache: KVCache | None = None   # the draft model's cache (draft proposals only; ``draft``)


@partial(jax.jit, donate_argnames=("state",))
def spec_state(state, ids) -> SpecState:
    """The SpecState after ``decode.prefill``'s DecodeState ``state`` (donated: its cache moves in, not copied);
    ids: [B, T] padded prompts. One small program per (B, T)."""
    B, S = state.out.shape
    seq = jnp.zeros((B, S), jnp.int32).at[:, : ids.shape[1]].set(ids)
    seq = seq.at[jnp.arange(B), state.index].set(state.token)
    produced = jnp.ones((B,), jnp.int32)
    return SpecState(produced, state.token, state.index, state.done, state.out, seq,
                     state.cache, jnp.zeros((), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32),
                     jnp.zeros((), jnp.int32))   # distinct buffers: the state is donated


def accept_proposals(logits, proposals, key, sampling: SamplingParams, limit=None, q=None
                     ) -> tuple[jax.Array, jax.Array]:
    """The tokens to emit and how many proposals were accepted.

    logits: [B, k + 1, V] float32 (the target at the last token and each proposal); proposals: [B, k] int32;
    key: one PRNG key for the batch, or [B] keys, one per row (each row then draws from its own stream, as the
    serving engine's rows do); sampling: per-row settings ([B]); limit: None, or [B] int32 in 0..k, the
    proposals of each row that may be accepted (the rest are no proposals: with all ``limit[b]`` accepted the
    next token is drawn from the whole distribution at position limit[b], as when all k are accepted); q:
    [B, k, V] float32, the distribution each proposal was drawn from (a draft model's), or None for a point
    mass on it (n-gram).
    Returns (tokens [B, k + 1] int32: the accepted proposals then the target's token at the first rejection, or
    the extra token when all were accepted; accepted [B] int32 in 0..limit). Greedy rows take the argmax rule,
    sampled rows the rejection rule: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), at the first
    rejection draw from max(p_j - q_j, 0) normalised (module docstring)."""
    k = logits.shape[1] - 1
    if limit is not None:
        proposals = jnp.where(jnp.arange(k)[None, :] < limit[:, None], proposals, -1)
        if q is not None:   # no proposal past limit: q is 0 there, so all limit accepted draws from p itself
            q = jnp.where((jnp.arange(k)[None, :] < limit[:, None])[..., None], q, 0.0)
    greedy = sampling.temperature <= GREEDY_TEMPERATURE
    return jax.lax.cond(jnp.all(greedy), lambda: _greedy_accept(logits, proposals),
                        lambda: _rejection_accept(logits, proposals, key, sampling, q))


def _greedy_accept(logits, proposals) -> tuple[jax.Array, jax.Array]:
    """accept_proposals when every row is greedy: the proposals equal to the argmax, then the argmax at the first
    mismatch (or past the last proposal). One argmax over [B, k + 1, V]; the same tokens and count as the
    rejection rule over point masses (tested), which makes several passes over the vocabulary."""
    top = greedy_argmax(logits)                                                            # [B, k + 1]
    k = proposals.shape[1]
    ok = (proposals == top[:, :k]) & (proposals >= 0)
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    last = jnp.take_along_axis(top, accepted[:, None], axis=1)
    tokens = jnp.concatenate([jnp.maximum(proposals, 0), jnp.zeros_like(last)], axis=1)
    return jnp.where(jnp.arange(k + 1)[None, :] == accepted[:, None], last, tokens), accepted


def _rejection_accept(logits, proposals, key, sampling: SamplingParams, q) -> tuple[jax.Array, jax.Array]:
    """accept_proposals by the rejection rule (module docstring): proposals past a row's limit are -1 here."""
    B, T, V = logits.shape
    k = T - 1
    rep = SamplingParams(*(jnp.repeat(x, T) for x in sampling))
    probs = filtered_probs(logits.reshape(B * T, V), rep).reshape(B, T, V)
    per_row = jnp.ndim(key) == 1
    key_u, key_r = jax.vmap(jax.random.split, out_axes=1)(key) if per_row else jax.random.split(key)
    uniform = (jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(key_u) if per_row
               else jax.random.uniform(key_u, (B, k)))
    p_proposed = jnp.take_along_axis(probs[:, :k], jnp.maximum(proposals, 0)[..., None], axis=-1)[..., 0]
    q_proposed = 1.0 if q is None else jnp.take_along_axis(q, jnp.maximum(proposals, 0)[..., None], axis=-1)[..., 0]
    ok = (uniform * q_proposed < p_proposed) & (proposals >= 0)   # [B, k]
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    at = jnp.take_along_axis(probs, accepted[:, None, None], axis=1)[:, 0]                 # [B, V]
    if q is None:
        rejected = jnp.take_along_axis(jnp.pad(proposals, ((0, 0), (0, 1)), constant_values=-1),
                                       accepted[:, None], axis=1)[:, 0]
        residual = jnp.where(jnp.arange(V)[None, :] == rejected[:, None], 0.0, at)
    else:   # q past the last proposal is 0: all accepted draws from p_{k+1} itself
        q_at = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), accepted[:, None, None], axis=1)[:, 0]
        residual = jnp.maximum(at - q_at, 0.0)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, at)   # p == q (rounding)
    greedy_like = greedy_argmax(residual)
    greedy = sampling.temperature <= GREEDY_TEMPERATURE

    def draw():   # a Gumbel draw over the vocabulary per row (greedy rows of a mixed batch keep the argmax)
        scores = jnp.where(residual > 0, jnp.log(residual), -1e30)
        drawn = jax.vmap(jax.random.categorical)(key_r, scores) if per_row else jax.random.categorical(key_r, scores)
        return jnp.where(greedy, greedy_like, drawn.astype(jnp.int32))

    last = draw()
    tokens = jnp.concatenate([jnp.maximum(proposals, 0), jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(T)[None, :] == accepted[:, None], last[:, None], tokens)
    return tokens.astype(jnp.int32), accepted


def _emit(s: SpecState, tokens, count, stop_step, eos_id, fill) -> SpecState:
    """Append the first ``count`` [B] of ``tokens`` [B, n] to each live row, cut at its first stop id and
    at its budget; the newest becomes ``token``."""
    B, n = tokens.shape
    j = jnp.arange(n)[None, :]
    count = jnp.where(_live(s, stop_step), jnp.minimum(count, stop_step - s.produced), 0)
    hit = is_eos(tokens.reshape(-1), eos_id).reshape(B, n) & (j < count[:, None])
    first = jnp.argmax(hit, axis=1).astype(jnp.int32)
    stopped = jnp.any(hit, axis=1)
    count = jnp.where(stopped, first + 1, count)
    rows = jnp.arange(B)[:, None]
    write = j < count[:, None]
    out = s.out.at[rows, jnp.where(write, s.produced[:, None] + j, s.out.shape[1])].set(tokens, mode="drop")
    seq = s.seq.at[rows, jnp.where(write, s.index[:, None] + 1 + j, s.seq.shape[1])].set(tokens, mode="drop")
    newest = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    produced = s.produced + count
    return s._replace(produced=produced, token=jnp.where(count > 0, newest, s.token), index=s.index + count,
                      done=s.done | stopped, out=out, seq=seq)


def _pays(s: SpecState, k: int, min_accept) -> jax.Array:
    """[B] bool: rows for which verifying still pays: fewer than PROBE_VERIFIES verify calls so far, or at least
    min_accept ([] float32) accepted proposals per verify call (module docstring)."""
    calls = s.proposed // k
    return (calls < PROBE_VERIFIES) | (s.accepted.astype(jnp.float32) >= min_accept * calls.astype(jnp.float32))


def _live(s: SpecState, stop_step) -> jax.Array:
    """[B] bool: rows still generating (no stop id yet, fewer than stop_step tokens)."""
    return ~s.done & (s.produced < stop_step)


@partial(jax.jit, static_argnames=("graphdef", "k", "ngram_max", "ngram_min", "draft_graphdef"),
         donate_argnames=("state",))
def speculative_decode(graphdef, params, state: SpecState, stop_step, key, sampling: SamplingParams, eos_id, fill,
                       k: int, ngram_max: int, ngram_min: int, min_accept=None, plain_tail=None,
                       draft_graphdef=None, draft_params=None) -> SpecState:
    """Run the speculative loop until every row met a stop id or has ``stop_step`` tokens; one compiled program
    (a later call with a larger stop_step continues the same state: streaming).
    stop_step, eos_id, fill: [] int32 (eos_id may be [E]); k, ngram_max, ngram_min: static; min_accept: []
    float32, the switch-off threshold (accepted proposals per verify call; None = 0.0, never off); plain_tail:
    [] bool (None = True), whether the rows still live once speculation stopped paying (or the cache has no room
    for k + 1 more slots) finish here with plain steps over the whole cache; False returns them to the caller,
    which hands them to the compiled ``decode`` loop (its attention windows make those steps cheaper:
    ``speculative_generate.hand_off``). draft_graphdef (static) / draft_params: a draft model proposes instead
    of prompt lookup (``draft.propose_draft``; state.draft_cache holds its cache; the n-gram bounds are unused):
    every iteration of the speculative loop then verifies. Returns the advanced SpecState (the input is
    donated)."""
    min_accept = jnp.float32(0.0) if min_accept is None else min_accept
    plain_tail = jnp.bool_(True) if plain_tail is None else plain_tail
    model = nnx.merge(graphdef, params)
    S = model.cfg.max_context

    def plain(s: SpecState) -> SpecState:
        logits, cache, _ = model(s.token[:, None], use_cache=True, kv_caches=s.cache, cache_index=s.index)
        token = sample_next(logits[:, 0], jax.random.fold_in(key, s.iteration + 1), sampling)
        s = _emit(s._replace(cache=cache), token[:, None], jnp.ones_like(s.produced), stop_step, eos_id, fill)
        return s._replace(iteration=s.iteration + 1)

    def verify(s: SpecState, proposals, q=None, ikey=None) -> SpecState:
        inputs = jnp.concatenate([s.token[:, None], proposals], axis=1)
        logits, cache, _ = model(inputs, use_cache=True, kv_caches=s.cache, cache_index=s.index)
        ikey = jax.random.fold_in(key, s.iteration + 1) if ikey is None else ikey
        tokens, accepted = accept_proposals(logits, proposals, ikey, sampling, q=q)
        live = _live(s, stop_step)
        before = s.produced
        s = _emit(s._replace(cache=cache), tokens, accepted + 1, stop_step, eos_id, fill)
        used = jnp.maximum(s.produced - before - 1, 0)
        return s._replace(iteration=s.iteration + 1, verify_calls=s.verify_calls + 1,
                          proposed=s.proposed + jnp.where(live, k, 0), accepted=s.accepted + jnp.where(live, used, 0))

    def draft_body(s: SpecState) -> SpecState:
        key_draft, key_accept = jax.random.split(jax.random.fold_in(key, s.iteration + 1))
        proposals, q, draft_cache = propose_draft(draft, s.draft_cache, s.seq, s.token, s.index, key_draft,
                                                  sampling, k)
        return verify(s._replace(draft_cache=draft_cache), proposals, q, key_accept)

    def body(s: SpecState) -> SpecState:
        proposals, found = propose_ngram(s.seq, s.index, k, ngram_max, ngram_min)
        verifying = jnp.any(found & _live(s, stop_step) & _pays(s, k, min_accept))
        return jax.lax.cond(verifying, lambda: verify(s, proposals), lambda: plain(s))

    def room(s: SpecState):   # every live row has k + 1 free slots (a finished row's writes are never read)
        live = _live(s, stop_step)   # and speculation still pays for one of them: else the plain loop below
        return jnp.any(live & _pays(s, k, min_accept)) & (jnp.max(jnp.where(live, s.index, 0)) + k + 1 <= S)

    draft = None if draft_graphdef is None else nnx.merge(draft_graphdef, draft_params)
    state = jax.lax.while_loop(room, body if draft is None else draft_body, state)
    return jax.lax.while_loop(lambda s: plain_tail & jnp.any(_live(s, stop_step)), plain, state)
