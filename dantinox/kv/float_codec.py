"""The float codec: keys and values (or MLA latents) stored as they are computed, in float32 or bfloat16.

Static layers: ``LayerKV(k, v)`` of [B, K, S, D], or for an MLA layer ``LatentKV(c_kv [B, S, C], k_rope
[B, S, R])``; paged layers: ``PagedLayerKV(k, v)`` of [N, P, K, D] or ``PagedLatentKV(c_kv [N, P, C], k_rope
[N, P, R])``. Bytes per token and layer: 2 K D or C + R elements (``dantinox.kv.spec``). A float32 decode
step (one new token per row, or the few of a speculative verify call) attends in the compiled CPU kernel
(``dantinox.kv.decode_kernel``) when it applies; every other call runs ``dantinox.kv.attend.attend``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attend import attend, old_slots
from .codec import Codec, Field
from .decode_kernel import verify_attention, verify_kernel_applies
from .paged import PagedLatentKV, PagedLayerKV
from .static import LatentKV, LayerKV, write_layer, write_rows

_PER_HEAD = (Field("k", "slot", "head"), Field("v", "slot", "head"))
_LATENT = (Field("c_kv", "slot", "latent"), Field("k_rope", "slot", "rope"))


@dataclass(frozen=True)
class FloatRows(Codec):
    """Rows kept in full: element_dtype "float32" or "bfloat16" (``ModelConfig.cache_dtype``)."""

    element_dtype: str = "float32"

    @property
    def name(self) -> str:
        return self.element_dtype

    def static_fields(self, latent: bool) -> tuple[Field, ...]:
        return _LATENT if latent else _PER_HEAD

    def paged_fields(self, latent: bool) -> tuple[Field, ...]:
        return _LATENT if latent else _PER_HEAD

    def static_type(self, latent: bool):
        return LatentKV if latent else LayerKV

    def paged_type(self, latent: bool):
        return PagedLatentKV if latent else PagedLayerKV

    def encode(self, spec, rows, cache_index, key_start, layer_cache, names):
        """The rows as they are: attention and the cache both use them."""
        return tuple(rows), tuple(rows)

    def attend_static(self, spec, q, k, v, stored, layer, read_slots, cache_index, key_start, causal: bool,
                      valid=None):
        """``Codec.attend_static``: a few new tokens over a float32 cache go to the compiled kernel after the
        write (``verify_attention``: each token sees exactly what a decode step at its slot would), the rest
        attend over the old slots and the new keys, then write."""
        if causal and verify_kernel_applies(q, layer, read_slots):
            new = write_layer(layer, k, v, cache_index)
            return verify_attention(q, k, v, new, cache_index, key_start, spec.window), new
        y = attend(q, k, v, old_slots(layer, read_slots), cache_index, key_start, spec.window, causal=causal,
                   valid=valid)
        return y, None if layer is None else write_layer(layer, k, v, cache_index)

    def write(self, layer, stored, cache_index, key_start):
        return write_rows(layer, stored, cache_index, key_start)
