"""The paged KV cache on the device: one pool of fixed-size blocks per layer, read through block tables.

Letters (besides the legend in ``dantinox.attention``): N blocks in the pool, P tokens per block (block size),
M block-table entries per sequence (M = ceil(max_context / P)).

Layout per layer (MHA / GQA / MQA): ``PagedLayerKV(k, v)``, each [N, P, K, D] in cfg.cache_dtype. Token t of
a sequence whose block table is ``table`` lives in block ``table[t // P]`` at offset ``t % P``. The pool is
sized from a memory budget with ``dantinox.cache.bytes_per_token_per_layer``, the figure the planner sums,
so N x P x L x bytes_per_token_per_layer equals the bytes allocated (``pool_nbytes``). A latent pool for
attention="mla" (c_kv [N, P, C], k_rope [N, P, R]) would be a second layer type with the same view
protocol; it is not implemented yet and ``init_pool`` refuses MLA configs.

How the model reads it. The model's attention accepts any layer cache object with a method
``attend_and_write(q, k, v, cache_index, key_start, window) -> (y, new layer cache)`` (the hook in
``dantinox.attention.Attention``). ``PagedView`` is such an object: per call it carries the layer's pool,
the batch's block tables [B, M] and the number of valid new tokens per row [B]. It
  1. gathers each row's blocks into a contiguous [B, K, M*P, D] view (slots past the row's length are
     masked by ``attend``, exactly as the static cache masks its unused slots),
  2. runs the same softmax attention as the static cache (``dantinox.attention.attend``): old slots
     s < cache_index[b] together with the T new keys, causal among the new ones,
  3. scatters the new keys and values into the pool at (block, offset), dropping the padding positions
     j >= num_new[b] (rows of a bucketed batch are right-padded; unused rows have num_new = 0).
So paged and static logits agree to float rounding (tests/test_serving_paged.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..attention import attend
from ..cache import LayerKV, bytes_per_token_per_layer
from ..config import ModelConfig


class PagedLayerKV(NamedTuple):
    """One layer's block pool. k, v: [N, P, K, D]."""

    k: jax.Array
    v: jax.Array


PagedPool = tuple  # tuple[PagedLayerKV, ...], one entry per decoder block


def block_bytes(cfg: ModelConfig, block_size: int) -> int:
    """Bytes one block takes over all layers: P x L x bytes_per_token_per_layer(cfg)."""
    return int(block_size) * cfg.num_blocks * bytes_per_token_per_layer(cfg)


def num_blocks_for_memory(cfg: ModelConfig, memory_bytes: int, block_size: int) -> int:
    """How many blocks of ``block_size`` tokens fit in ``memory_bytes`` of KV memory (floor).

    Raises ValueError if not even one block fits.
    """
    per_block = block_bytes(cfg, block_size)
    count = int(memory_bytes) // per_block
    if count < 1:
        raise ValueError(f"kv memory {int(memory_bytes)} bytes holds no block: one block of {block_size} "
                         f"tokens takes {per_block} bytes for this model")
    return count


def init_pool(cfg: ModelConfig, num_blocks: int, block_size: int) -> PagedPool:
    """Zeros in cfg.cache_dtype: per layer PagedLayerKV(k, v) of [N, P, K, D] each.

    Raises ValueError for attention="mla" (latent pool not implemented) or non-positive sizes.
    """
    if cfg.attention == "mla":
        raise ValueError("attention='mla' is not supported by the paged cache yet: it needs a latent pool "
                         "(c_kv [N, P, C], k_rope [N, P, R]); use attention in ('mha', 'gqa', 'mqa')")
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
    shape = (num_blocks, block_size, cfg.kv_heads, cfg.head_size)
    dtype = cfg.jnp_cache_dtype
    return tuple(PagedLayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(cfg.num_blocks))


def pool_nbytes(pool: PagedPool) -> int:
    """Total bytes of the pool's arrays."""
    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(pool)))


def gather_rows(layer: PagedLayerKV, block_table: jax.Array) -> LayerKV:
    """Each row's blocks laid end to end. block_table: [B, M] int32 -> LayerKV of [B, K, M*P, D]."""
    B, M = block_table.shape
    _, P, K, D = layer.k.shape

    def rows(pool):
        return pool[block_table].reshape(B, M * P, K, D).transpose(0, 2, 1, 3)

    return LayerKV(rows(layer.k), rows(layer.v))


def scatter_new(layer: PagedLayerKV, k_new, v_new, block_table, cache_index, num_new) -> PagedLayerKV:
    """Write row b's first num_new[b] new keys/values at token positions cache_index[b] + j.

    k_new, v_new: [B, K, T, D]; block_table: [B, M] int32; cache_index, num_new: [B] int32.
    Padding positions (j >= num_new[b]) are dropped, never written.
    """
    B, K, T, D = k_new.shape
    N, P = layer.k.shape[:2]
    M = block_table.shape[1]
    pos = cache_index[:, None] + jnp.arange(T, dtype=jnp.int32)[None]          # [B, T]
    valid = jnp.arange(T)[None] < num_new[:, None]
    block = jnp.take_along_axis(block_table, jnp.clip(pos // P, 0, M - 1), axis=1)
    block = jnp.where(valid, block, N).reshape(-1)                              # N: out of range -> dropped
    offset = (pos % P).reshape(-1)

    def put(pool, new):
        rows = new.transpose(0, 2, 1, 3).reshape(B * T, K, D).astype(pool.dtype)
        return pool.at[block, offset].set(rows, mode="drop")

    return PagedLayerKV(put(layer.k, k_new), put(layer.v, v_new))


class PagedView(NamedTuple):
    """A layer's pool plus the batch's paging metadata, handed to the model as its layer cache.

    pool: PagedLayerKV [N, P, K, D]; block_table: [B, M] int32; num_new: [B] int32 valid new tokens per row.
    """

    pool: PagedLayerKV
    block_table: jax.Array
    num_new: jax.Array

    def attend_and_write(self, q, k, v, cache_index, key_start, window):
        """Attention hook called by ``dantinox.attention.Attention``.

        q: [B, K, G, T, D] (scaled); k, v: [B, K, T, D]; cache_index: [B] int32 tokens already cached per
        row; key_start must be None (no left padding in a paged batch). Returns (y [B, K, G, T, D] float32,
        the PagedView with the new keys and values written).
        """
        if key_start is not None:
            raise ValueError("key_start (left padding) is not used with a paged cache: pass key_start=None")
        y = attend(q, k, v, gather_rows(self.pool, self.block_table), cache_index, None, window)
        pool = scatter_new(self.pool, k, v, self.block_table, cache_index, self.num_new)
        return y, self._replace(pool=pool)


def paged_views(pool: PagedPool, block_table, num_new) -> tuple:
    """One PagedView per layer, sharing the batch's block tables [B, M] and valid-token counts [B]."""
    return tuple(PagedView(layer, block_table, num_new) for layer in pool)
