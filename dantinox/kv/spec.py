"""The per-layer cache spec: what one layer's cache is, what it costs and how attention reads and writes it.

A model config yields one ``LayerSpec`` per layer (``layer_specs``; after vLLM's per-layer KV cache specs,
``vllm/v1/kv_cache_interface.py``, and Flax Gemma's per-layer cache). A spec holds
  kind     "full" (the layer attends to every earlier token), "sliding" (only to the last ``window`` tokens,
           itself included: Beltagy et al. 2020, "Longformer", section 3.1; Mistral's and Gemma's local
           layers) or "latent" (multi-head latent attention: the layer caches a latent and a shared RoPE key,
           DeepSeek-V2, arXiv 2405.04434, section 2.1);
  codec    how the rows are stored (``dantinox.kv.codec``: float32 / bfloat16 rows, int8 rows with float32
           sinks, int8 per-channel keys), with the sizes the codec needs (KV heads K and head size D, or the
           latent C and RoPE R widths; A sink tokens; G slots per key group).
Everything about the cache that depends on its kind asks the spec, and the spec asks its codec: the shapes
and zeros of the static and the paged storage, every byte count (``sequence_bytes``, ``page_bytes``, the
per-sequence sink and residual slots; ``dantinox.kv.sizes`` sums them over a model's layers: no other module
writes a cache-byte formula), and the attend-and-write of each storage form (``attend``, ``attend_latent``).

Layer types (``ModelConfig.layer_types``, Hugging Face's names): "full_attention" or "sliding_attention" per
layer; without them every layer is full, or sliding when ``sliding_window`` is set. A sliding layer's static
cache is a ring of its window plus a little slack (``dantinox.kv.ring``, ``ring``; ``slots``); in the paged
pool its window is a mask over the same blocks as the full layers' (its pages are not freed behind the window).
Shape letters: see ``dantinox.kv.attend``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from .channel_codec import Int8ChannelKeys
from .codec import Codec, Field
from .float_codec import FloatRows
from .int8_codec import Int8Rows
from .static import LatentCacheView, LayerCacheView
from .attend import attend, old_slots
from .ring import ring_attend, ring_slots, ring_write
from .zero_pages import zeros

LAYER_KINDS = ("full", "sliding", "latent")


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache (module docstring). kind: one of LAYER_KINDS; codec: a Codec; kv_heads: K (1 for a
    latent layer); width: D, or C for a latent layer; rope_width: R (latent layers; 0 otherwise); sinks: A;
    window: W tokens for a sliding layer (None: no window); group: G slots per key group (per-channel keys;
    1 otherwise); ring: the static cache's slots of a sliding layer kept as a ring (``dantinox.kv.ring``), 0 for a
    full-length cache."""

    kind: str
    codec: Codec
    kv_heads: int
    width: int
    rope_width: int = 0
    sinks: int = 0
    window: int | None = None
    group: int = 1
    ring: int = 0

    # Names ModelConfig uses for the same sizes (the per-channel key functions read either).
    @property
    def key_group(self) -> int:
        return self.group

    @property
    def sink_slots(self) -> int:
        return self.sinks

    @property
    def sliding_window(self) -> int | None:
        return self.window

    @property
    def latent(self) -> bool:
        """True for an MLA layer (its rows are [.., C] latents and [.., R] RoPE keys, no KV-head axis)."""
        return self.kind == "latent"

    # Sizes -----------------------------------------------------------------------------------------------
    def slots(self, max_context: int) -> int:
        """Slots one sequence holds in this layer's static cache for a context of max_context tokens: the ring
        of a sliding layer (``ring``) when it is shorter, else max_context."""
        return self._static_slots(int(max_context))

    def _static_slots(self, slots: int) -> int:
        return min(int(slots), self.ring) if self.ring else int(slots)

    def _rows(self, field: Field, slots: int) -> int:
        """Rows of ``field`` in a run of ``slots`` token slots (a sequence, or a block of P)."""
        return {"slot": slots, "group": -(-slots // self.group), "sink": min(self.sinks, slots),
                "ring": 2 * self.group}[field.rows]

    def _width(self, field: Field) -> int:
        return {"head": self.width, "one": 1, "latent": self.width, "rope": self.rope_width}[field.width]

    def _row_bytes(self, field: Field) -> int:
        heads = 1 if self.latent else self.kv_heads
        return heads * self._width(field) * self.codec.dtype_of(field).itemsize

    def static_shapes(self, batch: int, slots: int) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
        """(shape, dtype) of every array of one static layer of ``batch`` rows of ``slots`` slots, in field
        order: [B, K, rows, W] per head, [B, rows, W] for a latent layer."""
        out, slots = [], self._static_slots(slots)
        for field in self.codec.static_fields(self.latent):
            rows, width = self._rows(field, slots), self._width(field)
            shape = (batch, rows, width) if self.latent else (batch, self.kv_heads, rows, width)
            out.append((shape, self.codec.dtype_of(field)))
        return tuple(out)

    def paged_shapes(self, num_blocks: int, block_size: int, sink_slots: int = 1, residual_slots: int = 1):
        """(shape, dtype) of every array of one pool layer: block fields [N, rows(P), K, W] ([N, rows(P), W]
        latent), sink fields [R, A, ...], ring fields [Q, 2 G, ...], in field order."""
        out = []
        for field in self.codec.paged_fields(self.latent):
            lead = {"sink": (sink_slots, self.sinks), "ring": (residual_slots, 2 * self.group)}.get(
                field.rows, (num_blocks, self._rows(field, block_size)))
            shape = lead + ((self._width(field),) if self.latent else (self.kv_heads, self._width(field)))
            out.append((shape, self.codec.dtype_of(field)))
        return tuple(out)

    def init_static(self, batch: int, slots: int):
        """One static layer of zeros (``static_shapes``), its pages left to the OS (``zero_pages``)."""
        arrays = (zeros(shape, dtype) for shape, dtype in self.static_shapes(batch, slots))
        return self.codec.static_type(self.latent)(*arrays)

    def init_paged(self, num_blocks: int, block_size: int, sink_slots: int = 1, residual_slots: int = 1):
        """One pool layer of zeros (``paged_shapes``)."""
        shapes = self.paged_shapes(num_blocks, block_size, sink_slots, residual_slots)
        return self.codec.paged_type(self.latent)(*(zeros(shape, dtype) for shape, dtype in shapes))

    def token_bytes(self) -> float:
        """Bytes one token slot takes, its share of per-group rows included (G / G of a key scale row per G
        tokens; the per-sequence sinks and residual ring are not per token: ``sequence_bytes``)."""
        fields = self.codec.static_fields(self.latent)
        return (sum(self._row_bytes(f) for f in fields if f.rows == "slot")
                + sum(self._row_bytes(f) for f in fields if f.rows == "group") / self.group)

    def sequence_bytes(self, slots: int) -> int:
        """Bytes of one sequence of ``slots`` slots in the static cache (exactly what ``init_static`` allocates
        for one row): every field, sinks and residual ring included."""
        slots = self._static_slots(slots)
        return sum(self._rows(f, slots) * self._row_bytes(f) for f in self.codec.static_fields(self.latent))

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of ``block_size`` tokens in the paged pool (its block fields)."""
        return sum(self._rows(f, block_size) * self._row_bytes(f) for f in self.codec.paged_fields(self.latent)
                   if f.rows in ("slot", "group"))

    def sink_slot_bytes(self) -> int:
        """Bytes of one sink slot of the paged pool (one sequence's A float32 sink rows; 0 without sinks)."""
        return sum(self.sinks * self._row_bytes(f) for f in self.codec.paged_fields(self.latent) if f.rows == "sink")

    def residual_slot_bytes(self) -> int:
        """Bytes of one residual slot of the paged pool (per-channel keys' ring of 2 G rows; 0 otherwise)."""
        return sum(2 * self.group * self._row_bytes(f) for f in self.codec.paged_fields(self.latent)
                   if f.rows == "ring")

    # Attention -------------------------------------------------------------------------------------------
    def attend(self, q, k, v, layer_cache, cache_index, key_start, read_slots, valid=None, causal: bool = True):
        """Attend T new tokens over this layer's cache and write them (MHA / GQA / MQA).

        q: [B, K, G', T, D] scaled queries; k, v: [B, K, T, D] full precision; layer_cache: the static layer,
        a view with ``attend_and_write`` (the paged pool, the DualCache, the quality references) or None (the
        uncached forward); cache_index: [B] int32; key_start: [B] int32 or None; read_slots: static old slots
        read (``dantinox.kv.attend.old_slots``); valid: [B] int32 real new tokens or None; causal: False for
        bidirectional (masked diffusion) calls. Returns (y [B, K, G', T, D] float32, the new layer cache or
        None)."""
        (k, v), stored = self.codec.encode(self, (k, v), cache_index, key_start, layer_cache, ("k", "v"))
        if isinstance(layer_cache, LayerCacheView):
            return layer_cache.attend_and_write(q, k, v, cache_index, key_start, self.window, stored=stored)
        if self.ring:   # a sliding layer's static cache kept as a ring of its window (dantinox.kv.ring)
            fresh = layer_cache is None or read_slots == 0   # nothing cached yet: the prompt over itself
            y = (attend(q, k, v, None, cache_index, key_start, self.window, causal=causal, valid=valid) if fresh
                 else ring_attend(self, q, k, v, layer_cache, cache_index, key_start, causal))
            return y, None if layer_cache is None else ring_write(layer_cache, stored, cache_index, key_start, valid)
        return self.codec.attend_static(self, q, k, v, stored, layer_cache, read_slots, cache_index, key_start,
                                        causal, valid)

    def attend_latent(self, attention, rows: tuple, layer_cache, cache_index, key_start, read_slots):
        """Attend and write for a latent layer (MLA). attention(c, kr, old) -> o [B, T, H, Dv] float32 runs the
        layer's own attention over the new latents c [B, T, C], RoPE keys kr [B, T, R] (as the codec lets
        attention see them) and the old cache (a static latent layer cut to read_slots, or the paged view's
        gathered one; None: no old slots); rows: (c_new, kr_new) in full precision. Returns (o, the new
        layer cache or None)."""
        (c, kr), stored = self.codec.encode(self, rows, cache_index, key_start, layer_cache, ("c_kv", "k_rope"))

        def over(old):
            return attention(c, kr, old)

        if isinstance(layer_cache, LatentCacheView):
            return layer_cache.attend_and_write_latent(over, stored, cache_index, key_start)
        o = over(old_slots(layer_cache, read_slots))
        return o, None if layer_cache is None else self.codec.write(layer_cache, stored, cache_index, key_start)


_CODECS = {"float32": lambda cfg: FloatRows("float32"), "bfloat16": lambda cfg: FloatRows("bfloat16"),
           "int8": lambda cfg: Int8ChannelKeys() if cfg.channel_keys else Int8Rows()}


def register_codec(cache_dtype: str, factory) -> None:
    """Make ``factory(cfg) -> Codec`` the codec of caches whose ``ModelConfig.cache_dtype`` is cache_dtype."""
    _CODECS[cache_dtype] = factory
    layer_specs.cache_clear()


def codec_for(cfg: ModelConfig) -> Codec:
    """The codec of ``cfg``'s cache (cfg.cache_dtype, and kv_keys for int8). KeyError for an unregistered
    dtype (ModelConfig validates the name first)."""
    return _CODECS[cfg.cache_dtype](cfg)


@functools.lru_cache(maxsize=256)
def layer_specs(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """One LayerSpec per layer of ``cfg`` (module docstring), from its attention kind, layer types, cache dtype
    and sizes."""
    codec = codec_for(cfg)
    latent = cfg.attention == "mla"
    out = []
    for layer_type in cfg.layer_kinds:
        window = cfg.sliding_window if layer_type == "sliding_attention" else None
        kind = "latent" if latent else ("sliding" if window else "full")
        ring = ring_slots(window, cfg.max_context) if kind == "sliding" else cfg.max_context
        if ring >= cfg.max_context or cfg.window_cache != "ring" or cfg.channel_keys:
            ring = 0   # per-channel keys keep their key groups over the whole context
        out.append(LayerSpec(kind, codec, 1 if latent else cfg.kv_heads,
                             cfg.kv_latent_dim if latent else cfg.head_size, cfg.rope_head_dim if latent else 0,
                             cfg.sink_slots, window, cfg.key_group if cfg.channel_keys else 1, ring))
    return tuple(out)


def layer_spec(cfg: ModelConfig, layer: int) -> LayerSpec:
    """The spec of layer ``layer`` (0-based) of ``cfg``."""
    return layer_specs(cfg)[layer]


def describe(spec: LayerSpec) -> str:
    """One line naming a spec's kind, codec and sizes (``dantinox budget``, the serve start-up line)."""
    window = f", window {spec.window}" if spec.window else ""
    sizes = f"C {spec.width} + R {spec.rope_width}" if spec.latent else f"K {spec.kv_heads} x D {spec.width}"
    extra = f", {spec.sinks} sinks" if spec.sinks else ""
    group = f", key group {spec.group}" if spec.group > 1 else ""
    ring = f", a ring of {spec.ring} slots" if spec.ring else ""
    return f"{spec.kind}{window}: {spec.codec.name}, {sizes}{extra}{group}{ring}"


__all__ = ["LAYER_KINDS", "LayerSpec", "codec_for", "describe", "layer_spec", "layer_specs",
           "register_codec"]
