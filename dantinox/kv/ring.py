"""A sliding-window layer's static cache as a ring: W plus a little slack slots instead of max_context.

A layer that attends only to the last W tokens (``LayerSpec.kind == "sliding"``; Gemma 3 keeps five such layers
of 512 tokens beside each global one, Mistral every layer) never reads a key older than W positions, so its
cache keeps R = min(max_context, W + RING_SLACK) slots and position p lives in slot p mod R (llama.cpp keeps a
second, window-sized cache for such layers; vLLM frees their pages behind the window). Attention still reads
before it writes, so the old slots it reads are the ring as the previous call left it: slot s holds position
p(s) = (c - 1) - ((c - 1 - s) mod R) for a row whose cache_index is c (a negative p: never written), and a query
at position c + i sees it when p(s) lies in the window (c + i - W < p(s) < c, p(s) at or past the row's first
real slot, past its A float32 sinks, which are read from the sink arrays as in a full cache). A call of T new
tokens writes the last min(T, R) of its real tokens (right padding and older tokens are dropped), so any chunk
length works; the slack covers a speculative verify call of up to RING_SLACK tokens whose rejected tail is
rewritten later: the positions it overwrote are older than any query that follows can see.

The numbers equal the full cache's: the same keys and values enter the same softmax, only stored elsewhere
(tests/kv/test_ring.py compares both at every position across the window edge). Shape letters: see
``dantinox.kv.attend``; R ring slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .attend import NEG_INF, new_token_mask, sink_mask
from .scores import grouped_scores, grouped_values
from .sinks import write_sinks

RING_SLACK = 64   # ring slots past the window: the longest speculative write a ring keeps the window through


def ring_slots(window: int, max_context: int) -> int:
    """R for a window of W tokens in a context of max_context: min(max_context, W + RING_SLACK)."""
    return min(int(max_context), int(window) + RING_SLACK)


def ring_positions(cache_index, R: int) -> jax.Array:
    """The position each ring slot holds before a call at cache_index ([B] int32): [B, R] int32, negative for a
    slot not written yet."""
    s = jnp.arange(R, dtype=jnp.int32)[None]
    last = cache_index.astype(jnp.int32)[:, None] - 1
    return last - jnp.mod(last - s, R)


def ring_attend(spec, q, k, v, layer, cache_index, key_start, causal: bool = True) -> jax.Array:
    """Softmax attention of q over [sinks ; the ring's visible slots ; the new tokens] (module docstring).

    q: [B, K, G, T, D] scaled; k, v: [B, K, T, D] as the codec lets attention see them; layer: the ring layer
    (a static layer type of R slots with ``read``) or None (the uncached forward); cache_index: [B] int32;
    key_start: [B] int32 or None. Returns [B, K, G, T, D] float32."""
    T, W = q.shape[3], spec.window
    parts = [(grouped_scores(q, k), new_token_mask(T, cache_index, key_start, W, causal), v)]
    if layer is not None:
        old, sinks = layer.read(q.dtype)
        R = old.k.shape[2]
        A = 0 if sinks is None else sinks.k.shape[2]
        start = jnp.zeros_like(cache_index) if key_start is None else key_start
        pos = ring_positions(cache_index, R)[:, None, :]                           # [B, 1, R]
        query = cache_index[:, None, None] + jnp.arange(T)[None, :, None]          # [B, T, 1]
        seen = (pos >= start[:, None, None] + A) & (pos < cache_index[:, None, None]) & (query - pos < W)
        parts.append((grouped_scores(q, old.k.astype(q.dtype)), seen, old.v))
        if A:
            parts.append((grouped_scores(q, sinks.k.astype(q.dtype)), sink_mask(A, T, cache_index, key_start, W),
                          sinks.v))
    scores = jnp.concatenate([jnp.where(m[:, None, None], s, NEG_INF) for s, m, _ in parts], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    y, at = 0.0, 0
    for s, _, values in parts:
        n = s.shape[-1]
        y = y + grouped_values(probs[..., at:at + n].astype(q.dtype), values.astype(q.dtype))
        at += n
    return y


def ring_write(layer, stored: tuple, cache_index, key_start, valid=None):
    """The ring layer with the new rows written at slots (cache_index + t) mod R: ``stored`` one array per row
    field ([B, ..., T, W], slot axis second to last) and, for an int8 layer, the full rows for its sinks
    (``dantinox.kv.sinks.write_sinks``); valid: [B] int32 real new tokens (right padding after them) or None
    (all T). Only the last min(valid, R) real tokens are written (an earlier one's slot is taken by a later one).
    Returns the layer, same type."""
    rows = len(layer) - getattr(layer, "SINK_FIELDS", 0)
    R, T = layer[0].shape[-2], stored[0].shape[-2]
    count = jnp.full(cache_index.shape, T, jnp.int32) if valid is None else valid.astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)[None]
    keep = (t < count[:, None]) & (t >= count[:, None] - R)                        # [B, T]
    slot = jnp.where(keep, jnp.mod(cache_index[:, None] + t, R), R)                # R: dropped

    def put(cache, new):
        new = new.astype(cache.dtype)
        moved = jnp.moveaxis(cache, -2, 1), jnp.moveaxis(new, -2, 1)               # slot axis second
        out = jax.vmap(lambda c, n, i: c.at[i].set(n, mode="drop"))(*moved, slot)
        return jnp.moveaxis(out, 1, -2)

    sinks = (write_sinks(c, r, cache_index, key_start) for c, r in zip(layer[rows:], stored[rows:]))
    return type(layer)(*(put(c, r) for c, r in zip(layer[:rows], stored[:rows])), *sinks)
