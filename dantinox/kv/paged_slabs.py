"""Attention over a paged pool in slabs of blocks: cost in the slots a row has filled, not in the table's width.

Gathering every row's whole block table ([B, K, M P, D]: 8,192 slots for SmolLM2) before each prefill chunk or
decode step made a call's cost grow with max_context, not with what is cached. Here the old slots are read a
slab at a time (``SLAB_BLOCKS`` table entries, gathered with the pool layer's own ``read``: float rows, or int8
rows read back), in a loop whose trip count is traced (the furthest filled slot of the batch), and each slab
is folded into an online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
FlashAttention's running max and sum, Dao et al. 2022, section 3.1): one compiled program per call shape,
whatever the fill, and GEMM-shaped work ([G T, D] x [D, slab]) that suits many queries (prefill chunks). The
compiled paged kernel (``dantinox.kv.decode_kernel.paged_attention``) is faster for a few queries per row
(decode steps, verify calls) on a float32 pool; ``dantinox.kv.paged.PagedView`` picks.

Masks are ``dantinox.kv.attend``'s: old slot s visible to new query i when s < cache_index (and inside the
window; the A sink slots are read from the sink arrays, never from the blocks), the new tokens causal among
themselves. Same numbers as ``attend`` over the gathered table up to float32 rounding (the sum's order).
Letters: N blocks, P tokens per block, M table entries; the rest as ``dantinox.kv.attend``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .attend import NEG_INF, new_token_mask, old_slot_mask, sink_mask
from .scores import grouped_scores, grouped_values

SLAB_BLOCKS = 32   # table entries per slab (512 slots at P = 16)


class _Softmax:
    """Running (max, sum, weighted values) of one softmax over segments of keys (module docstring)."""

    @staticmethod
    def start(q):
        B, K, G, T, D = q.shape
        return (jnp.full((B, K, G, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
                jnp.zeros((B, K, G, T, D), jnp.float32))

    @staticmethod
    def fold(state, q, keys, values, visible):
        """state folded with keys, values [B, K, S', D] where visible [B or 1, 1 or T, S'] (bool)."""
        m, total, acc = state
        scores = jnp.where(visible[:, None, None], grouped_scores(q, keys.astype(q.dtype)), NEG_INF)
        top = jnp.maximum(m, scores.max(-1))
        p = jnp.exp(scores - top[..., None])
        scale = jnp.exp(m - top)
        return (top, total * scale + p.sum(-1),
                acc * scale[..., None] + grouped_values(p.astype(q.dtype), values.astype(q.dtype)))


def slab_attention(q, k, v, layer, gather, block_table, sink_slot, cache_index, window) -> jax.Array:
    """Softmax attention of T new tokens per row over [sinks ; the filled old slots ; the new tokens].

    q: [B, K, G, T, D] scaled queries; k, v: [B, K, T, D] the new keys and values as attention sees them;
    layer: the pool layer (block fields [N, P, K, ...], then its sink fields); gather(layer, table [B, m],
    sink_slot) -> a static layer of [B, K, m P, ...] with ``read(dtype)`` (``dantinox.kv.paged.gather_rows``);
    block_table: [B, M] int32; sink_slot: [B] int32 or None; cache_index: [B] int32 (no left padding in a pool);
    window: the sliding window or None. Returns [B, K, G, T, D] float32.
    """
    T = q.shape[3]
    state = _Softmax.fold(_Softmax.start(q), q, k, v, new_token_mask(T, cache_index, None, window))
    first = gather(layer, block_table[:, :1], sink_slot)                 # one block: the sinks come with it
    _, sinks = first.read(q.dtype)
    A = 0 if sinks is None else sinks.k.shape[2]
    if A:
        state = _Softmax.fold(state, q, sinks.k, sinks.v, sink_mask(A, T, cache_index, None, window))
    P = layer[0].shape[1]
    M = block_table.shape[1]
    slab = min(SLAB_BLOCKS, M)
    table = jnp.pad(block_table, ((0, 0), (0, -M % slab)))              # whole slabs (padding: block 0, masked)
    count = (jnp.max(cache_index) + slab * P - 1) // (slab * P)           # slabs holding a filled slot

    def body(j, state):
        part = jax.lax.dynamic_slice_in_dim(table, j * slab, slab, axis=1)
        old, _ = gather(layer, part, sink_slot).read(q.dtype)
        visible = old_slot_mask(slab * P, T, cache_index - j * slab * P, None, window, 0)
        if A:   # the sink slots are read from the sink arrays, never from the blocks
            visible = visible & (j * slab * P + jnp.arange(slab * P)[None, None] >= A)
        return _Softmax.fold(state, q, old.k, old.v, visible)

    _, total, acc = jax.lax.fori_loop(0, count, body, state)
    return acc / total[..., None]
