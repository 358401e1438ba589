"""The paged KV cache on the device: one pool of fixed-size blocks per layer, read through block tables.

Letters (besides the legend in ``dantinox.kv.attend``): N blocks in the pool, P tokens per block (block size),
M block-table entries per sequence (M = ceil(max_context / P)).

Layout per layer, the static cache's layout with the slot axis cut into blocks, in cfg.cache_dtype:
  MHA / GQA / MQA   ``PagedLayerKV(k, v)``, each [N, P, K, D];
  MLA               ``PagedLatentKV(c_kv, k_rope)``: the latent [N, P, C] and the shared RoPE key [N, P, R]
                    (what ``dantinox.kv.static.LatentKV`` holds per slot; never per-head keys and values).
  int8 (cache_dtype="int8") ``PagedQuantKV(k, v, k_scale, v_scale, k_sink, v_sink)``: int8 [N, P, K, D] plus
                    float32 scales [N, P, K, 1], and float32 sink rows [R, A, K, D];
                    ``PagedQuantLatentKV(c_kv, k_rope, c_scale, r_scale, c_sink, r_sink)``: int8 [N, P, C],
                    [N, P, R] plus scales [N, P, 1] each, and sinks [R, A, C], [R, A, R]. The scales live in
                    blocks of their own arrays, indexed by the same block ids, so every block operation
                    (copy-on-write, swap out/in, prefix sharing) that moves or shares a block moves or shares
                    its scales with it (the first ``BLOCK_FIELDS`` fields of a layer have the block axis).
                    The sinks are per SEQUENCE, not per block: R sink slots (``dantinox.kv.sink_slots``),
                    each the full-precision rows of one sequence's first A tokens (``dantinox.kv.sinks``);
                    each batch row names its slot (``sink_slot`` [B] int32, R = padding: never written).
                    Sinks live in a sequence's first block, so A <= P is required.
  int8 with per-channel keys (cfg.channel_keys, KIVI) ``PagedChannelKV(k, v, k_scale, v_scale, k_sink, v_sink,
                    k_resid)``: key scales per (group of G slots, KV head, channel) [N, P/G, K, D] (P a multiple
                    of G) and a float32 residual slot [Q, 2 G, K, D] per running sequence (a ring: its filling
                    key group and the one before); its attention and writes are ``dantinox.kv.channel_paged``.
Token t of a sequence whose block table is ``table`` lives in block ``table[t // P]`` at offset ``t % P``.
The pool's bytes are ``dantinox.kv.sizes``'s (N page_bytes + R sink_slot_bytes + Q residual_slot_bytes, from
the layers' specs), exactly what ``dantinox.kv.pool.init_pool`` allocates.

How the model reads it. Each attention kind accepts a layer cache object with its own hook (see
``dantinox.model.attention.Attention`` and ``dantinox.model.mla.MLAttention``); per call a view carries the layer's
pool, the batch's block tables [B, M] and the number of valid new tokens per row [B]:
  ``PagedView.attend_and_write(q, k, v, cache_index, key_start, window)`` (MHA / GQA / MQA). Both ways read
  only the blocks a row has filled:
  1. a few new tokens per row (decode steps, verify calls) over a float32 pool on the CPU with the compiled
     extension: the new rows are written first and the kernel attends in place
     (``dantinox.kv.decode_kernel.paged_attention``);
  2. otherwise (prefill chunks, int8 and bfloat16 pools): the old slots are read a slab of blocks at a time
     and folded into an online softmax with the new keys (``dantinox.kv.paged_slabs``), the same softmax
     attention as the static cache's: old slots s < cache_index[b] together with the T new keys, causal among
     the new ones; then the new keys and values are scattered into the pool at (block, offset), dropping the
     padding positions j >= num_new[b] (rows of a bucketed batch are right-padded; unused rows have num_new 0).
  ``PagedLatentView.attend_and_write_latent(attend, stored, cache_index, key_start)`` (MLA) does
  the same with latents: it gathers LatentKV(c_kv [B, M*P, C], k_rope [B, M*P, R]), hands it to the
  model's own MLA attention (absorbed or naive, ``cfg.mla_absorb``) as the old cache, and scatters the new
  latents.
So paged and static logits agree to float rounding (tests/serving/test_serving_paged.py,
tests/serving/test_serving_mla.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .decode_kernel import MAX_VERIFY_TOKENS, paged_attention, paged_kernel_applies
from .paged_slabs import slab_attention
from .channel_paged import PagedChannelKV, PagedChannelView
from .static import LatentKV, LayerKV, QuantLatentKV, QuantLayerKV


class PagedLayerKV(NamedTuple):
    """One MHA / GQA / MQA layer's block pool. k, v: [N, P, K, D]."""

    k: jax.Array
    v: jax.Array


class PagedLatentKV(NamedTuple):
    """One MLA layer's block pool. c_kv: [N, P, C] normalised latents; k_rope: [N, P, R] rotated shared keys."""

    c_kv: jax.Array
    k_rope: jax.Array


class PagedQuantKV(NamedTuple):
    """One MHA / GQA / MQA layer's int8 block pool. k, v: [N, P, K, D] int8; k_scale, v_scale: [N, P, K, 1]
    float32; k_sink, v_sink: [R, A, K, D] float32 (per sink slot: one sequence's first A tokens, in full)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    k_sink: jax.Array
    v_sink: jax.Array


class PagedQuantLatentKV(NamedTuple):
    """One MLA layer's int8 block pool. c_kv: [N, P, C] int8; k_rope: [N, P, R] int8; c_scale, r_scale:
    [N, P, 1] float32; c_sink [R, A, C], r_sink [R, A, R] float32 (per sink slot: a sequence's first A tokens,
    in full)."""

    c_kv: jax.Array
    k_rope: jax.Array
    c_scale: jax.Array
    r_scale: jax.Array
    c_sink: jax.Array
    r_sink: jax.Array


# the static layer type each pool layer type gathers into
_GATHERED = {PagedLayerKV: LayerKV, PagedQuantKV: QuantLayerKV, PagedLatentKV: LatentKV,
             PagedQuantLatentKV: QuantLatentKV}


def _static_type(layer):
    """The static layer type a pool layer's rows gather into: its class attribute ``STATIC`` when it has one (a
    codec's own pool type), else the built-in pairs above."""
    return getattr(layer, "STATIC", None) or _GATHERED[type(layer)]

PagedPool = tuple  # tuple[PagedLayerKV, ...] (or tuple[PagedLatentKV, ...] for MLA), one entry per block


BLOCK_FIELDS = 4  # fields of a pool layer with the block axis first (rows, then int8 scales); then the sinks
SINK_FIELDS = 2   # int8 sink arrays after the block fields (then, per-channel keys only, the residual)


def block_fields(layer) -> tuple:
    """The arrays of a pool layer indexed by block id ([N, P, ...]): every field but the int8 sinks (and the
    per-channel keys' residual)."""
    return tuple(layer[:BLOCK_FIELDS])


def sink_fields(layer) -> tuple:
    """The int8 sink arrays of a pool layer ([R, A, ...]; empty for a float pool)."""
    return tuple(layer[BLOCK_FIELDS:BLOCK_FIELDS + SINK_FIELDS])


def with_sinks(layer, sinks) -> tuple:
    """``layer`` with its sink arrays replaced by ``sinks`` (the other fields kept)."""
    return type(layer)(*block_fields(layer), *sinks, *layer[BLOCK_FIELDS + SINK_FIELDS:])


def gather_rows(layer: PagedLayerKV | PagedQuantKV, block_table: jax.Array,
                sink_slot: jax.Array | None = None) -> LayerKV | QuantLayerKV:
    """Each row's blocks laid end to end. block_table: [B, M] int32 -> LayerKV of [B, K, M*P, D] (int8 pool:
    QuantLayerKV, its scales [B, K, M*P, 1] and the sinks of row b's slot sink_slot[b] ([B] int32), [B, K, A,
    D]; read back later, inside ``attend``)."""
    B, M = block_table.shape

    def rows(pool):
        _, P, K, W = pool.shape
        return pool[block_table].reshape(B, M * P, K, W).transpose(0, 2, 1, 3)

    arrays = [rows(a) for a in block_fields(layer)] + [a[_slots(sink_slot, B)].transpose(0, 2, 1, 3)
                                                       for a in sink_fields(layer)]
    return _static_type(layer)(*arrays)


def gather_latents(layer: PagedLatentKV | PagedQuantLatentKV, block_table: jax.Array,
                   sink_slot: jax.Array | None = None) -> LatentKV | QuantLatentKV:
    """Each row's blocks laid end to end. block_table: [B, M] int32 -> LatentKV(c_kv [B, M*P, C],
    k_rope [B, M*P, R]) (int8 pool: QuantLatentKV, its scales [B, M*P, 1] and the sinks of row b's slot
    sink_slot[b] ([B] int32), [B, A, C], [B, A, R])."""
    B, M = block_table.shape

    def rows(pool):
        return pool[block_table].reshape(B, M * pool.shape[1], pool.shape[2])

    return _static_type(layer)(*([rows(a) for a in block_fields(layer)]
                                    + [a[_slots(sink_slot, B)] for a in sink_fields(layer)]))


def _slots(sink_slot, B: int) -> jax.Array:
    """Each row's sink slot, [B] int32 (when not given, row b's is slot b: the pool needs R >= B slots)."""
    return jnp.arange(B, dtype=jnp.int32) if sink_slot is None else sink_slot


def _write_slots(block_table, cache_index, num_new, T: int, N: int, P: int):
    """Pool coordinates of row b's new token j (position cache_index[b] + j): (block [B*T], offset [B*T])
    int32, with block = N (out of range, so the write is dropped) for padding positions j >= num_new[b]."""
    M = block_table.shape[1]
    pos = cache_index[:, None] + jnp.arange(T, dtype=jnp.int32)[None]          # [B, T]
    valid = jnp.arange(T)[None] < num_new[:, None]
    block = jnp.take_along_axis(block_table, jnp.clip(pos // P, 0, M - 1), axis=1)
    block = jnp.where(valid, block, N).reshape(-1)
    return block, (pos % P).reshape(-1)


def _sink_coords(sink_slot, cache_index, num_new, T: int, R: int, A: int):
    """Sink coordinates of row b's new token j: (slot [B*T], offset [B*T]) int32, the row's sink slot and the
    token's position when that is below A; slot R (dropped) for every other token and padding."""
    pos = cache_index[:, None] + jnp.arange(T, dtype=jnp.int32)[None]          # [B, T]
    valid = (jnp.arange(T)[None] < num_new[:, None]) & (pos < A)
    block = jnp.where(valid, _slots(sink_slot, pos.shape[0])[:, None], R).reshape(-1)
    return block, jnp.clip(pos, 0, max(A - 1, 0)).reshape(-1)


def _put(pool: jax.Array, rows: jax.Array, block, offset) -> jax.Array:
    """pool [N, P, ...] with rows [B, T, ...] written at (block, offset) [B*T]; block N is dropped."""
    flat = rows.reshape((-1,) + rows.shape[2:]).astype(pool.dtype)
    return pool.at[block, offset].set(flat, mode="drop")


def scatter_new(layer: PagedLayerKV | PagedQuantKV, stored: tuple, block_table, cache_index, num_new,
                sink_slot=None):
    """Write row b's first num_new[b] new keys/values at token positions cache_index[b] + j.

    stored: one array per pool field: (k_new, v_new) [B, K, T, D], or for an int8 pool (k_q, v_q [B, K, T, D]
    int8, k_scale, v_scale [B, K, T, 1] float32, k_full, v_full [B, K, T, D], written to row b's sink slot
    sink_slot[b] ([B] int32, R = none) for positions below A); block_table: [B, M] int32; cache_index,
    num_new: [B] int32. Padding positions (j >= num_new[b]) are dropped, never written. Returns the pool
    layer, same type.
    """
    N, P = layer.k.shape[:2]
    T = stored[0].shape[2]
    block, offset = _write_slots(block_table, cache_index, num_new, T, N, P)
    out = [_put(a, new.transpose(0, 2, 1, 3), block, offset) for a, new in zip(block_fields(layer), stored)]
    return type(layer)(*out, *_scatter_sinks(layer, stored, sink_slot, cache_index, num_new, T, True))


def scatter_latents(layer: PagedLatentKV | PagedQuantLatentKV, stored: tuple, block_table, cache_index, num_new,
                    sink_slot=None):
    """Write row b's first num_new[b] new latents at token positions cache_index[b] + j.

    stored: one array per pool field: (c_new [B, T, C], kr_new [B, T, R]), or for an int8 pool (c_q, kr_q
    int8, c_scale, r_scale [B, T, 1] float32, then the full c_new, kr_new for row b's sink slot sink_slot[b]);
    block_table: [B, M] int32; cache_index, num_new: [B] int32; sink_slot: [B] int32 (R = none).
    Padding positions (j >= num_new[b]) are dropped, never written. Returns the pool layer, same type.
    """
    N, P = layer.c_kv.shape[:2]
    T = stored[0].shape[1]
    block, offset = _write_slots(block_table, cache_index, num_new, T, N, P)
    out = [_put(a, new, block, offset) for a, new in zip(block_fields(layer), stored)]
    return type(layer)(*out, *_scatter_sinks(layer, stored, sink_slot, cache_index, num_new, T, False))


def _scatter_sinks(layer, stored, sink_slot, cache_index, num_new, T: int, per_head: bool) -> list:
    """The layer's sink arrays with the new tokens at positions below A written into their rows' sink slots
    (stored[BLOCK_FIELDS:], [B, K, T, D] when per_head, else [B, T, W]); unchanged when there are none."""
    sinks = list(sink_fields(layer))
    if not sinks or not sinks[0].shape[1]:
        return sinks
    R, A = sinks[0].shape[:2]
    slot, offset = _sink_coords(sink_slot, cache_index, num_new, T, R, A)
    return [_put(a, new.transpose(0, 2, 1, 3) if per_head else new, slot, offset)
            for a, new in zip(sinks, stored[BLOCK_FIELDS:])]


class PagedView(NamedTuple):
    """An MHA / GQA / MQA layer's pool plus the batch's paging metadata, handed to the model as its layer
    cache.

    pool: PagedLayerKV [N, P, K, D] or PagedQuantKV; block_table: [B, M] int32; num_new: [B] int32 valid new
    tokens per row; sink_slot: [B] int32, each row's sink slot in an int8 pool (R: none; None: row b's is b).
    """

    pool: PagedLayerKV | PagedQuantKV
    block_table: jax.Array
    num_new: jax.Array
    sink_slot: jax.Array | None = None

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None):
        """Attention hook called by ``dantinox.model.attention.Attention``.

        q: [B, K, G, T, D] (scaled); k, v: [B, K, T, D]; cache_index: [B] int32 tokens already cached per
        row; key_start must be None (no left padding in a paged batch); stored: what to write, one array per
        pool field (default (k, v); an int8 pool needs (k_q, v_q, k_scale, v_scale, k_full, v_full)).
        Returns (y [B, K, G, T, D] float32, the PagedView with the new keys and values written). Raises ValueError for
        a key_start, or for an int8 pool without ``stored`` (cfg.cache_dtype and the pool disagree).
        """
        if key_start is not None:
            raise ValueError("key_start (left padding) is not used with a paged cache: pass key_start=None")
        stored = (k, v) if stored is None else stored
        if len(stored) != len(self.pool):
            raise ValueError(f"the pool holds {type(self.pool).__name__} but the model writes {len(stored)} "
                             "arrays: build the pool from the model's config (cache_dtype)")
        if (type(self.pool) is PagedLayerKV and q.shape[3] <= MAX_VERIFY_TOKENS
                and paged_kernel_applies(q, self.pool.k, self.pool.v)):
            # a few queries per row: the compiled kernel reads the filled blocks in place, new rows written first
            pool = scatter_new(self.pool, stored, self.block_table, cache_index, self.num_new, self.sink_slot)
            y = paged_attention(q, k, v, pool.k, pool.v, self.block_table, cache_index, window)
            return y, self._replace(pool=pool)
        y = slab_attention(q, k, v, self.pool, gather_rows, self.block_table, self.sink_slot, cache_index, window)
        pool = scatter_new(self.pool, stored, self.block_table, cache_index, self.num_new, self.sink_slot)
        return y, self._replace(pool=pool)


class PagedLatentView(NamedTuple):
    """An MLA layer's latent pool plus the batch's paging metadata, handed to the model as its layer cache.

    pool: PagedLatentKV (c_kv [N, P, C], k_rope [N, P, R]) or PagedQuantLatentKV; block_table: [B, M] int32;
    num_new: [B] int32; sink_slot: [B] int32 each row's sink slot (int8 pool; None: row b's is b).
    """

    pool: PagedLatentKV | PagedQuantLatentKV
    block_table: jax.Array
    num_new: jax.Array
    sink_slot: jax.Array | None = None

    def attend_and_write_latent(self, attend_over, stored, cache_index, key_start):
        """Attention hook called by ``dantinox.model.mla.MLAttention``.

        attend_over: the layer's attention as a function of the old cache, LatentKV (or QuantLatentKV) ->
        o [B, T, H, D] float32 (it masks slots s >= cache_index[b] itself); stored: the new rows, one array
        per pool field ((c_new [B, T, C], kr_new [B, T, R]) or the int8 form with scales [B, T, 1]);
        cache_index: [B] int32; key_start must be None. Returns (o, the PagedLatentView with the new
        latents written). Raises ValueError for a key_start or for ``stored`` that does not match the pool.
        """
        if key_start is not None:
            raise ValueError("key_start (left padding) is not used with a paged cache: pass key_start=None")
        if len(stored) != len(self.pool):
            raise ValueError(f"the pool holds {type(self.pool).__name__} but the model writes {len(stored)} "
                             "arrays: build the pool from the model's config (cache_dtype)")
        o = attend_over(gather_latents(self.pool, self.block_table, self.sink_slot))
        pool = scatter_latents(self.pool, stored, self.block_table, cache_index, self.num_new, self.sink_slot)
        return o, self._replace(pool=pool)


class BlockTables(NamedTuple):
    """Where a batch's rows live in the pool, one argument of every compiled call over it (built by the cache
    manager, ``dantinox.kv.manager.CacheManager.tables``).

    table: [B, M] int32 each row's block table (padding rows: zeros, never written); sink_slot: [B] int32 each
    row's sink slot of an int8 pool (R for padding rows and pools without sinks); residual_slot: [B] int32 each
    row's residual slot of a per-channel key pool (Q for padding rows), or None for other pools."""

    table: jax.Array
    sink_slot: jax.Array
    residual_slot: jax.Array | None = None


def paged_views(pool: PagedPool, tables, num_new, sink_slot=None, residual_slot=None) -> tuple:
    """One view per layer (PagedView, PagedLatentView for an MLA layer, PagedChannelView for per-channel keys),
    sharing the batch's BlockTables (or a bare block table [B, M] int32 with sink_slot / residual_slot [B]
    int32 given apart; None: row b's slot is b, so the pool needs R >= B) and valid-token counts num_new [B]
    int32. The view is chosen per layer by its pool layer type, so one pool may hold layers of two kinds (the
    engine's target layers then a draft model's float layers, ``dantinox.serving.draft_model``)."""
    if isinstance(tables, BlockTables):
        block_table, sink_slot, residual_slot = tables
    else:
        block_table = tables
    B = block_table.shape[0]
    sinks, residual = _slots(sink_slot, B), _slots(residual_slot, B)

    def view(layer):
        if isinstance(layer, PagedChannelKV):
            return PagedChannelView(layer, block_table, num_new, sinks, residual)
        if isinstance(layer, (PagedLatentKV, PagedQuantLatentKV)):
            return PagedLatentView(layer, block_table, num_new, sink_slot)
        return PagedView(layer, block_table, num_new, sink_slot)

    return tuple(view(layer) for layer in pool)


def reads_filled_only(cfg) -> bool:
    """Whether attention over a pool of ``cfg`` reads only the blocks each row has filled, whatever the block
    table's width (the paged kernel or the slab loop: MHA / GQA / MQA pools with float or per-token int8 rows),
    so a compiled call needs no narrower table to be cheap. False for MLA's latent pool and per-channel keys,
    whose views gather the whole table."""
    return cfg.attention != "mla" and not cfg.channel_keys
