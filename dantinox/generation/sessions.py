"""A Generator's session: the static cache of its last one-prompt call, kept, continued, saved and loaded.

With sessions on (``Generator(keep_session=True)``, or after ``Generator.load_session``), a one-prompt call
(generate, complete, chat: plain decoding, no speculation or constraint) keeps its one-row static cache and the
tokens whose keys and values it holds (the prompt and every generated token but the last, which was sampled and
never fed). The next such call whose prompt starts with those tokens computes only the rest:
  1. ``reusable_prefix``: the longest common prefix m of the session's tokens and the new prompt, at most the
     prompt's length minus one (its last token is fed again for its logits) and, with per-channel int8 keys, cut
     to a key-group boundary (a group still filling lives in the residual ring, which holds only the last two
     groups: ``dantinox.kv.channel_layout``). A sliding-window layer kept as a ring (``dantinox.kv.ring``, R
     slots for a window of W) that the session's n tokens have wrapped holds positions n - R .. n - 1 only, and
     slot p mod R is read as position p: m must be at least n - (R - W), else nothing is reused;
  2. ``resume_prefill`` feeds prompt[m:] (right-padded to a length bucket) at slot m of the kept cache and
     samples the first new token; the compiled decode loop (``dantinox.generation.decode.decode``) goes on as
     after an ordinary prefill.
Slots past m still hold the old sequence's rows; every one of them is written before it is read (in a ring,
by the rule of step 1). The session file format and the layout check are ``dantinox.kv.sessions``'
(``save_static_session`` / ``load_static_session``). One device only (the kept cache is not placed on a mesh).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kv.cache import init_cache
from ..kv.spec import layer_specs
from ..parallel.distributed import to_host
from ..programs.store import stored_jit
from .decode import DecodeState, GenerationResult, _finish, _prepare, decode, decode_windows, new_cache, prefill
from .decode import split_model
from .prompts import bucket_length, is_eos
from .sampling import SamplingParams, sample_next


class Session(NamedTuple):
    """tokens: the token ids whose keys and values ``cache`` holds in slots [0, len(tokens)); cache: a one-row
    static cache (``init_cache(cfg, 1)``'s layout)."""

    tokens: list
    cache: tuple


@stored_jit(static_argnames=("graphdef",), donate_argnames=("cache",))
def resume_prefill(graphdef, params, ids, lengths, start, key, sampling: SamplingParams, eos_id, fill, cache):
    """``decode.prefill`` from slot ``start`` on: the new tokens ids [B, T] (right-padded; lengths [B] real ones)
    are written at slots start .. start + T - 1 ([B] int32) of a cache that holds the sequence's first ``start``
    tokens, and each row's first new token is sampled from its last real position. The cache is donated.
    Returns the initial DecodeState (step 1, index start + lengths)."""
    model = nnx.merge(graphdef, params)
    logits, cache, _ = model(ids, use_cache=True, kv_caches=cache, cache_index=start, logits_at=lengths - 1,
                             valid_tokens=lengths)
    first = sample_next(logits[:, 0], jax.random.fold_in(key, 0), sampling)
    out = jnp.full((ids.shape[0], model.cfg.max_context), fill, jnp.int32).at[:, 0].set(first)
    return DecodeState(jnp.int32(1), first, start + lengths, is_eos(first, eos_id), out, cache)


def reusable_prefix(cfg, session: Session | None, prompt: list[int]) -> int:
    """How many leading slots of ``session``'s cache the prompt may keep (module docstring, step 1)."""
    if session is None:
        return 0
    m = 0
    for a, b in zip(session.tokens, prompt):
        if a != b:
            break
        m += 1
    m = min(m, len(prompt) - 1)
    if cfg.channel_keys:
        m = m // cfg.key_group * cfg.key_group
    n = len(session.tokens)
    for spec in layer_specs(cfg):
        if spec.ring and n > spec.ring and m < n - (spec.ring - spec.window):
            return 0   # the ring no longer holds the window before slot m
    return max(m, 0)


def session_generate(model, session: Session | None, prompt: list[int], max_new_tokens: int, temperature=0.0,
                     top_k=0, top_p=1.0, seed: int = 0, eos_id=None) -> tuple[GenerationResult, Session, int]:
    """One prompt's generation that continues ``session`` where its tokens agree with the prompt (module
    docstring). Returns (the result as ``generate_result``'s, the new session, the prompt tokens taken from the
    old one). Raises as ``dantinox.generate`` (ValueError, CapacityError) before anything runs."""
    req = _prepare(model, [list(prompt)], max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    cfg, S = model.cfg, model.cfg.max_context
    graphdef, params = split_model(model)
    m = reusable_prefix(cfg, session, prompt)
    if m:
        rest = len(prompt) - m
        T = min(bucket_length(rest, S), S - m)
        ids = np.zeros((1, T), np.int32)
        ids[0, :rest] = prompt[m:]
        state = resume_prefill(graphdef, params, ids, np.array([rest], np.int32), np.array([m], np.int32),
                               req.key, req.sampling, req.eos_id, req.fill, session.cache)
    else:
        cache = new_cache(cfg, 1, params)
        state = prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill,
                        init_cache(cfg, 1) if cache is None else cache)
    if req.max_new_tokens > 1:
        state = decode(graphdef, params, state, jnp.int32(req.max_new_tokens), req.key, req.sampling, req.eos_id,
                       req.fill, windows=decode_windows(cfg, 1, len(prompt) + req.max_new_tokens))
    result = _finish(to_host(state.out), req)
    generated = result.tokens[0, :int(result.lengths[0])].tolist()
    return result, Session(list(prompt) + generated[:-1], state.cache), m
