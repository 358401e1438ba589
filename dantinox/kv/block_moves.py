"""Block moves of the paged pool: copy-on-write copies, swap to host memory and back, sink and residual slots.

Compiled functions over the whole pool (every layer), each with static shapes chosen by the caller (padded index
lists), so each compiles once; the pool is donated, so XLA updates it in place. The cache manager
(``dantinox.kv.manager``) decides what moves. Letters: N blocks, P tokens per block, M block-table entries,
R sink slots, A sink tokens, Q residual slots, G key group; the rest as ``dantinox.kv.attend``.
"""

from __future__ import annotations

from functools import partial

import jax

from ..parallel.sharding import constrain_pool
from .channel_paged import PagedChannelKV
from .paged import BLOCK_FIELDS, SINK_FIELDS, PagedPool, block_fields, sink_fields, with_sinks

# The block moves work on every block array of every layer alike (k and v [N, P, K, D], or for MLA c_kv [N, P, C]
# and k_rope [N, P, R], and the int8 scales): the first BLOCK_FIELDS fields of each layer NamedTuple have the
# block axis first. The int8 sinks (the next SINK_FIELDS fields, [R, A, ...]) are per sequence: read_sinks /
# write_sinks; so is the per-channel keys' residual (the last field, [Q, 2 G, K, D]): read_residual / write_residual.

def _with_blocks(layer, blocks) -> tuple:
    """The layer with its block arrays replaced by ``blocks`` and its other arrays kept."""
    return type(layer)(*blocks, *layer[BLOCK_FIELDS:])


@partial(jax.jit, donate_argnames=("pool",))
def copy_blocks(pool: PagedPool, src, dst) -> PagedPool:
    """pool[dst[i]] = pool[src[i]] in every layer. src, dst: [C] int32; dst = N marks padding (dropped)."""
    return constrain_pool(tuple(_with_blocks(layer, (a.at[dst].set(a[src], mode="drop") for a in block_fields(layer)))
                                for layer in pool))


@jax.jit
def read_blocks(pool: PagedPool, blocks):
    """Contents of ``blocks`` ([M] int32) in every layer: per layer a tuple of its block arrays ([M, P, K, D]
    each for k and v, or [M, P, C] and [M, P, R] for MLA, then the int8 scales)."""
    return tuple(tuple(a[blocks] for a in block_fields(layer)) for layer in pool)


@partial(jax.jit, donate_argnames=("pool",))
def write_blocks(pool: PagedPool, blocks, data) -> PagedPool:
    """pool[blocks[i]] = data[i] in every layer. blocks: [M] int32 (N = padding, dropped); data: as returned
    by ``read_blocks``."""
    return constrain_pool(tuple(_with_blocks(layer, (a.at[blocks].set(d, mode="drop")
                                                     for a, d in zip(block_fields(layer), new)))
                                for layer, new in zip(pool, data)))


@jax.jit
def read_sinks(pool: PagedPool, slot):
    """One sink slot's rows (``slot``, int32 scalar) in every layer: per layer a tuple of its sink arrays
    ([A, K, D] each, or [A, C] and [A, R] for MLA; empty for a float pool)."""
    return tuple(tuple(a[slot] for a in sink_fields(layer)) for layer in pool)


@partial(jax.jit, donate_argnames=("pool",))
def write_sinks(pool: PagedPool, slot, data) -> PagedPool:
    """pool's sink slot ``slot`` (int32 scalar) set to ``data`` (as returned by ``read_sinks``) in every
    layer."""
    return constrain_pool(tuple(with_sinks(layer, [a.at[slot].set(d) for a, d in zip(sink_fields(layer), new)])
                                for layer, new in zip(pool, data)))


@partial(jax.jit, donate_argnames=("pool",))
def copy_sinks(pool: PagedPool, src, dst) -> PagedPool:
    """pool's sink slot dst = sink slot src (int32 scalars) in every layer."""
    return constrain_pool(tuple(with_sinks(layer, [a.at[dst].set(a[src]) for a in sink_fields(layer)])
                                for layer in pool))


_RESIDUAL = BLOCK_FIELDS + SINK_FIELDS  # the per-channel key pool's residual field


@jax.jit
def read_residual(pool: PagedPool, slot):
    """One residual slot (``slot``, int32 scalar) of a per-channel key pool: per layer its [2 G, K, D] float32
    residual ring (``dantinox.kv.channel_paged``); an empty tuple for a layer without one (a draft
    model's float layers beside per-channel target layers)."""
    return tuple(layer[_RESIDUAL][slot] if isinstance(layer, PagedChannelKV) else () for layer in pool)


@partial(jax.jit, donate_argnames=("pool",))
def write_residual(pool: PagedPool, slot, data) -> PagedPool:
    """The per-channel key pool's residual slot ``slot`` (int32 scalar) set to ``data`` (as returned by
    ``read_residual``) in every layer."""
    return constrain_pool(tuple(layer._replace(k_resid=layer.k_resid.at[slot].set(d))
                                if isinstance(layer, PagedChannelKV) else layer for layer, d in zip(pool, data)))
