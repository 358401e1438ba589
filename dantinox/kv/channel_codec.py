"""The per-channel int8 key codec (KIVI, Liu et al. 2024, sections 3.2-3.3): keys quantized per channel over
groups of G slots, the filling group in a float32 residual ring, values as int8 rows, float32 sinks.

The layout and read rule are ``dantinox.kv.channel_keys``'s; the static layer ``ChannelQuantLayerKV``
(``dantinox.kv.channel_layout``) is read and written by ``dantinox.kv.channel_attention``, the paged layer
``PagedChannelKV`` by its view in ``dantinox.kv.channel_paged``. The new tokens are encoded as the int8 row
codec encodes them (``dantinox.kv.int8_codec.encode_int8``): the keys' per-token codes are not stored, the full
keys are (grouped and quantized when their group completes). MHA / GQA / MQA layers only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attend import old_slots
from .channel_attention import channel_attention
from .channel_layout import ChannelQuantLayerKV
from .channel_paged import PagedChannelKV
from .codec import Codec, Field
from .int8_codec import encode_int8

_STATIC = (Field("k", "slot", "head", "int8"), Field("v", "slot", "head", "int8"),
           Field("k_scale", "group", "head", "float32"), Field("v_scale", "slot", "one", "float32"),
           Field("k_residual", "ring", "head", "float32"),
           Field("k_sink", "sink", "head", "float32"), Field("v_sink", "sink", "head", "float32"))
_PAGED = (Field("k", "slot", "head", "int8"), Field("v", "slot", "head", "int8"),
          Field("k_scale", "group", "head", "float32"), Field("v_scale", "slot", "one", "float32"),
          Field("k_sink", "sink", "head", "float32"), Field("v_sink", "sink", "head", "float32"),
          Field("k_resid", "ring", "head", "float32"))


@dataclass(frozen=True)
class Int8ChannelKeys(Codec):
    """Per-channel int8 keys in groups of G slots (``LayerSpec.group``), per-token int8 values, A sinks."""

    name: str = "int8 (per-channel keys)"
    element_dtype: str = "int8"

    def static_fields(self, latent: bool) -> tuple[Field, ...]:
        _per_head_only(latent)
        return _STATIC

    def paged_fields(self, latent: bool) -> tuple[Field, ...]:
        _per_head_only(latent)
        return _PAGED

    def static_type(self, latent: bool):
        _per_head_only(latent)
        return ChannelQuantLayerKV

    def paged_type(self, latent: bool):
        _per_head_only(latent)
        return PagedChannelKV

    def encode(self, spec, rows, cache_index, key_start, layer_cache, names):
        return encode_int8(spec, rows, cache_index, key_start, layer_cache, names)

    def attend_static(self, spec, q, k, v, stored, layer, read_slots, cache_index, key_start, causal: bool,
                      valid=None):
        """``Codec.attend_static``: ``channel_attention`` with the new keys in full (stored[4])."""
        return channel_attention(spec, q, stored[4], v, layer, old_slots(layer, read_slots), cache_index,
                                 key_start, stored, valid)

    def write(self, layer, stored, cache_index, key_start):
        raise NotImplementedError("per-channel keys are written by their attention (channel_attention)")


def _per_head_only(latent: bool) -> None:
    if latent:
        raise ValueError("per-channel keys (kv_keys='channel') are defined for MHA / GQA / MQA caches, not "
                         "attention='mla' (its latent has no per-head keys)")
