"""The static KV cache: a pytree allocated up front, passed into the model and returned updated.

Layout per layer: k and v of shape [B, K, S, D] (batch, KV heads, max_context slots, head size), in
``cfg.cache_dtype``; for attention="mla" a ``LatentKV`` of c_kv [B, S, C] and k_rope [B, S, R]
instead (the latent and the shared RoPE key, never per-head keys and values). With cache_dtype="int8" the
layers are ``QuantLayerKV`` (int8 k, v plus float32 scales [B, K, S, 1] and the float32 rows of the first
A = cfg.sink_slots tokens, [B, K, A, D]) and ``QuantLatentKV`` (int8 c_kv, k_rope plus scales [B, S, 1] and
float32 sinks [B, A, C], [B, A, R]); see ``dantinox.kv.int8_rows`` and ``dantinox.kv.sinks``. With
``cfg.channel_keys`` (kv_keys="channel") the int8 layers are ``ChannelQuantLayerKV`` instead: per-channel int8
keys over groups of G slots with their scales and a float32 residual of the filling group
(``dantinox.kv.channel_layout``, KIVI). The cache
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

from .int8_rows import SCALE_DTYPE, dequantize_rows
from .sinks import SINK_DTYPE, write_sinks
from .zero_pages import zeros


class CapacityError(ValueError):
    """A write would go past the last cache slot (max_context)."""


class LayerKV(NamedTuple):
    """One layer's cache. k, v: [B, K, S, D]."""

    k: jax.Array
    v: jax.Array

    def read(self, dtype) -> tuple[LayerKV, None]:
        """The keys and values attention reads, and no float32 sinks: (this layer, None)."""
        return self, None


class QuantLayerKV(NamedTuple):
    """One layer's int8 cache. k, v: [B, K, S, D] int8; k_scale, v_scale: [B, K, S, 1] float32 (one scale per
    token and KV head; ``dantinox.kv.int8_rows``); k_sink, v_sink: [B, K, A, D] float32, the keys and values
    of the row's first A tokens in full (slots key_start .. key_start + A - 1; ``dantinox.kv.sinks``),
    which attention reads instead of their int8 rows."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    k_sink: jax.Array
    v_sink: jax.Array

    SINK_FIELDS = 2   # the last two fields are the float32 sinks (``write_rows`` copies full rows into them)

    def read(self, dtype) -> tuple[LayerKV, LayerKV | None]:
        """What attention reads: (the rows read back in ``dtype``, the float32 sinks or None)."""
        return self.dequantized(dtype), self.sinks()

    def dequantized(self, dtype) -> LayerKV:
        """The float keys and values the int8 rows stand for: LayerKV of [B, K, S, D] in ``dtype``."""
        return LayerKV(dequantize_rows(self.k, self.k_scale, dtype), dequantize_rows(self.v, self.v_scale, dtype))

    def sinks(self) -> LayerKV | None:
        """The float32 sink keys and values, LayerKV of [B, K, A, D]; None when A = 0."""
        return LayerKV(self.k_sink, self.v_sink) if self.k_sink.shape[-2] else None


KVCache = tuple  # tuple[LayerKV, ...] (or tuple[LatentKV, ...] for MLA), one entry per decoder block


def zero_arrays(shapes, dtype, int8: bool, sinks=()) -> list:
    """Zeros of each shape in ``dtype``; with int8 also one float32 zero scale array per shape, the shape's
    last axis set to 1, and float32 zeros of each of the ``sinks`` shapes (rows first, then their scales,
    then the sinks: the field order of the Quant* layer types). Outside a trace on the CPU the pages are left
    to the operating system (``dantinox.kv.zero_pages``): resident when first written."""
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
    cover, ``dantinox.kv.sinks.write_sinks``); cache_index: scalar or [B] int32; key_start: [B] int32
    or None, where each row's sinks start. Returns the layer of the same type with the rows written.
    """
    rows = len(layer) - getattr(layer, "SINK_FIELDS", 0)

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

    def read(self, dtype) -> tuple[LatentKV, None]:
        """The latents attention reads, and no float32 sinks: (this layer, None)."""
        return self, None


class QuantLatentKV(NamedTuple):
    """One MLA layer's int8 cache. c_kv: [B, S, C] int8; k_rope: [B, S, R] int8; c_scale, r_scale: [B, S, 1]
    float32 (one scale per token for the latent and one for the RoPE key; ``dantinox.kv.int8_rows``);
    c_sink [B, A, C], r_sink [B, A, R] float32: the first A tokens' latents and RoPE keys in full
    (``dantinox.kv.sinks``)."""

    c_kv: jax.Array
    k_rope: jax.Array
    c_scale: jax.Array
    r_scale: jax.Array
    c_sink: jax.Array
    r_sink: jax.Array

    SINK_FIELDS = 2   # the last two fields are the float32 sinks (``write_rows`` copies full rows into them)

    def read(self, dtype) -> tuple[LatentKV, LatentKV | None]:
        """What attention reads: (the latents read back in ``dtype``, the float32 sinks or None)."""
        return self.dequantized(dtype), self.sinks()

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
