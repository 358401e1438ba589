"""The int8 row codec: symmetric absmax int8 per cache row with float32 attention sinks.

Each row (one token's key or value of one KV head, or an MLA layer's latent or RoPE key) is stored as int8
codes with one float32 scale (``dantinox.kv.int8_rows``); the first A tokens of every sequence are also kept in
float32 (``dantinox.kv.sinks``: attention sinks). The new tokens are quantized once: attention uses their
read-back values (their full values at sink positions), and the codes, scales and full rows are stored, so a
cached call and the uncached forward see identical keys and values.

Static layers: ``QuantLayerKV`` (int8 k, v [B, K, S, D], scales [B, K, S, 1], sinks [B, K, A, D]) or
``QuantLatentKV`` (int8 c_kv [B, S, C], k_rope [B, S, R], scales [B, S, 1], sinks [B, A, C], [B, A, R]); paged:
``PagedQuantKV`` / ``PagedQuantLatentKV`` (blocks [N, P, ...], sinks per sink slot [R, A, ...]).
"""

from __future__ import annotations

from dataclasses import dataclass

from .attend import attend, old_slots
from .codec import Codec, Field
from .int8_rows import roundtrip_for
from .paged import PagedQuantKV, PagedQuantLatentKV
from .sinks import keep_sinks, sink_flags
from .static import QuantLatentKV, QuantLayerKV, write_rows

_PER_HEAD = (Field("k", "slot", "head", "int8"), Field("v", "slot", "head", "int8"),
             Field("k_scale", "slot", "one", "float32"), Field("v_scale", "slot", "one", "float32"),
             Field("k_sink", "sink", "head", "float32"), Field("v_sink", "sink", "head", "float32"))
_LATENT = (Field("c_kv", "slot", "latent", "int8"), Field("k_rope", "slot", "rope", "int8"),
           Field("c_scale", "slot", "one", "float32"), Field("r_scale", "slot", "one", "float32"),
           Field("c_sink", "sink", "latent", "float32"), Field("r_sink", "sink", "rope", "float32"))


def encode_int8(spec, rows, cache_index, key_start, layer_cache, names):
    """Quantize the new rows once (module docstring). rows: the full-precision rows (two of them, slot axis
    second to last); names: their fields. Returns (the rows attention uses: read back, full at sink
    positions; stored: (codes..., scales..., full rows...), the order of the int8 layer types' fields)."""
    trips = [roundtrip_for(layer_cache, x, name) for x, name in zip(rows, names)]
    stored = tuple(q for _, (q, _) in trips) + tuple(s for _, (_, s) in trips) + tuple(rows)
    flags = sink_flags(cache_index, key_start, rows[0].shape[-2], spec.sinks)
    return tuple(keep_sinks(back, x, flags) for (back, _), x in zip(trips, rows)), stored


@dataclass(frozen=True)
class Int8Rows(Codec):
    """int8 rows, one float32 scale each, and A float32 sink tokens per sequence."""

    name: str = "int8"
    element_dtype: str = "int8"

    def static_fields(self, latent: bool) -> tuple[Field, ...]:
        return _LATENT if latent else _PER_HEAD

    def paged_fields(self, latent: bool) -> tuple[Field, ...]:
        return _LATENT if latent else _PER_HEAD

    def static_type(self, latent: bool):
        return QuantLatentKV if latent else QuantLayerKV

    def paged_type(self, latent: bool):
        return PagedQuantLatentKV if latent else PagedQuantKV

    def encode(self, spec, rows, cache_index, key_start, layer_cache, names):
        return encode_int8(spec, rows, cache_index, key_start, layer_cache, names)

    def attend_static(self, spec, q, k, v, stored, layer, read_slots, cache_index, key_start, causal: bool,
                      valid=None):
        """``Codec.attend_static``: attend over the old rows read back (and the sinks), then write."""
        y = attend(q, k, v, old_slots(layer, read_slots), cache_index, key_start, spec.window, causal=causal,
                   valid=valid)
        return y, None if layer is None else self.write(layer, stored, cache_index, key_start)

    def write(self, layer, stored, cache_index, key_start):
        return write_rows(layer, stored, cache_index, key_start)
