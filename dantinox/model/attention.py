"""Causal self-attention over a static KV cache: MHA, GQA and MQA in one implementation.

Shape legend (used throughout the package; no letter is reused):
  B batch            T new tokens in this call      S cache slots (max_context)
  H query heads      K KV heads                      G = H // K query heads per KV head
  D head size        E model width (dim)             V vocabulary
  C MLA latent width (kv_latent_dim)   R MLA RoPE width (rope_head_dim)   Q MLA query latent (q_latent_dim)
  A attention-sink tokens an int8 cache keeps in float32 (cfg.sink_slots)

Multi-head latent attention (attention="mla") lives in ``dantinox.model.mla`` and shares the masks below.

Grouped heads: query head h uses KV head h // G (contiguous groups), so q is reshaped from
[B, T, H, D] to [B, K, G, T, D]. MHA is K = H, MQA is K = 1 (Ainslie et al. 2023, "GQA", section 2).

Cached calls attend over the *old* cache (slots written before this call) plus the T new keys and values,
then write the new keys and values into the cache. Attending before writing lets XLA update the cache
buffers in place inside the compiled decode loop instead of copying them every step
(../shared/PERFORMANCE.md, item 1).

int8 cache (cfg.cache_dtype="int8"). The new keys and values are quantized once (``dantinox.quant.kv_rows``,
one scale per token and KV head); the new tokens attend over their read-back values and the int8 rows and
scales are what gets stored, and old slots are read back (dequantized) inside ``attend``. So a cached call
and the uncached forward (which round-trips its keys and values the same way) see identical keys and values.
The first A tokens of each row (its attention sinks, ``dantinox.quant.kv_sinks``) are the exception: they
attend, and are attended to, with their float values, stored in the cache's float32 sink arrays; ``attend``
reads those instead of the int8 rows of the sink slots.

Masks. For row b with ``cache_index[b] = c`` and ``key_start[b] = p`` (left-padding slots, default 0),
the query in new position i sits in slot c + i and may see
  - cache slot s when p <= s < c (and c + i - s < window when a sliding window is set);
  - new position j when j <= i and c + j >= p (and i - j < window).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from ..quant.kv_rows import roundtrip_for
from ..quant.kv_sinks import keep_sinks, sink_flags
from .cache import LayerCacheView, LayerKV, first_slots, write_layer, write_rows
from .attention_kernel import (decode_attention, decode_kernel_applies, verify_attention, verify_kernel_applies,
                               visible_slots)
from .channel_attention import channel_attention
from .prefill_attention import prefill_attention, prefill_kernel_applies
from .scores import grouped_scores, grouped_values
from .layers import RMSNorm, apply_rope

NEG_INF = -1e30


class Attention(nnx.Module):
    """Multi-head attention with K <= H KV heads (MHA / GQA / MQA) and rotary positions.

    Projections: one fused [E, (H + 2K) D] matmul for q, k, v (columns: the H query heads, then the K key
    heads, then the K value heads, each head's D contiguous; with cfg.qkv_bias a bias of (H + 2K) D, as Qwen2);
    an [H D, E] output matmul without bias. With cfg.qk_norm each query and key head is RMS-normalised over D
    before RoPE (one [D] weight for all query heads, one for all key heads; Qwen3). Query head h reads KV head
    h // G, the grouping of transformers' ``repeat_kv``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(stddev=0.02)
        qkv_width = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_size
        self.qkv = nnx.Linear(cfg.dim, qkv_width, use_bias=cfg.qkv_bias, dtype=cfg.jnp_compute_dtype,
                              param_dtype=jnp.float32, kernel_init=init, rngs=rngs)
        self.q_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.out = nnx.Linear(cfg.n_heads * cfg.head_size, cfg.dim, use_bias=False,
                              dtype=cfg.jnp_compute_dtype, param_dtype=jnp.float32,
                              kernel_init=nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.num_blocks)),
                              rngs=rngs)

    def __call__(self, x, rope, layer_cache: LayerKV | None, cache_index, key_start, read_slots: int | None,
                 valid=None):
        """x: [B, T, E]; rope: (cos, sin) each [B, T, D/2]; layer_cache: LayerKV of [B, K, S, D] or None;
        cache_index: [B] int32 slot of the first new token; key_start: [B] int32 or None;
        read_slots: old cache slots to attend over: None all S, 0 none (prefill at slot 0), L the first L
        (the caller guarantees cache_index <= L for every row; see ``old_slots``).
        A layer cache with an ``attend_and_write(q, k, v, cache_index, key_start, window) -> (y, new cache)``
        method (the paged cache's PagedView) does its own attention and write; q, k, v are passed as
        [B, K, G, T, D] (scaled) and [B, K, T, D]; with cache_dtype="int8" also ``stored=(k_q, v_q, k_scale,
        v_scale, k_full, v_full)``, the int8 rows [B, K, T, D], float32 scales [B, K, T, 1] and the
        full-precision rows [B, K, T, D] for the sink arrays (k, v are then the read-back values, except at the
        row's first A positions, which keep their full values). valid: [B] int32 real tokens among the T (the
        rest right padding) or None: only the per-channel key cache (cfg.channel_keys) uses it, to keep padding
        out of its key groups.

        Returns (y [B, T, E], the updated layer cache (LayerKV, QuantLayerKV for cache_dtype="int8", or the
        hook's view) or None).
        """
        cfg = self.cfg
        B, T, _ = x.shape
        H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
        q, k, v = jnp.split(self.qkv(x), [H * D, (H + K) * D], axis=-1)
        q, k = q.reshape(B, T, H, D), k.reshape(B, T, K, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        v = v.reshape(B, T, K, D)
        q = (q * cfg.softmax_scale).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,D]
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        stored = None
        if cfg.cache_dtype == "int8":  # quantize once: attend over the read-back values, store the int8 rows
            (k_back, (k_q, k_s)), (v_back, (v_q, v_s)) = (roundtrip_for(layer_cache, k, "k"),
                                                           roundtrip_for(layer_cache, v, "v"))
            stored = (k_q, v_q, k_s, v_s, k, v)          # k, v in full for the sink arrays
            sinks = sink_flags(cache_index, key_start, T, cfg.sink_slots)
            k, v = keep_sinks(k_back, k, sinks), keep_sinks(v_back, v, sinks)
        if cfg.channel_keys and not isinstance(layer_cache, LayerCacheView):  # per-channel keys (KIVI)
            y, new_cache = channel_attention(cfg, q, stored[4], v, layer_cache, old_slots(layer_cache, read_slots),
                                             cache_index, key_start, stored, valid)
        elif isinstance(layer_cache, LayerCacheView):  # another cache layout, e.g. dantinox.serving.paged_cache
            extra = {} if stored is None else {"stored": stored}
            y, new_cache = layer_cache.attend_and_write(q, k, v, cache_index, key_start, cfg.sliding_window,
                                                        **extra)
        elif cfg.paradigm != "diffusion" and verify_kernel_applies(q, layer_cache, read_slots):   # float32 only
            new_cache = write_layer(layer_cache, k, v, cache_index)   # a few new tokens: the kernel reads them back
            y = verify_attention(q, k, v, new_cache, cache_index, key_start, cfg.sliding_window)
        else:
            y = attend(q, k, v, old_slots(layer_cache, read_slots), cache_index, key_start, cfg.sliding_window,
                       causal=cfg.paradigm != "diffusion", valid=valid)
            new_cache = None if layer_cache is None else (
                write_layer(layer_cache, k, v, cache_index) if stored is None
                else write_rows(layer_cache, stored, cache_index, key_start))
        y = y.transpose(0, 3, 1, 2, 4).reshape(B, T, H * D).astype(x.dtype)
        return self.out(y), new_cache


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

    q: [B, K, G, T, D] (already scaled by 1/sqrt(D)); k, v: [B, K, T, D]; old: LayerKV [B, K, S, D], an int8
    QuantLayerKV (read back here, in q's dtype; its float32 sinks are read instead of its first A slots) or
    None; cache_index: [B] int32; key_start: [B] int32 or None; causal: see new_token_mask; sinks: float
    keys and values of the first A slots, LayerKV [B, K, A, D], for an old cache given already read back
    (MLA's naive form). Returns [B, K, G, T, D] float32. One new token over a float32 cache on the CPU goes
    to the compiled kernel instead (``dantinox.model.attention_kernel``: only the visible slots, both cores), and
    a long prompt over itself (no old cache) to the blocked prefill kernel (``dantinox.model.prefill_attention``,
    where valid [B] int32, the real tokens per row, lets it skip right padding).
    """
    T = q.shape[3]
    if old is None and prefill_kernel_applies(q, k, v, causal):  # a prompt over itself on the CPU: the kernel
        return prefill_attention(q, k, v, cache_index, key_start, window, valid)
    if causal and old is not None and decode_kernel_applies(q, old, sinks):  # one new token, CPU: the kernel
        return decode_attention(q, k, v, old, *visible_slots(cache_index, key_start, window))
    if hasattr(old, "dequantized"):
        old, sinks = old.dequantized(q.dtype), old.sinks()
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
