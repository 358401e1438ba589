"""The static cache's per-channel int8 key layout (KIVI, Liu et al. 2024, sections 3.2-3.3; the layout, read
rule and bytes are ``dantinox.kv.channel_keys``'s): ``ChannelQuantLayerKV``, its shapes and allocation. The
attention that writes and reads it is ``dantinox.kv.channel_attention``.

What one layer stores (B batch, K KV heads, S slots, D head size, G = cfg.key_group, N = ceil(S / G),
A = cfg.sink_slots):
  - k: [B, K, S, D] int8, the keys of every *complete* group, quantized per channel over the group's G slots;
    k_scale: [B, K, N, D] float32, one scale per (group, KV head, channel). Slots of a group still filling
    hold codes that are never read (they are rewritten when the group completes).
  - k_residual: [B, K, R, D] float32 with R = 2 G (``kv_channels.ring_slots``), a ring: slot s at s mod R.
    After a write ending at slot e it holds the float keys of the groups e // G - 1 and e // G (the filling
    one), so a speculative rollback into the group before still finds its keys (``kv_channels``, Rollback).
    Rows have their own cache_index, so their own ring.
  - v: [B, K, S, D] int8 and v_scale: [B, K, S, 1] float32, values per token (``dantinox.kv.int8_rows``).
  - k_sink, v_sink: [B, K, A, D] float32, the row's first A tokens in full (``dantinox.kv.sinks``).
S need not be a multiple of G: the last, partial group never completes and stays in the residual.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .channel_keys import RING_GROUPS, ring_slots
from .int8_rows import SCALE_DTYPE
from .sinks import SINK_DTYPE
from .zero_pages import zeros

class ChannelQuantLayerKV(NamedTuple):
    """One layer's int8 cache with per-channel keys (module docstring). k, v: [B, K, S, D] int8; k_scale:
    [B, K, ceil(S / G), D] float32; v_scale: [B, K, S, 1] float32; k_residual: [B, K, 2 G, D] float32 (the
    residual ring); k_sink, v_sink: [B, K, A, D] float32."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    k_residual: jax.Array
    k_sink: jax.Array
    v_sink: jax.Array

    @property
    def group(self) -> int:
        """G, slots per key-scale group."""
        return self.k_residual.shape[-2] // RING_GROUPS

    def first_slots(self, L: int) -> ChannelQuantLayerKV:
        """The layer cut to its first L slots (a copy): k, v, v_scale [.., L, ..], k_scale the ceil(L / G)
        groups that cover them, the residual whole, the sinks their first min(A, L)."""
        G = self.group
        return ChannelQuantLayerKV(self.k[..., :L, :], self.v[..., :L, :], self.k_scale[..., :-(-L // G), :],
                                   self.v_scale[..., :L, :], self.k_residual, self.k_sink[..., :L, :],
                                   self.v_sink[..., :L, :])

    def keys(self, dtype) -> jax.Array:
        """Every slot's key read from int8 (codes x their group's scale): [B, K, S, D] ``dtype`` (meaningful
        for complete groups only)."""
        scale = jnp.repeat(self.k_scale, self.group, axis=-2)[..., :self.k.shape[-2], :]
        return (self.k.astype(jnp.float32) * scale).astype(dtype)


def channel_cache_shapes(cfg: ModelConfig, batch_size: int, slots: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Shapes of one ChannelQuantLayerKV's arrays in field order (k, v, k_scale, v_scale, k_residual, k_sink,
    v_sink) for batch_size rows of ``slots`` slots (default cfg.max_context; fewer: a cache cut by
    ``first_slots``, whose sinks keep min(A, slots) rows)."""
    S = cfg.max_context if slots is None else int(slots)
    B, K, D, G, A = int(batch_size), cfg.kv_heads, cfg.head_size, cfg.key_group, min(cfg.sink_slots, S)
    return ((B, K, S, D), (B, K, S, D), (B, K, -(-S // G), D), (B, K, S, 1), (B, K, ring_slots(G), D), (B, K, A, D),
            (B, K, A, D))


def init_channel_layer(cfg: ModelConfig, batch_size: int, slots: int | None = None) -> ChannelQuantLayerKV:
    """One layer's ChannelQuantLayerKV of zeros (``channel_cache_shapes``): int8 k and v, float32 the rest.
    slots: fewer than max_context gives the layout of a cache cut to them (``first_slots``: the model's key
    group, its ring whole), which the model reads like a cut cache (eval's windows)."""
    dtypes = (jnp.int8, jnp.int8, SCALE_DTYPE, SCALE_DTYPE, jnp.float32, SINK_DTYPE, SINK_DTYPE)
    shapes = channel_cache_shapes(cfg, batch_size, slots)
    return ChannelQuantLayerKV(*(zeros(s, d) for s, d in zip(shapes, dtypes)))  # pages left to the OS: zero_pages
