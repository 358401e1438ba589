"""Attention over the per-channel int8 key cache (KIVI, Liu et al. 2024, sections 3.2-3.3): it reads and
writes ``dantinox.kv.channel_layout.ChannelQuantLayerKV`` (what is stored there; the read rule and bytes
are ``dantinox.kv.channel_keys``'s). Shape letters as there; Lx the slots of the span a write touches.

Writes. A call writing T tokens at slot c of a row assembles the span of groups it touches, from the start
r0 = (c // G) G of the group it begins in: the residual's first c - r0 keys, then the new keys
(``group_span``). Each group of the span that the write completes is quantized (``quantize_channels``) and
its codes and scales stored; the group the write ends in becomes the new residual. A group is quantized once,
from all G of its float keys, whatever the chunking, so a run fed all at once, in chunks or one token at a
time stores the same codes and scales. Right padding past a row's real tokens (``valid``: prefill's
bucketed prompts), left padding before key_start and the row's A sink tokens (read from the float32 sink
arrays, never from their codes) never enter a group: their keys count as zeros, so an outlier sink token
(K13) does not coarsen the other keys of its group.

Reads (before the write, so XLA can update the cache in place). The query at slot t sees
  - the sinks, from the sink arrays (updated with the new tokens' sinks first);
  - old slots s < r0 (whole groups written by earlier calls) from int8;
  - the span's slots (r0 .. c + T - 1: the residual's keys and the new ones) from int8 when the read rule
    (s // G + 1) G <= t holds (the group was complete before t, also when this very call completed it), in
    float32 otherwise; their values from the old int8 rows (s < c) or the new ones.
The uncached forward (layer cache None) runs the same attention over an empty cache, so the cached and
uncached runs see the same keys (what ``dantinox verify`` compares).

Rollback. A write past the slot a row later continues from (speculative decoding's rejected tokens) may have
completed a group the row then continues inside. The residual is a ring of 2 G slots holding the groups the
last write ended in and the one before (``_write``), so the next write still assembles that group from its
float keys and quantizes it again when it completes; the group's stale codes are never read meanwhile (the
read rule). This needs the rolled-back write to span at most G slots: spec_tokens + 1 <= G
(``dantinox.kv.channel_keys.check_spec_group``). Slots are grouped from slot 0, not from key_start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .channel_keys import group_span, quantize_channels, reads_int8, ring_group
from .int8_rows import dequantize_rows
from .sinks import SINK_DTYPE, write_sinks
from .static import LayerKV, write_layer
from .channel_layout import ChannelQuantLayerKV
from .scores import grouped_scores, grouped_values

NEG_INF = -1e30


def channel_attention(cfg: ModelConfig, q, k, v, layer: ChannelQuantLayerKV | None, old, cache_index, key_start,
                      stored, valid=None):
    """Attend T new tokens over a per-channel key cache and write them (module docstring).

    q: [B, K, G', T, D] scaled queries; k: [B, K, T, D] the new keys in full precision; v: [B, K, T, D] the
    values attention uses (int8 read-back, full at sink positions); layer: the ChannelQuantLayerKV written
    (None: the uncached forward, nothing is stored); old: the part of it read (``first_slots``; None: no old
    slots, a fresh prefill); cache_index: [B] int32; key_start: [B] int32 or None; stored: (k_q, v_q, k_scale,
    v_scale, k_full, v_full) as ``Attention`` builds them (the per-token key rows are unused); valid: [B] int32
    real tokens among the T (right padding after them) or None (all). Returns (y [B, K, G', T, D] float32, the
    updated layer or None).
    """
    G, T = cfg.key_group, q.shape[3]
    offset = cache_index % G
    span = group_span(_residual(layer, k, cache_index, G), quantized_keys(k, cache_index, key_start, cfg.sink_slots),
                      offset, valid)
    codes, scales = quantize_channels(span, G)
    back = (codes.astype(jnp.float32) * jnp.repeat(scales, G, axis=-2)).astype(q.dtype)
    k_sink, v_sink = written_sinks(cfg, layer, k, stored, cache_index, key_start)
    y = attend_channels(cfg, q, v, old, span.astype(q.dtype), back, (k_sink, v_sink), cache_index, key_start)
    if layer is None:
        return y, None
    end = cache_index + (T if valid is None else valid)
    return y, _write(layer, codes, scales, span, stored, cache_index, end, k_sink, v_sink)


def _residual(layer, k, cache_index, G: int) -> jax.Array:
    """The filling groups' float32 keys [B, K, G, D]: out of layer.k_residual's ring (``ring_group``), or zeros
    for the uncached forward."""
    if layer is not None:
        return ring_group(layer.k_residual, cache_index, G)
    return jnp.zeros(k.shape[:2] + (G, k.shape[-1]), jnp.float32)


def quantized_keys(k, cache_index, key_start, sinks: int) -> jax.Array:
    """k [B, K, T, D] (the first at slot cache_index [B]) with the left-padding slots (before key_start, [B] or
    None: 0) and the row's first ``sinks`` tokens zeroed, so they never set a group's scale: padding is no
    token, and the sinks are always read from the float32 sink arrays (their codes never are)."""
    if key_start is None and not sinks:
        return k
    start = jnp.zeros_like(cache_index) if key_start is None else key_start
    slot = cache_index[:, None] + jnp.arange(k.shape[-2])[None]                   # [B, T]
    return jnp.where((slot >= start[:, None] + sinks)[:, None, :, None], k, 0)


def written_sinks(cfg, layer, k, stored, cache_index, key_start):
    """The sink arrays with the new tokens' sinks written: (k_sink, v_sink) [B, K, A, D] float32 (A =
    cfg.sink_slots). layer: the ChannelQuantLayerKV whose sinks are updated, or None (zeros: the uncached
    forward); k: [B, K, T, D] (its shape only); stored: ``channel_attention``'s (stored[4], stored[5]: the new
    keys and values in full); cache_index: [B] int32; key_start: [B] int32 or None
    (``dantinox.kv.sinks.write_sinks``)."""
    B, K, _, D = k.shape
    A = cfg.sink_slots
    if layer is None:
        zeros = jnp.zeros((B, K, A, D), SINK_DTYPE)
        old_k, old_v = zeros, zeros
    else:
        old_k, old_v = layer.k_sink, layer.v_sink
    return (write_sinks(old_k, stored[4], cache_index, key_start),
            write_sinks(old_v, stored[5], cache_index, key_start))


def attend_channels(cfg, q, v, old, span_float, span_int8, sinks, cache_index, key_start):
    """Softmax of q over [sinks ; old whole groups ; the span], jointly in float32 (module docstring, Reads).

    q: [B, K, G', T, D]; v: [B, K, T, D] new values; old: ChannelQuantLayerKV cut to L slots or None;
    span_float, span_int8: [B, K, Lx, D] the span's keys in full and read back from int8; sinks: (k_sink,
    v_sink) [B, K, A, D]. Returns [B, K, G', T, D] float32.
    """
    G, T, Lx, A = cfg.key_group, q.shape[3], span_float.shape[-2], sinks[0].shape[-2]
    query = cache_index[:, None, None] + jnp.arange(T)[None, :, None]           # [B, T, 1]
    start = jnp.zeros_like(cache_index) if key_start is None else key_start
    begin = (cache_index - cache_index % G)[:, None, None]                       # r0, [B, 1, 1]

    def visible(slots):                        # slots [B or 1, 1, n] -> [B, T, n]
        mask = (slots <= query) & (slots >= start[:, None, None])
        return mask if cfg.sliding_window is None else mask & (query - slots < cfg.sliding_window)

    span_slot = begin + jnp.arange(Lx)[None, None]                               # [B, 1, Lx]
    not_sink = lambda s: s >= start[:, None, None] + A  # noqa: E731
    from_int8 = reads_int8(span_slot, query, G)[:, None, None]
    span_scores = jnp.where(from_int8, grouped_scores(q, span_int8), grouped_scores(q, span_float))
    old_values = None if old is None else dequantize_rows(old.v, old.v_scale, jnp.float32)
    parts = [(grouped_scores(q, sinks[0].astype(q.dtype)), visible(start[:, None, None] + jnp.arange(A)),
              sinks[1].astype(jnp.float32)),
             (span_scores, visible(span_slot) & not_sink(span_slot),
              _span_values(old_values, v, span_slot[:, 0], cache_index))]
    if old is not None:
        slots = jnp.arange(old.k.shape[-2])[None, None]
        parts.insert(1, (grouped_scores(q, old.keys(q.dtype)), visible(slots) & (slots < begin) & not_sink(slots),
                         old_values))
    scores = jnp.concatenate([jnp.where(m[:, None, None], s, NEG_INF) for s, m, _ in parts], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    y, at = 0.0, 0
    for s, _, values in parts:
        n = s.shape[-1]
        y = y + grouped_values(probs[..., at:at + n], values)
        at += n
    return y


def _span_values(old_values, v, span_slot, cache_index) -> jax.Array:
    """The values of the span's slots: [B, K, Lx, D] float32, from the old rows (old_values [B, K, L, D] or
    None) before cache_index and from the new ones (v [B, K, T, D]) after. span_slot: [B, Lx] int32."""
    T = v.shape[-2]
    at = lambda idx: idx[:, None, :, None]  # noqa: E731
    rel = span_slot - cache_index[:, None]
    new = jnp.take_along_axis(v.astype(jnp.float32), at(jnp.clip(rel, 0, T - 1)), axis=-2)
    if old_values is None:
        return new
    L = old_values.shape[-2]
    old = jnp.take_along_axis(old_values, at(jnp.clip(span_slot, 0, L - 1)), axis=-2)
    return jnp.where(at(rel < 0), old, new)


def _write(layer: ChannelQuantLayerKV, codes, scales, span, stored, cache_index, end, k_sink, v_sink):
    """Store a write (module docstring, Writes): the span's codes for slots before ``end`` ([B] int32, the
    slot after each row's last real new token), the scales of the groups it completes, the span's float keys
    of the groups end // G - 1 and end // G into the residual ring (slot s at s mod R; module docstring,
    Rollback), the value rows and the sinks. Returns the updated ChannelQuantLayerKV."""
    G, S, N, Lx = layer.group, layer.k.shape[-2], layer.k_scale.shape[-2], span.shape[-2]
    R = layer.k_residual.shape[-2]
    begin = cache_index - cache_index % G
    slot = begin[:, None] + jnp.arange(Lx)[None]                                  # [B, Lx]
    group = begin[:, None] // G + jnp.arange(Lx // G)[None]                       # [B, Lx / G]
    put = jax.vmap(lambda cache, rows, idx: cache.at[:, idx].set(rows, mode="drop"))
    k = put(layer.k, codes, jnp.where(slot < end[:, None], slot, S))
    k_scale = put(layer.k_scale, scales, jnp.where((group + 1) * G <= end[:, None], group, N))
    kept = (slot < end[:, None]) & (slot >= (end // G - 1)[:, None] * G)         # < 2 G slots, distinct mod R
    residual = put(layer.k_residual, span, jnp.where(kept, slot % R, R))
    values = write_layer(LayerKV(layer.v, layer.v_scale), stored[1], stored[3], cache_index)
    return ChannelQuantLayerKV(k, values.k, k_scale, values.v, residual, k_sink, v_sink)
