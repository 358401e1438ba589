"""Per-channel int8 keys over groups of tokens (KIVI, Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", sections 3.2-3.3): the second int8 key layout ``dantinox eval --kv-keys channel``
measures against the per-token rows of ``dantinox.quant.kv_rows`` with attention sinks.

Why per channel. Key outliers sit in a few fixed channels for every token (KIVI, figure 2), so one scale per
token (row) is set by those channels and coarsens the rest of the row; one scale per channel over a group of G
consecutive tokens follows them instead. Values have no fixed outlier channels and stay per token.

The layout (G = ``group``; slots are grouped from slot 0: group g holds slots g G .. g G + G - 1):
  - keys of a *complete* group: int8 codes with one float32 scale per (group, KV head, channel),
    scale = max over the group's G tokens of |k| / 127 (symmetric absmax, as ``kv_rows``; 0 for an all-zero
    channel, read back as exact zeros);
  - keys of the group still filling (KIVI's full-precision residual): float32, at most G tokens per sequence;
  - values: int8 rows with one float32 scale per (token, KV head), exactly ``kv_rows``.
A query at slot t reads key slot s from int8 when s's group was complete before t, i.e. (s // G + 1) G <= t,
and in float32 otherwise. The rule depends on positions only, so a run fed one token at a time, in chunks or
all at once sees the same keys (the cache is exact-able).

Bytes (``channel_key_cache_bytes``), per layer and sequence of S slots (S rounded up to whole groups):
S (2 K D + 4 K) for the int8 keys, values and value scales, (S / G) K D 4 for the key scales and G K D 4 for the
residual. Per token that is 2 K D + 4 K + 4 K D / G against 2 K (D + 4) for per-token keys: at G = D (64 for
SmolLM2) exactly the per-token layout's bytes per token; G = 32 at D = 64 costs 4 K bytes more.

What exists: the quantizer below and the cache view ``dantinox.quality.channel_keys`` that ``dantinox eval``
runs (keys stored in float32 and quantized on read, the same numbers as the layout above, not its memory);
the static cache, the compiled decode loop and the paged pool have no per-channel form (docs/quantization.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .kv_rows import QMAX, SCALE_BYTES, SCALE_DTYPE

DEFAULT_GROUP = 64   # G: key scales then cost 4 K bytes per token, as per-token rows do (KIVI uses 32 and 128;
                     # on SmolLM2 G = 64 measured better than 32, docs/quantization.md)


def check_group(group) -> int:
    """``group`` as an int >= 1; ValueError naming --kv-key-group otherwise."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"--kv-key-group {group!r} is not allowed: an integer >= 1 (tokens per key-scale group)")
    return group


def quantize_channels(k: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """Quantize keys per channel over groups of ``group`` slots.

    k: [..., S, D] with S a multiple of group. Returns (q [..., S, D] int8 in [-127, 127], scale
    [..., S / group, D] float32: max |k| over each group's slots / 127, per channel). Raises ValueError when S
    is not a multiple of group.
    """
    *lead, S, D = k.shape
    if S % group:
        raise ValueError(f"{S} slots do not divide into key groups of {group}")
    x = k.astype(jnp.float32).reshape(*lead, S // group, group, D)
    scale = jnp.max(jnp.abs(x), axis=-2, keepdims=True) / QMAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe), -QMAX, QMAX).astype(jnp.int8)
    return q.reshape(k.shape), scale[..., 0, :].astype(SCALE_DTYPE)


def dequantize_channels(q: jax.Array, scale: jax.Array, group: int, dtype=jnp.float32) -> jax.Array:
    """q * scale of its group and channel. q: [..., S, D] int8; scale: [..., S / group, D] float32.
    Returns [..., S, D] ``dtype``."""
    per_slot = jnp.repeat(scale.astype(jnp.float32), group, axis=-2)
    return (q.astype(jnp.float32) * per_slot).astype(dtype)


def channel_roundtrip(k: jax.Array, group: int) -> jax.Array:
    """Keys read back from their per-channel int8 groups: [..., S, D] float32 (S a multiple of group)."""
    return dequantize_channels(*quantize_channels(k, group), group)


def channel_key_cache_bytes(cfg: ModelConfig, seq_len: int, group: int) -> int:
    """Bytes of one sequence's cache in the per-channel key layout (module docstring), every layer:
    num_blocks x (S (2 K D + 4 K) + (S / G) K D 4 + G K D 4) with S = seq_len rounded up to whole groups.
    MHA / GQA / MQA only; raises ValueError for attention="mla" or a bad seq_len / group."""
    if cfg.attention == "mla":
        raise ValueError("per-channel keys (--kv-keys channel) are defined for MHA / GQA / MQA caches, not "
                         "attention='mla' (its latent has no per-head keys)")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} is not allowed: an integer >= 1")
    G, K, D = check_group(group), cfg.kv_heads, cfg.head_size
    S = math.ceil(seq_len / G) * G
    per_layer = S * (2 * K * D + SCALE_BYTES * K) + (S // G) * K * D * SCALE_BYTES + G * K * D * 4
    return cfg.num_blocks * per_layer


__all__ = ["DEFAULT_GROUP", "channel_key_cache_bytes", "channel_roundtrip", "check_group", "dequantize_channels",
           "quantize_channels"]
