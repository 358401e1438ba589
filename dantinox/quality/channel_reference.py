"""verify's reference for per-channel int8 keys (cfg.channel_keys): the uncached forward, adopting only the
cached run's rounding-boundary flips, as ``dantinox.quality.int8_reference`` does for per-token rows.

The cached run and the uncached forward compute the same keys and values by different matmul shapes, so they
agree to the last bits only, and an element on a rounding boundary of its int8 grid can round to the
neighbouring step in one run and not in the other. Values are per-token rows: they are adopted exactly as
``int8_reference`` adopts them (``adopt_cached_rounding``). Keys of a complete group are quantized per channel
over the group's G slots, i.e. each (group, KV head, channel) is one row of G elements with one scale
(``dantinox.kv.channel_keys``); transposed to [.., D, G] they are rows again, and ``adopt_cached_rounding``
applies unchanged (a code one step away only at a boundary, a scale within ROW_ULPS ulps; anything else is a
fault). Keys of the filling group stay float32 and are never adopted. Attention then runs the per-channel
layout over the new tokens only, as the uncached forward does (``dantinox.kv.channel_attention``), so with
nothing to adopt the logits equal ``model(ids, use_cache=False)``.

Shape letters as in ``dantinox.kv.channel_attention``; N the complete groups among the T positions.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..kv.channel_attention import attend_channels, quantized_keys, written_sinks
from ..kv.channel_layout import ChannelQuantLayerKV
from ..kv.channel_keys import group_span
from ..kv.int8_rows import dequantize_rows, roundtrip
from .int8_reference import adopt_cached_rounding


class AdoptingChannelLayerKV:
    """One layer of the per-channel reference: the cached run's final ChannelQuantLayerKV for positions
    [0, T) and the counts of what was adopted (``counts``: (flips, values, scale_flips, scales, faults) per
    field, as ``RoundingAudit``)."""

    def __init__(self, cfg, cached: ChannelQuantLayerKV, length: int):
        self.cfg, self.cached, self.length, self.counts = cfg, cached, length, []

    def roundtrip_int8(self, x, field: str):
        """Values ("v", [B, K, T, D]): the model's per-token round trip with the cached rows' boundary flips
        adopted; keys ("k"): the plain round trip (its per-token rows are not stored in this layout)."""
        if field != "v":
            return roundtrip(x)
        got = adopt_cached_rounding(x, self.cached.v[..., :self.length, :], self.cached.v_scale[..., :self.length, :])
        self.counts.append((got.flips, x.size, got.scale_flips, got.scale.size, got.faults))
        return dequantize_rows(got.q, got.scale, x.dtype), (got.q, got.scale)

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None):
        """Per-channel attention over the new tokens only (cache_index 0), keys of complete groups read back
        from the adopted codes and scales; writes nothing. q: [B, K, G', T, D]; v: [B, K, T, D]; stored: the
        int8 layer's tuple (stored[4]: the full keys); window: this layer's sliding window (its spec's: a hybrid
        model's full layers have none). Returns (y [B, K, G', T, D] float32, this layer)."""
        cfg, G = self.cfg, self.cfg.key_group
        if window != cfg.sliding_window or cfg.layer_types is not None:   # attend_channels reads the window here
            cfg = cfg.replace(sliding_window=window, layer_types=None)
        keys = stored[4]
        B, K, T, D = keys.shape
        zeros = jnp.zeros((B, K, G, D), jnp.float32)
        span = group_span(zeros, quantized_keys(keys, jnp.zeros((B,), jnp.int32), key_start, cfg.sink_slots),
                          jnp.zeros((B,), jnp.int32))
        back = self._adopted_groups(span, T // G)
        sinks = written_sinks(cfg, None, keys, stored, cache_index, key_start)
        return attend_channels(cfg, q, v, None, span.astype(q.dtype), back.astype(q.dtype), sinks, cache_index,
                       key_start), self

    def _adopted_groups(self, span, N: int):
        """The span's keys read back from int8 ([B, K, Lx, D] float32): the first N groups with the cached
        run's flips adopted (one row per (group, channel) of G elements), the rest from the reference's own
        quantization (never read as int8 before they complete)."""
        from ..kv.channel_keys import channel_roundtrip
        G = self.cfg.key_group
        own = channel_roundtrip(span, G)
        if N == 0:
            return own
        B, K, _, D = span.shape
        rows = lambda a: a[..., :N * G, :].reshape(B, K, N, G, D).swapaxes(-1, -2)  # noqa: E731  [B,K,N,D,G]
        got = adopt_cached_rounding(rows(span), rows(self.cached.k), self.cached.k_scale[..., :N, :, None])
        self.counts.append((got.flips, got.q.size, got.scale_flips, got.scale.size, got.faults))
        adopted = dequantize_rows(got.q, got.scale, jnp.float32).swapaxes(-1, -2).reshape(B, K, N * G, D)
        return jnp.concatenate([adopted, own[..., N * G:, :]], axis=-2)


def adopting_channel_layers(cfg, cache, length: int) -> tuple:
    """One AdoptingChannelLayerKV per layer of ``cache`` (the cached run's final per-channel static cache),
    covering positions [0, length). Pass them as the model's kv_caches with use_cache=True, cache_index=0;
    ``dantinox.quality.int8_reference.audit`` sums their counts."""
    return tuple(AdoptingChannelLayerKV(cfg, layer, length) for layer in cache)
