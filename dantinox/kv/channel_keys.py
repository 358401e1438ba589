"""Per-channel int8 keys over groups of tokens (KIVI, Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", sections 3.2-3.3): the default int8 key layout of MHA / GQA / MQA caches
(``ModelConfig.kv_keys="channel"``); ``dantinox eval`` on SmolLM2's slices measured it ahead of the per-token rows
of ``dantinox.kv.int8_rows`` with attention sinks (``kv_keys="token"``, docs/explanation/quantization.md).

Why per channel. Key outliers sit in a few fixed channels for every token (KIVI, figure 2), so one scale per
token (row) is set by those channels and coarsens the rest of the row; one scale per channel over a group of G
consecutive tokens follows them instead. Values have no fixed outlier channels and stay per token.

The layout (G = ``group``; slots are grouped from slot 0: group g holds slots g G .. g G + G - 1):
  - keys of a *complete* group: int8 codes with one float32 scale per (group, KV head, channel),
    scale = max over the group's G tokens of |k| / 127 (symmetric absmax, as ``kv_rows``; 0 for an all-zero
    channel, read back as exact zeros), the row's float32 attention sinks (``kv_sinks``: always read from
    their float32 copy) and left padding counting as zeros, so an outlier sink token (K13) cannot coarsen the
    other keys of its group;
  - keys of the group still filling (KIVI's full-precision residual): float32, in a ring of R = 2 G slots per
    sequence (``RING_GROUPS``; slot s at ring position s mod R) that also keeps the group before it, so a
    speculative rollback that un-completes a group still finds its float keys (below, Rollback);
  - values: int8 rows with one float32 scale per (token, KV head), exactly ``kv_rows``.
A query at slot t reads key slot s from int8 when s's group was complete before t, i.e. (s // G + 1) G <= t,
and in float32 otherwise. The rule depends on positions only, so a run fed one token at a time, in chunks or
all at once sees the same keys (the cache is exact-able).

Rollback (speculative decoding). A verify call writes k + 1 tentative tokens at slots c .. c + k and the row
continues from some t' in (c, c + k + 1]; the rejected slots are rewritten later. With k + 1 <= G
(``check_spec_group``) the write spans at most two groups and t' // G >= (c + k + 1) // G - 1, so the ring,
which after every write holds the float keys of the groups e // G - 1 and e // G (e = the slot after the
write), still holds the keys of t''s group. A group is quantized from the ring and the new keys whenever a
write completes it, also again after a rollback un-completed it; its stale codes meanwhile are never read,
since the read rule asks (s // G + 1) G <= t of the reading query.

Bytes (``dantinox.kv.sizes``, from the codec's fields), per layer and sequence of S slots: S (2 K D + 4 K) for the
int8 keys,
values and value scales, ceil(S / G) K D 4 for the key scales and 2 G K D 4 for the residual ring (the static
cache allocates exactly these arrays, ``dantinox.kv.channel_layout``; float32 sinks come on top when A > 0).
Per token that is 2 K D + 4 K + 4 K D / G against 2 K (D + 4) for per-token keys: at G = D (64 for SmolLM2)
exactly the per-token layout's bytes per token; G = 32 at D = 64 costs 4 K bytes more. The ring is a fixed
2 G K D 4 per layer and sequence (SmolLM2, G = 64: 96 KiB per layer, 2.8 MiB over its 30 layers).

Where it runs: the static cache (``dantinox.kv.channel_layout.ChannelQuantLayerKV``, so the compiled decode
loop, ``dantinox generate`` / ``verify`` / ``budget`` / ``eval``) and the eval view
``dantinox.quality.channel_keys`` (keys stored in float32 and quantized on read: the same numbers). The shared
write primitives below (``group_span``, ``reads_int8``, ``span_slots``) serve any cache that stores the layout.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .int8_rows import QMAX, SCALE_DTYPE

DEFAULT_GROUP = 64   # G: key scales then cost 4 K bytes per token, as per-token rows do (KIVI uses 32 and 128;
                     # on SmolLM2 G = 64 measured better than 32, docs/explanation/quantization.md)
RING_GROUPS = 2      # the float32 residual keeps the last 2 groups a write touched (module docstring, Rollback)


def ring_slots(group: int) -> int:
    """R, the slots of one sequence's residual ring: RING_GROUPS x group."""
    return RING_GROUPS * int(group)


def check_spec_group(cfg: ModelConfig, spec_tokens: int) -> None:
    """With per-channel keys (cfg.channel_keys) a verify call's k + 1 tokens must fit one key group, so a
    rollback finds its group's float keys in the residual ring (module docstring, Rollback): ValueError naming
    --spec-tokens and --kv-key-group unless spec_tokens + 1 <= cfg.key_group. Nothing for other caches."""
    G = cfg.key_group
    if cfg.channel_keys and int(spec_tokens) + 1 > G:
        raise ValueError(f"--spec-tokens {spec_tokens} is not allowed with --kv-key-group {G} "
                         f"(per-channel int8 keys): spec_tokens + 1 must be <= the key group, so give --spec-tokens "
                         f"<= {G - 1} or a larger --kv-key-group (or --kv-keys token)")


def check_group(group) -> int:
    """``group`` as an int >= 1; ValueError naming --kv-key-group otherwise."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"--kv-key-group {group!r} is not allowed: an integer >= 1 (tokens per key-scale group)")
    return group


KEY_LAYOUTS = ("token", "channel")   # --kv-keys: ModelConfig.kv_keys


def config_with_kv_keys(cfg: ModelConfig, keys: str | None, group: int | None = None) -> ModelConfig:
    """cfg with kv_keys = ``keys`` and kv_key_group = ``group`` (None keeps each: the run's, by default
    "channel" and 64). Raises ValueError naming --kv-keys / --kv-key-group for a value outside the allowed set,
    for an explicit --kv-keys channel on a cache that is not an int8 MHA / GQA / MQA one (attention="mla" or a
    float cache_dtype; a run's own "channel" there simply means per-token or float keys, ``cfg.channel_keys``),
    for a group on such a cache or with token keys, and for a group longer than max_context (no group would
    ever complete, so the keys would stay in float32)."""
    if keys is not None and keys not in KEY_LAYOUTS:
        raise ValueError(f"--kv-keys {keys!r} is not allowed: one of {', '.join(KEY_LAYOUTS)}")
    if group is not None:
        check_group(group)
    out = cfg.replace(kv_keys=keys or cfg.kv_keys, kv_key_group=group or cfg.kv_key_group)
    if (keys == "channel" or group is not None) and out.kv_keys == "channel" and not out.channel_keys:
        given = "--kv-keys channel" if keys == "channel" else f"--kv-key-group {group}"
        raise ValueError(f"{given} needs an int8 MHA / GQA / MQA cache (give --kv-dtype int8); the model "
                         f"has attention={cfg.attention!r}, cache_dtype={cfg.cache_dtype!r}")
    if group is not None and out.kv_keys != "channel":
        raise ValueError(f"--kv-key-group {group} is not allowed with --kv-keys token: it sets the per-channel "
                         "key groups (give --kv-keys channel)")
    if group is not None and group > cfg.max_context:
        raise ValueError(f"--kv-key-group {group} is not allowed: longer than the model's max_context="
                         f"{cfg.max_context}, so no key group would ever complete (give at most "
                         f"{cfg.max_context}, or --kv-keys token)")
    return out


def with_kv_keys(model, keys: str | None, group: int | None = None):
    """The model with ``config_with_kv_keys(model.cfg, keys, group)`` (the same parameter arrays; the model
    itself when nothing changes). Raises ValueError as ``config_with_kv_keys``."""
    from ..quant.kv_dtype import with_config
    return with_config(model, config_with_kv_keys(model.cfg, keys, group))


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


def reads_int8(key_slots, query_slots, group: int):
    """The read rule: may the query at slot t read key slot s from its group's int8 codes? True when s's
    group was complete before t, (s // G + 1) G <= t; otherwise the key is read in float32 (the filling
    group). key_slots, query_slots: int arrays that broadcast against each other. Returns bool of the
    broadcast shape."""
    return (key_slots // group + 1) * group <= query_slots


def span_slots(new_tokens: int, group: int) -> int:
    """Lx, the slots of the span one write of T = new_tokens tokens touches, from the start of the group it
    begins in: G (ceil(T / G) + 1), enough for any offset 0 <= o < G into that group."""
    return group * (-(-new_tokens // group) + 1)


def group_span(residual: jax.Array, new: jax.Array, offset: jax.Array, count=None) -> jax.Array:
    """The float32 keys of the groups a write touches, from the start of the group it begins in.

    residual: [B, K, G, D] float32, the filling group's keys (its first ``offset`` slots hold keys; a
    ring's group: ``ring_group``);
    new: [B, K, T, D], the new tokens' keys, the first at slot offset of that group; offset: [B] int32 in
    [0, G) (cache_index mod G); count: [B] int32 or None (T): only the first count new tokens are kept, the
    rest (right padding) reads as zeros. Returns [B, K, Lx, D] float32 (Lx = ``span_slots(T, G)``): position j
    is residual[j] for j < offset, new[j - offset] for offset <= j < offset + count, 0 after.
    """
    B, K, G, D = residual.shape
    T = new.shape[-2]
    L = span_slots(T, G)
    o = jnp.reshape(offset, (-1, 1))
    n = T if count is None else jnp.reshape(count, (-1, 1))
    j = jnp.arange(L, dtype=jnp.int32)[None]                                   # [1, Lx]
    at = lambda idx: jnp.reshape(idx, (idx.shape[0], 1, L, 1))  # noqa: E731
    old = jnp.take_along_axis(residual.astype(jnp.float32), at(jnp.clip(jnp.broadcast_to(j, (B, L)), 0, G - 1)),
                              axis=-2)
    fresh = jnp.take_along_axis(new.astype(jnp.float32), at(jnp.clip(j - o, 0, T - 1)), axis=-2)
    span = jnp.where(at(j < o), old, jnp.where(at((j >= o) & (j < o + n)), fresh, 0.0))
    return span


def ring_group(ring: jax.Array, cache_index: jax.Array, group: int) -> jax.Array:
    """The filling group's float32 keys out of a residual ring: ring [B, K, R, D] (slot s at s mod R);
    cache_index: [B] int32. Returns [B, K, G, D]: slots (c // G) G + j, j < G, of each row (G = group; only
    the first c mod G are keys, ``group_span`` reads no more)."""
    R = ring.shape[-2]
    j = (cache_index - cache_index % group)[:, None] + jnp.arange(group, dtype=jnp.int32)[None]     # [B, G]
    return jnp.take_along_axis(ring, (j % R)[:, None, :, None], axis=-2)


__all__ = ["DEFAULT_GROUP", "KEY_LAYOUTS", "RING_GROUPS", "channel_roundtrip",
           "check_group", "check_spec_group", "config_with_kv_keys", "dequantize_channels", "group_span",
           "quantize_channels", "reads_int8", "ring_group", "ring_slots", "span_slots", "with_kv_keys"]
