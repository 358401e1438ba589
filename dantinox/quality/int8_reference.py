"""verify's int8 reference: the uncached forward, adopting only the cache's rounding-boundary flips.

Why a plain uncached reference is not enough. With cache_dtype="int8" both the cached run and the uncached
forward quantize every new key/value row (``dantinox.kv.int8_rows``), but not from the same float32 values: the
cached run computes a decoded token's row in a one-token call, the reference in one call over the whole
sequence, and the two matmuls (other shapes, other summation orders) agree only to the last bits. Where an
element x of a row sits on a rounding boundary of its grid (x / s = k + 0.5 up to those bits, s the row's
scale) the two runs round it to neighbouring int8 steps k and k + 1, and where the row's largest |x| differs
in its last bit the two scales differ by an ulp. Either is a legitimate quantization of the same value, but
the step moves every later logit far above verify's tolerance (docs/explanation/quantization.md).

The rule (``adopt_cached_rounding``). The reference computes its own pre-quantization rows x, its own codes q
and scales s exactly as the model does, then compares them with what the cached run stored for the same
positions (codes q_c and scales s_c, read from the cached run's final static cache) and takes a cached value
only where a float32 difference of at most ROW_ULPS ulps of the row's largest |x| (m = 127 s) between the
two runs' x explains it:
  - a scale: s_c when |s_c - s| <= ROW_ULPS eps s (eps = 2^-23; s is m / 127, so this is m moving by at
    most ROW_ULPS ulps); else the reference's own s;
  - a code: q_c when its row's scale was taken, |q_c - q| == 1 and the reference's own x lies within
    ROW_ULPS eps m of the rounding boundary (q + q_c) / 2 * s between the two codes, i.e. its grid position
    x / s within ROW_ULPS eps 127 = 9.7e-4 steps of it; else the reference's own q.
Everything else that disagrees (a code off by 2 or more, off by one away from a boundary, a scale off by
more than rounding) is counted as a fault and never adopted, so the reference keeps its own value and
``dantinox.quality.verify`` fails on the count and, where later tokens read the value, on the logits.

Why it is sound. An adopted code or scale is exactly what the reference's own quantizer returns for some
input within ROW_ULPS ulps of the row's absmax of the x it computed itself: the size of difference the two
runs' matmuls already have (the spread measured on the bundled model is in docs/explanation/quantization.md,
"Rounding-boundary flips"). The reference still computes every
row itself, from its own forward; it only resolves the ties the cached run resolved the other way, so a cache
that wrote a wrong slot, a stale row, a wrong scale or a corrupted code is still caught (a code moved by one
step is taken only when the reference's own value lies within 1e-3 steps of that boundary). Every adoption
is counted and reported (``RoundingAudit``), so nothing is hidden.

How it reaches the model. The reference calls the model with use_cache=True and, as each layer's cache, an
``AdoptingLayerKV`` (MHA / GQA / MQA) or ``AdoptingLatentKV`` (MLA: the latent c_kv and the RoPE key k_R,
one scale per token each). Their ``roundtrip_int8(x, field)`` hook (``dantinox.kv.int8_rows.roundtrip_for``)
replaces the model's own round trip, and their ``attend_and_write`` / ``attend_and_write_latent`` hook runs
the attention exactly as the uncached forward does (over the new tokens only, cache_index 0, causal), so with
nothing to adopt the reference's logits are bit-identical to ``model(ids, use_cache=False)``
(tests/quality/test_int8_reference.py). The ordinary use_cache=False path has no such layer and is unchanged.
The alternative, a reference that recomputes each layer's rows itself, would duplicate the attention code
it is meant to check. The hooks record their counts on the layer object while the reference is traced; the
jitted reference returns them (``audit``).

Scope: rows computed in float32 (compute_dtype="float32"; the weights may be bfloat16 or int8, they are
read back to float32). With compute_dtype="bfloat16" the two runs' rows differ by bfloat16 rounding, and
``dantinox.quality.verify`` compares with the plain uncached forward instead.

Shape letters as in ``dantinox.kv.attend``; W is a row's width (D, C or R).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..kv.attend import attend
from ..kv.int8_rows import QMAX, dequantize_rows, quantize_rows

ROW_ULPS = 64   # float32 ulps of a row's absmax the two runs' pre-quantization values may differ by

_SCALE_OF = {"k": "k_scale", "v": "v_scale", "c_kv": "c_scale", "k_rope": "r_scale"}


class Adoption(NamedTuple):
    """The reference's int8 rows after adoption. q: [..., W] int8; scale: [..., 1] float32; flips, scale_flips,
    faults: int32 scalars (codes taken from the cache, scales taken from the cache that differ from the
    reference's own, and disagreements not taken: codes plus scales)."""

    q: jax.Array
    scale: jax.Array
    flips: jax.Array
    scale_flips: jax.Array
    faults: jax.Array


class RoundingAudit(NamedTuple):
    """What the int8 reference took from the cache, over every layer and position. flips / values: int8 codes
    adopted at a rounding boundary / codes compared; scale_flips / scales: scales adopted that differ from the
    reference's own by float32 rounding / scales compared; faults: stored codes and scales that disagree with
    the reference beyond rounding (a cache fault: verify fails when it is not 0)."""

    flips: int
    values: int
    scale_flips: int
    scales: int
    faults: int

    def describe(self) -> str:
        """One line for the command line: the adopted flips and scales out of those compared, and the faults."""
        return (f"int8 rounding-boundary flips adopted from the cache: {self.flips:,} of {self.values:,} values; "
                f"scales adopted at float32 rounding: {self.scale_flips:,} of {self.scales:,}; cache faults "
                f"(stored values the reference cannot reproduce): {self.faults:,}")


def adopt_cached_rounding(x: jax.Array, cached_q: jax.Array, cached_scale: jax.Array) -> Adoption:
    """Quantize the reference's rows ``x`` and take the cached codes / scales where only rounding differs.

    x: [..., W] the reference's pre-quantization rows (any float dtype); cached_q: [..., W] int8 and
    cached_scale: [..., 1] float32, what the cached run stored for the same rows. The rule and why it is
    sound: see the module docstring. Returns ``Adoption``.
    """
    eps = float(np.finfo(np.float32).eps)
    x = x.astype(jnp.float32)
    own_q, own_s = quantize_rows(x)
    cached_scale = cached_scale.astype(jnp.float32)
    scale_ok = jnp.abs(cached_scale - own_s) <= ROW_ULPS * eps * own_s
    grid = x / jnp.where(own_s > 0, own_s, 1.0)                    # the reference's own position, in steps
    step = cached_q.astype(jnp.int32) - own_q.astype(jnp.int32)
    boundary = own_q.astype(jnp.float32) + 0.5 * step.astype(jnp.float32)
    near = jnp.abs(grid - boundary) <= ROW_ULPS * eps * QMAX
    flip = (jnp.abs(step) == 1) & near & scale_ok
    q = jnp.where(flip, cached_q, own_q)
    scale = jnp.where(scale_ok, cached_scale, own_s)
    count = lambda m: jnp.sum(m, dtype=jnp.int32)  # noqa: E731
    faults = count((step != 0) & ~flip) + count(~scale_ok)
    return Adoption(q, scale, count(flip), count(scale_ok & (cached_scale != own_s)), faults)


class _AdoptingLayer:
    """One layer's cached int8 rows for positions [0, T), and the counts of what the reference adopted."""

    def __init__(self, cached, length: int):
        """cached: the cached run's final QuantLayerKV / QuantLatentKV (slot axis second to last); length: T,
        the positions the reference covers (the first T slots, all written by the cached run)."""
        self._rows = {field: (getattr(cached, field)[..., :length, :], getattr(cached, _SCALE_OF[field])
                              [..., :length, :]) for field in _SCALE_OF if hasattr(cached, field)}
        self.counts = []   # per field: (flips, values, scale_flips, scales, faults), as RoundingAudit

    def roundtrip_int8(self, x, field: str):
        """The model's int8 round trip of new rows x ([..., T, W]) with the cached rows' boundary flips
        adopted: (read-back [..., T, W] in x's dtype, (q int8, scale float32 [..., T, 1]))."""
        cached_q, cached_scale = self._rows[field]
        got = adopt_cached_rounding(x, cached_q, cached_scale)
        self.counts.append((got.flips, x.size, got.scale_flips, got.scale.size, got.faults))
        return dequantize_rows(got.q, got.scale, x.dtype), (got.q, got.scale)


class AdoptingLayerKV(_AdoptingLayer):
    """An MHA / GQA / MQA layer of the int8 reference (``dantinox.model.attention.Attention``'s hooks)."""

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None):
        """Attention over the new tokens only, as the uncached forward runs it; writes nothing.
        q: [B, K, G, T, D]; k, v: [B, K, T, D]. Returns (y [B, K, G, T, D] float32, this layer)."""
        return attend(q, k, v, None, cache_index, key_start, window), self


class AdoptingLatentKV(_AdoptingLayer):
    """An MLA layer of the int8 reference (``dantinox.model.mla.MLAttention``'s hooks)."""

    def attend_and_write_latent(self, attend_over, stored, cache_index, key_start):
        """Attention over the new tokens only (no old cache), as the uncached forward runs it; writes nothing.
        Returns (o [B, T, H, Dv] float32, this layer)."""
        return attend_over(None), self


def adopting_layers(cache, length: int) -> tuple:
    """One adopting layer per layer of ``cache`` (the cached run's final int8 static cache, a tuple of
    QuantLayerKV or QuantLatentKV), covering positions [0, length). Pass them as the model's kv_caches with
    use_cache=True, cache_index=0."""
    return tuple((AdoptingLatentKV if hasattr(layer, "c_kv") else AdoptingLayerKV)(layer, length)
                 for layer in cache)


def audit(layers) -> jax.Array:
    """The summed counts of ``adopting_layers`` after a forward: [5] int32 in RoundingAudit's order (flips,
    values, scale_flips, scales, faults); ``RoundingAudit(*map(int, audit(layers)))`` on the host."""
    return jnp.sum(jnp.stack([jnp.asarray(c, jnp.int32) for layer in layers for c in layer.counts]), axis=0)
