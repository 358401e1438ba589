"""A cache codec: how one layer's keys and values (or MLA latents) are stored, read and written.

A codec is the unit a new storage format adds (one file in ``dantinox.kv`` plus its test against the float
reference). It says three things, and nothing outside it asks what kind of codec it is:
  - its **fields**: the arrays one layer stores, in the order of its layer types (``Field``). Shapes, zero
    allocation and every byte count of the cache are derived from this one list (``dantinox.kv.spec``), so the
    bytes a budget prints are the bytes ``init_static`` / ``init_paged`` allocate;
  - **encode**: the new tokens' rows as attention sees them and as they are stored (float: the rows
    themselves; int8: the read-back values, and the codes, scales and full rows for the sinks);
  - **attend_static** and **write**: attention over the static cache of this codec and the write of the new
    rows into it (the paged pool has views of its own, ``dantinox.kv.paged``, that read through the layer
    types' ``read`` and write the stored fields by block table).

Field rows (how many of a field's rows one sequence or one block holds):
  "slot"   one row per token slot                          (keys, values, per-token scales)
  "group"  one row per G slots (G the key group)           (per-channel key scales, KIVI)
  "sink"   A rows per sequence                              (the int8 cache's float32 attention sinks)
  "ring"   2 G rows per sequence                            (the per-channel keys' float32 residual ring)
Field widths: "head" D (or the latent C / RoPE R of an MLA layer: "latent", "rope"), "one" 1 (a scale).
Field dtypes: "row" (the codec's element dtype), "int8", "float32".
Shape letters: see ``dantinox.kv.attend``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROWS = ("slot", "group", "sink", "ring")
WIDTHS = ("head", "one", "latent", "rope")


@dataclass(frozen=True)
class Field:
    """One array of a layer's cache: its name (the layer type's field), row kind (``ROWS``), width
    (``WIDTHS``) and dtype ("row", "int8" or "float32")."""

    name: str
    rows: str
    width: str
    dtype: str = "row"


class Codec:
    """Base of the cache codecs (module docstring). Subclasses are frozen dataclasses (hashable, so a layer's
    spec can sit in a compiled function's static arguments) and define the class attributes and methods below.

    name: the codec's name as ``dantinox budget`` prints it; element_dtype: numpy dtype name of "row" fields.
    """

    name: str = "codec"
    element_dtype: str = "float32"

    # What is stored --------------------------------------------------------------------------------------
    def static_fields(self, latent: bool) -> tuple[Field, ...]:
        """The fields of one layer of the static cache, in the order of ``static_type(latent)``."""
        raise NotImplementedError

    def paged_fields(self, latent: bool) -> tuple[Field, ...]:
        """The fields of one layer of the paged pool, in the order of ``paged_type(latent)``: the block fields
        ("slot" / "group" rows) first, then "sink", then "ring" fields."""
        raise NotImplementedError

    def static_type(self, latent: bool):
        """The NamedTuple of one static layer (per-head keys and values, or an MLA latent layer)."""
        raise NotImplementedError

    def paged_type(self, latent: bool):
        """The NamedTuple of one paged pool layer."""
        raise NotImplementedError

    def dtype_of(self, field: Field):
        """The numpy dtype of ``field``'s arrays."""
        return np.dtype(self.element_dtype if field.dtype == "row" else field.dtype)

    # What attention does with it -------------------------------------------------------------------------
    def encode(self, spec, rows: tuple, cache_index, key_start, layer_cache, names: tuple) -> tuple:
        """The new tokens' rows as attention uses them and as they are stored.

        rows: the new rows in full precision ((k, v) [B, K, T, D] each, or MLA's (c_kv [B, T, C], k_rope
        [B, T, R])); names: their field names ("k", "v" or "c_kv", "k_rope"); cache_index: [B] int32;
        key_start: [B] int32 or None; layer_cache: the layer's cache (its ``roundtrip_int8`` hook, when it has
        one, replaces the int8 round trip: ``dantinox.quality.int8_reference``). Returns (attended rows, one
        per row, stored: one array per written field of ``write``)."""
        raise NotImplementedError

    def attend_static(self, spec, q, k, v, stored, layer, read_slots, cache_index, key_start, causal: bool,
                      valid=None):
        """Attention of q over a static layer (its first read_slots slots: ``dantinox.kv.attend.old_slots``) and
        the new keys, then the write. q: [B, K, G, T, D] scaled; k, v: [B, K, T, D] as ``encode`` gave them;
        stored: ``encode``'s; layer: the static layer or None (the uncached forward: nothing written);
        valid: [B] int32 real new tokens or None. Returns (y [B, K, G, T, D] float32, the new layer or None)."""
        raise NotImplementedError

    def write(self, layer, stored: tuple, cache_index, key_start):
        """The static ``layer`` with ``stored`` written at slots cache_index .. cache_index + T - 1 ([B] int32)."""
        raise NotImplementedError
