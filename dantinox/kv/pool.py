"""The paged pool on the device: one layer per decoder block, allocated up front from the layers' specs.

``init_pool(cfg, N, P, R, Q)`` allocates, per layer, ``LayerSpec.init_paged``: the blocks ([N, P, ...] per
block field), R sink slots (an int8 pool's per-sequence float32 sinks, ``dantinox.kv.sink_slots``) and Q
residual slots (per-channel keys' per-sequence rings, ``dantinox.kv.residual_slots``); the layer types and the
attention views over block tables are ``dantinox.kv.paged``'s. Its bytes are ``dantinox.kv.sizes.pool_bytes``.
Letters: N blocks, P tokens per block, R sink slots, Q residual slots; the rest as ``dantinox.kv.attend``.
"""

from __future__ import annotations

import jax

from ..config import ModelConfig
from .channel_paged import check_channel_block_size
from .paged import PagedPool
from .spec import layer_specs


def init_pool(cfg: ModelConfig, num_blocks: int, block_size: int, sink_slots: int = 1,
              residual_slots: int = 1) -> PagedPool:
    """Zeros, one pool layer per decoder block (``LayerSpec.init_paged``): PagedLayerKV(k, v) of [N, P, K, D],
    PagedLatentKV (c_kv [N, P, C], k_rope [N, P, R]) for attention="mla"; for cache_dtype="int8" PagedQuantKV /
    PagedQuantLatentKV with float32 scales and ``sink_slots`` sets of sinks, or with per-channel keys
    PagedChannelKV with ``residual_slots`` residual rings. Pages are left to the OS until written.

    Raises ValueError for a non-positive num_blocks, block_size, sink_slots or residual_slots, an int8 cache
    whose sink tokens (cfg.kv_sink_tokens) do not fit in one block, or per-channel keys with a block size that
    is not a multiple of cfg.key_group.
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("sink_slots", sink_slots),
                        ("residual_slots", residual_slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
    if cfg.channel_keys:
        check_channel_block_size(cfg, block_size)
    if cfg.sink_slots > block_size:
        raise ValueError(f"block_size={block_size} is not allowed with kv_sink_tokens={cfg.kv_sink_tokens}: "
                         "the int8 cache's sink tokens must fit in a sequence's first block (block_size >= "
                         "kv_sink_tokens)")
    return tuple(spec.init_paged(num_blocks, block_size, sink_slots, residual_slots) for spec in layer_specs(cfg))


def pool_nbytes(pool: PagedPool) -> int:
    """Total bytes of the pool's arrays (read from the arrays themselves)."""
    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(pool)))
