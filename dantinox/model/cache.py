"""The static KV cache: a pytree allocated up front, passed into the model and returned updated.

Layout per layer: k and v of shape [B, K, S, D] (batch, KV heads, max_context slots, head size), in
``cfg.cache_dtype``; for attention="mla" a ``LatentKV`` of c_kv [B, S, C] and k_rope [B, S, R]
instead (the latent and the shared RoPE key, never per-head keys and values). With cache_dtype="int8" the
layers are ``QuantLayerKV`` (int8 k, v plus float32 scales [B, K, S, 1] and the float32 rows of the first
A = cfg.sink_slots tokens, [B, K, A, D]) and ``QuantLatentKV`` (int8 c_kv, k_rope plus scales [B, S, 1] and
float32 sinks [B, A, C], [B, A, R]); see ``dantinox.quant.kv_rows`` and ``dantinox.quant.kv_sinks``. With
``cfg.channel_keys`` (kv_keys="channel") the int8 layers are ``ChannelQuantLayerKV`` instead: per-channel int8
keys over groups of G slots with their scales and a float32 residual of the filling group
(``dantinox.model.channel_layout``, KIVI). The cache
holds no write index of its own: the caller passes ``cache_index`` (a scalar or one slot per row, [B] int32) so
rows of different lengths share a batch.

Writes go through :func:`write_layer`, which uses ``lax.dynamic_update_slice``. That primitive clamps an
out-of-range start index silently (a write at slot S would overwrite slot S-1), so every public entry point
checks ``cache_index + T <= S`` before it writes; see ``check_cache_capacity``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ..config import CACHE_DTYPES, ModelConfig, canonical_dtype
from ..quant.kv_rows import SCALE_BYTES, SCALE_DTYPE, dequantize_rows
from ..quant.kv_sinks import SINK_BYTES, SINK_DTYPE, write_sinks
from .channel_layout import channel_cache_shapes, init_channel_layer
from .zero_pages import zeros


class CapacityError(ValueError):
    """A write would go past the last cache slot (max_context)."""


class LayerKV(NamedTuple):
    """One layer's cache. k, v: [B, K, S, D]."""

    k: jax.Array
    v: jax.Array


class QuantLayerKV(NamedTuple):
    """One layer's int8 cache. k, v: [B, K, S, D] int8; k_scale, v_scale: [B, K, S, 1] float32 (one scale per
    token and KV head; ``dantinox.quant.kv_rows``); k_sink, v_sink: [B, K, A, D] float32, the keys and values
    of the row's first A tokens in full (slots key_start .. key_start + A - 1; ``dantinox.quant.kv_sinks``),
    which attention reads instead of their int8 rows."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    k_sink: jax.Array
    v_sink: jax.Array

    def dequantized(self, dtype) -> LayerKV:
        """The float keys and values the int8 rows stand for: LayerKV of [B, K, S, D] in ``dtype``."""
        return LayerKV(dequantize_rows(self.k, self.k_scale, dtype), dequantize_rows(self.v, self.v_scale, dtype))

    def sinks(self) -> LayerKV | None:
        """The float32 sink keys and values, LayerKV of [B, K, A, D]; None when A = 0."""
        return LayerKV(self.k_sink, self.v_sink) if self.k_sink.shape[-2] else None


KVCache = tuple  # tuple[LayerKV, ...] (or tuple[LatentKV, ...] for MLA), one entry per decoder block


def bytes_per_token_per_layer(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes one token occupies in one layer's cache, as each attention kind stores it.

    MHA / GQA / MQA: 2 * K * D * bytes_per_element (keys and values).
    MLA: (C + R) * bytes_per_element (the latent c_kv and the shared RoPE key).
    int8 adds one float32 scale per row: 2 * K * (D + 4) bytes, or for MLA C + R + 2 * 4 (one scale for the
    latent and one for the RoPE key, kept even when R = 0 so every field has its scale). The float32 sink
    rows of an int8 cache are per sequence, not per token: ``sink_bytes_per_layer``. Per-channel keys
    (cfg.channel_keys with an int8 dtype) store the same 2 K (D + 4) per token: int8 keys and values, one
    value scale per token and KV head, and for the keys 4 K D / G per token in key scales (G = cfg.key_group;
    whole groups, per sequence ceil(S / G) of them) in place of the key scale per token; that and the
    residual ring of 2 G float32 keys per sequence are counted by ``dantinox.budget.kv_cache_bytes``. So this
    figure is exact for per-channel keys when G = D, and a per-token approximation otherwise.
    dtype: cache dtype name (default cfg.cache_dtype). Raises ConfigError for an unknown dtype name.
    """
    name = canonical_dtype("cache_dtype", dtype or cfg.cache_dtype, CACHE_DTYPES)
    itemsize = np.dtype(CACHE_DTYPES[name]).itemsize
    scale = SCALE_BYTES if name == "int8" else 0
    if cfg.attention == "mla":
        return (cfg.kv_latent_dim + cfg.rope_head_dim) * itemsize + 2 * scale
    return 2 * cfg.kv_heads * (cfg.head_size * itemsize + scale)


def sink_bytes_per_layer(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of the float32 sink rows (``dantinox.quant.kv_sinks``) in one layer: A x 2 K D x 4 (MLA:
    A x (C + R) x 4), A = the sink tokens of an int8 cache, 0 for float caches. The static cache holds one set
    per sequence, the paged pool one per sink slot (``dantinox.serving.sink_slots``). dtype: cache dtype name
    (default cfg.cache_dtype). Raises ConfigError for an unknown dtype name."""
    name = canonical_dtype("cache_dtype", dtype or cfg.cache_dtype, CACHE_DTYPES)
    sinks = min(cfg.kv_sink_tokens, cfg.max_context) if name == "int8" else 0
    if cfg.attention == "mla":
        return sinks * (cfg.kv_latent_dim + cfg.rope_head_dim) * SINK_BYTES
    return sinks * 2 * cfg.kv_heads * cfg.head_size * SINK_BYTES


def sink_shapes(cfg: ModelConfig, batch_size: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's float32 sink arrays: (k_sink, v_sink) [B, K, A, D] each, or for MLA (c_sink
    [B, A, C], r_sink [B, A, R]); () for float caches."""
    B, A = int(batch_size), cfg.sink_slots
    if cfg.cache_dtype != "int8":
        return ()
    if cfg.attention == "mla":
        return (B, A, cfg.kv_latent_dim), (B, A, cfg.rope_head_dim)
    return ((B, cfg.kv_heads, A, cfg.head_size),) * 2


def layer_cache_shapes(cfg: ModelConfig, batch_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's two cache arrays: (k, v) [B, K, S, D] each, or for MLA (c_kv [B, S, C], k_rope
    [B, S, R])."""
    B, S = int(batch_size), cfg.max_context
    if cfg.attention == "mla":
        return (B, S, cfg.kv_latent_dim), (B, S, cfg.rope_head_dim)
    shape = (B, cfg.kv_heads, S, cfg.head_size)
    return shape, shape


def cache_field_shapes(cfg: ModelConfig, batch_size: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of every array of one layer's cache, in field order: ``layer_cache_shapes`` and, for
    cache_dtype="int8", one scale shape per row shape with the last axis 1 ([B, K, S, 1] or [B, S, 1]), then
    the sink shapes (``sink_shapes``); with cfg.channel_keys ``channel_cache_shapes``."""
    if cfg.channel_keys:
        return channel_cache_shapes(cfg, batch_size)
    shapes = layer_cache_shapes(cfg, batch_size)
    if cfg.cache_dtype != "int8":
        return shapes
    return shapes + tuple(tuple(s[:-1]) + (1,) for s in shapes) + sink_shapes(cfg, batch_size)


def init_cache(cfg: ModelConfig, batch_size: int) -> KVCache:
    """Allocate the whole cache up front, zeros in cfg.cache_dtype, one entry per layer:
    LayerKV(k, v) of [B, K, S, D] each, or for attention="mla" LatentKV(c_kv [B, S, C], k_rope [B, S, R]);
    for cache_dtype="int8" QuantLayerKV / QuantLatentKV, the same int8 arrays plus float32 zero scales of the
    same shape with a last axis of 1 and float32 zero sinks (``sink_shapes``); with cfg.channel_keys
    ChannelQuantLayerKV (``dantinox.model.channel_layout``).

    Raises ValueError if batch_size is not a positive integer.
    """
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r} is not allowed: a positive integer")
    if cfg.channel_keys:
        return tuple(init_channel_layer(cfg, int(batch_size)) for _ in range(cfg.num_blocks))
    int8 = cfg.cache_dtype == "int8"
    if cfg.attention == "mla":
        layer_type = QuantLatentKV if int8 else LatentKV
    else:
        layer_type = QuantLayerKV if int8 else LayerKV
    shapes = layer_cache_shapes(cfg, batch_size)
    sinks = sink_shapes(cfg, batch_size)
    return tuple(layer_type(*zero_arrays(shapes, cfg.jnp_cache_dtype, int8, sinks))
                 for _ in range(cfg.num_blocks))


def zero_arrays(shapes, dtype, int8: bool, sinks=()) -> list:
    """Zeros of each shape in ``dtype``; with int8 also one float32 zero scale array per shape, the shape's
    last axis set to 1, and float32 zeros of each of the ``sinks`` shapes (rows first, then their scales,
    then the sinks: the field order of the Quant* layer types). Outside a trace on the CPU the pages are left
    to the operating system (``dantinox.model.zero_pages``): resident when first written."""
    arrays = [zeros(shape, dtype) for shape in shapes]
    if int8:
        arrays += [zeros(tuple(shape[:-1]) + (1,), SCALE_DTYPE) for shape in shapes]
        arrays += [zeros(shape, SINK_DTYPE) for shape in sinks]
    return arrays


def first_slots(layer, L: int):
    """One layer's cache cut to its first L slots (a copy): every array's slot axis (-2) cut to L, which is
    every field of LayerKV, LatentKV, QuantLayerKV and QuantLatentKV (their sinks keep min(A, L) rows); a
    layer with its own ``first_slots`` (ChannelQuantLayerKV: key scales per group, the residual whole) cuts
    itself. The layer itself when L covers it."""
    if L >= layer[0].shape[-2]:
        return layer
    if hasattr(layer, "first_slots"):
        return layer.first_slots(L)
    return type(layer)(*(a[..., :L, :] for a in layer))


def cache_nbytes(cache: KVCache) -> int:
    """Total bytes of every array in the cache (read from the arrays themselves)."""
    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(cache)))


def check_cache_capacity(cache_index, new_tokens: int, max_context: int) -> None:
    """Raise CapacityError if a concrete cache_index + new_tokens exceeds max_context.

    cache_index: int or [B] integers (host values; traced values are not checked here, so compiled loops
    must bound their indices themselves).
    """
    if isinstance(cache_index, jax.core.Tracer):
        return
    idx = np.asarray(cache_index)
    if idx.size == 0:
        return
    if int(idx.min()) < 0:
        raise CapacityError(f"cache_index={idx.tolist()} is negative; allowed: 0 <= cache_index")
    end = int(idx.max()) + int(new_tokens)
    if end > max_context:
        raise CapacityError(
            f"cache_index {int(idx.max())} + {new_tokens} new tokens = {end} exceeds max_context="
            f"{max_context}; the last slot is {max_context - 1}")


def write_layer(layer: LayerKV, k_new: jax.Array, v_new: jax.Array, cache_index: jax.Array) -> LayerKV:
    """Write T new keys and values at slots cache_index .. cache_index+T-1.

    k_new, v_new: [B, K, T, D]; cache_index: scalar or [B] int32. Returns the updated LayerKV.
    """
    k_new = k_new.astype(layer.k.dtype)
    v_new = v_new.astype(layer.v.dtype)
    if jnp.ndim(cache_index) == 0:
        start = (0, 0, cache_index, 0)
        return LayerKV(jax.lax.dynamic_update_slice(layer.k, k_new, start),
                       jax.lax.dynamic_update_slice(layer.v, v_new, start))
    row_write = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (0, i, 0)))
    return LayerKV(row_write(layer.k, k_new, cache_index), row_write(layer.v, v_new, cache_index))


def write_rows(layer: tuple, new: tuple, cache_index: jax.Array, key_start=None) -> tuple:
    """Write T new rows into every array of a layer cache along its slot axis (the second to last).

    layer: a layer cache NamedTuple (e.g. LatentKV, QuantLayerKV [B, K, S, D] / [B, K, S, 1], QuantLatentKV
    [B, S, C] / [B, S, 1]); new: one array per field, the same shapes with T in place of S (for the sink
    fields of QuantLayerKV / QuantLatentKV: the new tokens' full-precision rows, copied into the sinks they
    cover, ``dantinox.quant.kv_sinks.write_sinks``); cache_index: scalar or [B] int32; key_start: [B] int32
    or None, where each row's sinks start. Returns the layer of the same type with the rows written.
    """
    rows = len(layer) - 2 if isinstance(layer, (QuantLayerKV, QuantLatentKV)) else len(layer)

    def one(cache, rows):
        rows = rows.astype(cache.dtype)
        if jnp.ndim(cache_index) == 0:
            start = (0,) * (cache.ndim - 2) + (cache_index, 0)
            return jax.lax.dynamic_update_slice(cache, rows, start)
        row_start = lambda i: (0,) * (cache.ndim - 3) + (i, 0)  # noqa: E731
        return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, row_start(i)))(cache, rows,
                                                                                           cache_index)

    sinks = (write_sinks(c, r, cache_index, key_start) for c, r in zip(layer[rows:], new[rows:]))
    return type(layer)(*(one(c, r) for c, r in zip(layer[:rows], new[:rows])), *sinks)


class LatentKV(NamedTuple):
    """One MLA layer's cache. c_kv: [B, S, C] normalised latents; k_rope: [B, S, R] rotated shared keys."""

    c_kv: jax.Array
    k_rope: jax.Array


class QuantLatentKV(NamedTuple):
    """One MLA layer's int8 cache. c_kv: [B, S, C] int8; k_rope: [B, S, R] int8; c_scale, r_scale: [B, S, 1]
    float32 (one scale per token for the latent and one for the RoPE key; ``dantinox.quant.kv_rows``);
    c_sink [B, A, C], r_sink [B, A, R] float32: the first A tokens' latents and RoPE keys in full
    (``dantinox.quant.kv_sinks``)."""

    c_kv: jax.Array
    k_rope: jax.Array
    c_scale: jax.Array
    r_scale: jax.Array
    c_sink: jax.Array
    r_sink: jax.Array

    def sinks(self) -> LatentKV | None:
        """The float32 sink latents, LatentKV(c_kv [B, A, C], k_rope [B, A, R]); None when A = 0."""
        return LatentKV(self.c_sink, self.r_sink) if self.c_sink.shape[-2] else None

    def dequantized(self, dtype) -> LatentKV:
        """The float latents the int8 rows stand for: LatentKV(c_kv [B, S, C], k_rope [B, S, R]) in dtype."""
        return LatentKV(dequantize_rows(self.c_kv, self.c_scale, dtype),
                        dequantize_rows(self.k_rope, self.r_scale, dtype))


@runtime_checkable
class LayerCacheView(Protocol):
    """A layer cache in another layout than LayerKV (the paged serving pool, the DualCache, the int8 reference):
    ``dantinox.model.attention.Attention`` hands it the new tokens' projections and it attends and writes.

    q: [B, K, G, T, D] (G = H / K query heads per KV head); k, v: [B, K, T, D] in the compute dtype (for
    cache_dtype="int8" already read back from int8); cache_index, key_start: [B] int32; window: the sliding
    window (0: off); stored: for cache_dtype="int8" the rows to write, (k_q, v_q int8 [B, K, T, D], k_scale,
    v_scale float32 [B, K, T, 1]), else not passed. Returns (y [B, K, G, T, D] float32, the updated view).
    """

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None): ...


@runtime_checkable
class LatentCacheView(Protocol):
    """An MLA layer cache in another layout than LatentKV (``dantinox.model.mla.MLAttention``'s hook).

    attend_over(old) -> o [B, T, H, Dv] float32 runs the absorbed attention over ``old`` (the view's old
    latents as LatentKV or QuantLatentKV, or None for no old slots) and the new tokens; stored: (c_new [B, T,
    C], kr_new [B, T, R]), or for cache_dtype="int8" (c_q, kr_q int8, c_scale, r_scale [B, T, 1] float32);
    cache_index, key_start: [B] int32. Returns (o, the updated view).
    """

    def attend_and_write_latent(self, attend_over, stored, cache_index, key_start): ...
