"""Softmax attention over a KV cache and its masks, shared by every attention kind and storage form.

Shape legend (used throughout the package; no letter is reused):
  B batch            T new tokens in this call      S cache slots (max_context)
  H query heads      K KV heads                      G = H // K query heads per KV head
  D head size        E model width (dim)             V vocabulary
  C MLA latent width (kv_latent_dim)   R MLA RoPE width (rope_head_dim)   Q MLA query latent (q_latent_dim)
  A attention-sink tokens an int8 cache keeps in float32 (cfg.sink_slots)
  N blocks in a paged pool   P tokens per block   M block-table entries per sequence

Cached calls attend over the *old* cache (slots written before this call) plus the T new keys and values,
then write the new keys and values into the cache. Attending before writing lets XLA update the cache
buffers in place inside the compiled decode loop instead of copying them every step.

Masks. For row b with ``cache_index[b] = c`` and ``key_start[b] = p`` (left-padding slots, default 0),
the query in new position i sits in slot c + i and may see
  - cache slot s when p <= s < c (and c + i - s < window when a sliding window is set);
  - new position j when j <= i and c + j >= p (and i - j < window).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .decode_kernel import decode_attention, decode_kernel_applies, visible_slots
from .prefill_attention import prefill_attention, prefill_kernel_applies
from .scores import grouped_scores, grouped_values
from .static import LayerKV, first_slots

NEG_INF = -1e30


def old_slots(layer_cache, read_slots: int | None):
    """The part of a static layer cache a call attends over: None when ``layer_cache`` is None or read_slots
    is 0, the whole cache when read_slots is None, else the first read_slots slots of every array (a static
    slice along S: [B, K, L, D] for LayerKV, [B, L, C] and [B, L, R] for LatentKV; ``cache.first_slots``)."""
    if layer_cache is None or read_slots == 0:
        return None
    if read_slots is None:
        return layer_cache
    return first_slots(layer_cache, read_slots)


def new_token_mask(T: int, cache_index, key_start, window: int | None, causal: bool = True) -> jax.Array:
    """May new query i see new key j? [1 or B, T, T] bool (causal, sliding window, left padding).

    cache_index: [B] int32; key_start: [B] int32 or None. causal=False (paradigm="diffusion") lets every
    query see every new key (bidirectional) except left padding.
    """
    i = jnp.arange(T)[:, None]
    j = jnp.arange(T)[None, :]
    mask = (j <= i)[None] if causal else jnp.ones((1, T, T), bool)      # [1, T, T]
    if window is not None:
        mask = mask & ((i - j) < window)[None]
    if key_start is not None:
        mask = mask & ((cache_index[:, None, None] + j[None]) >= key_start[:, None, None])
    return mask


def old_slot_mask(S: int, T: int, cache_index, key_start, window: int | None, sinks: int = 0) -> jax.Array:
    """May new query i see cache slot s (written by an earlier call)? [B, 1 or T, S] bool.

    cache_index: [B] int32; key_start: [B] int32 or None; sinks: A, the row's first A slots (from key_start)
    are read from the float32 sink arrays instead (``sink_mask``), so they are masked here.
    """
    s = jnp.arange(S)[None, None, :]                                   # [1, 1, S]
    mask = _slot_mask(s, T, cache_index, key_start, window)
    return mask & (s >= _start(key_start) + sinks) if sinks else mask


def sink_mask(A: int, T: int, cache_index, key_start, window: int | None) -> jax.Array:
    """May new query i see sink n, the row's token at slot key_start + n (written by an earlier call)?
    [B, 1 or T, A] bool. cache_index: [B] int32; key_start: [B] int32 or None."""
    slots = _start(key_start) + jnp.arange(A)[None, None, :]           # [B or 1, 1, A]
    return _slot_mask(slots, T, cache_index, key_start, window)


def _start(key_start):
    """key_start as [B, 1, 1] (0 when None)."""
    return 0 if key_start is None else key_start[:, None, None]


def _slot_mask(s, T: int, cache_index, key_start, window: int | None) -> jax.Array:
    """Old slots s ([B or 1, 1, S']) visible to each new query: written, past the padding, in the window."""
    mask = s < cache_index[:, None, None]                              # [B, 1, S']
    if key_start is not None:
        mask = mask & (s >= key_start[:, None, None])
    if window is not None:
        query_slot = cache_index[:, None, None] + jnp.arange(T)[None, :, None]   # [B, T, 1]
        mask = mask & ((query_slot - s) < window)
    return mask


def attend(q, k, v, old: LayerKV | None, cache_index, key_start, window: int | None, causal: bool = True,
           sinks: LayerKV | None = None, valid=None):
    """Softmax attention of q over [sink slots ; old cache slots ; new keys], computed jointly in float32.

    q: [B, K, G, T, D] (already scaled by 1/sqrt(D)); k, v: [B, K, T, D]; old: a static layer with a
    ``read(dtype)`` method (LayerKV [B, K, S, D]; an int8 QuantLayerKV reads back its rows in q's dtype and
    brings its float32 sinks, which are read instead of its first A slots) or None; cache_index: [B] int32;
    key_start: [B] int32 or None; causal: see new_token_mask; sinks: float
    keys and values of the first A slots, LayerKV [B, K, A, D], for an old cache given already read back
    (MLA's naive form); valid: [B] int32 real tokens per row (the rest right padding) or None. Returns
    [B, K, G, T, D] float32. One new token over a float32 cache on the CPU goes to the compiled kernel instead
    (``dantinox.kv.decode_kernel``: only the visible slots, both cores), and a long prompt over itself (no old
    cache) to the blocked prefill kernel (``dantinox.kv.prefill_attention``, which skips the right padding).
    """
    T = q.shape[3]
    if old is None and prefill_kernel_applies(q, k, v, causal):  # a prompt over itself on the CPU: the kernel
        return prefill_attention(q, k, v, cache_index, key_start, window, valid)
    if causal and old is not None and decode_kernel_applies(q, old, sinks):  # one new token, CPU: the kernel
        return decode_attention(q, k, v, old, *visible_slots(cache_index, key_start, window))
    if old is not None:   # an int8 layer reads back its rows and brings its float32 sinks (its ``read``)
        old, own_sinks = old.read(q.dtype)
        sinks = own_sinks if sinks is None else sinks
    f32 = jnp.float32
    new_scores = grouped_scores(q, k)
    new_mask = new_token_mask(T, cache_index, key_start, window, causal)
    new_scores = jnp.where(new_mask[:, None, None], new_scores, NEG_INF)
    if old is None:
        probs = jax.nn.softmax(new_scores, axis=-1)
        return grouped_values(probs, v.astype(f32))
    S, A = old.k.shape[2], 0 if sinks is None else sinks.k.shape[2]
    old_mask = old_slot_mask(S, T, cache_index, key_start, window, A)
    old_scores = grouped_scores(q, old.k.astype(q.dtype))
    scores = [jnp.where(old_mask[:, None, None], old_scores, NEG_INF), new_scores]
    if A:
        sink_scores = grouped_scores(q, sinks.k.astype(q.dtype))
        scores.insert(0, jnp.where(sink_mask(A, T, cache_index, key_start, window)[:, None, None], sink_scores,
                                   NEG_INF))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    sink_probs, old_probs, new_probs = probs[..., :A], probs[..., A:A + S], probs[..., A + S:]
    y = grouped_values(old_probs.astype(q.dtype), old.v.astype(q.dtype))
    if A:
        y = y + grouped_values(sink_probs.astype(q.dtype), sinks.v.astype(q.dtype))
    return y + grouped_values(new_probs, v.astype(f32))
