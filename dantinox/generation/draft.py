"""Draft-model proposals for speculative decoding, computed inside the compiled speculative loop.

A draft is a second (smaller) autoregressive model over the same vocabulary with its own static KV cache, kept
in step with the target's: both caches use the same slot for the same sequence position. One proposal round at
a row whose newest token t sits at slot i (not yet in either cache):

  1. feed [seq[i - 1], t] at slots i - 1, i (T = 2): slot i - 1 is written again with the token it already
     holds, which also covers the round before accepting all k proposals (its last proposal d_k was never fed
     to the draft); the logits at t give q_1;
  2. draw d_1 from q_1, feed it at slot i + 1 for q_2, ... up to d_k (k - 1 one-token forwards in a
     ``lax.scan``; k is static).

After verification the row's index moves by the tokens emitted; the draft's slots below the new index hold the
accepted tokens (what it fed) and those past it are overwritten by the next round, as for the target. q_j is
the draft's distribution after the row's temperature, top-k and top-p (``sampling.filtered_probs``; a greedy
row's is the point mass on the draft's argmax), which the rejection rule of ``speculative.accept_proposals``
reads. Shapes: B batch, S slots, V vocabulary, k proposed tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .sampling import GREEDY_TEMPERATURE, SamplingParams, filtered_probs, greedy_argmax


def draw(probs: jax.Array, key: jax.Array, sampling: SamplingParams) -> jax.Array:
    """One token per row from probs [B, V] float32: the argmax for greedy rows, else a draw. Returns [B] int32."""
    drawn = jax.random.categorical(key, jnp.where(probs > 0, jnp.log(probs), -1e30), axis=-1)
    greedy = sampling.temperature <= GREEDY_TEMPERATURE
    return jnp.where(greedy, greedy_argmax(probs), drawn).astype(jnp.int32)


def propose_draft(draft, cache, seq: jax.Array, token: jax.Array, index: jax.Array, key: jax.Array,
                  sampling: SamplingParams, k: int):
    """k proposals per row from the draft model (module docstring).

    draft: the merged draft Transformer; cache: its KVCache ([B, ..., S, ...] per layer); seq: [B, S] int32
    tokens, valid below index; token: [B] int32 newest token; index: [B] int32 its slot (>= 1: a prompt has a
    token); key: PRNG key; sampling: per-row settings ([B]); k: static >= 1. Returns (proposals [B, k] int32,
    q [B, k, V] float32: each proposal's draft distribution, cache: the draft's cache with slots
    index - 1 .. index + k - 1 written)."""
    B = token.shape[0]
    prev = seq[jnp.arange(B), index - 1]
    logits, cache, _ = draft(jnp.stack([prev, token], axis=1), use_cache=True, kv_caches=cache,
                             cache_index=index - 1)
    keys = jax.random.split(key, k)
    q = filtered_probs(logits[:, 1], sampling)
    d = draw(q, keys[0], sampling)

    def step(carry, j):
        d, q, cache = carry
        logits, cache, _ = draft(d[:, None], use_cache=True, kv_caches=cache, cache_index=index + 1 + j)
        q_next = filtered_probs(logits[:, 0], sampling)
        return (draw(q_next, keys[j + 1], sampling), q_next, cache), (d, q)

    (d, q, cache), (ds, qs) = jax.lax.scan(step, (d, q, cache), jnp.arange(k - 1))
    proposals = jnp.concatenate([jnp.moveaxis(ds, 0, 1), d[:, None]], axis=1)
    return proposals.astype(jnp.int32), jnp.concatenate([jnp.moveaxis(qs, 0, 1), q[:, None]], axis=1), cache
