"""Symmetric absmax int8 quantization of cache rows (the int8 KV cache, ``cache_dtype="int8"``).

One row is the last axis of a key/value tensor: for MHA / GQA / MQA one row per (token, KV head) of k and of
v ([..., D]); for MLA one row per token of the latent c_kv ([..., C]) and one of the RoPE key k_R ([..., R]).
Each row x gets its own scale s = max|x| / 127 and is stored as q = round(x / s) in [-127, 127] (int8;
-128 is never used, so the grid is symmetric). Reading it back gives q * s. The error of an element is at
most s / 2, and it depends on its own row only: one outlier token (an attention sink) cannot coarsen the
other tokens' rows, as one scale per tensor would (Dettmers et al. 2022, "LLM.int8()", section 3.1, for
absmax; Hooper et al. 2024, "KVQuant", section 3, for why keys need fine-grained scales).

Scale dtype: float32. A float32 scale costs 4 bytes per row, 2 K (D + 4) bytes per token and layer against
2 K D x 4 for a float32 cache: 36 / 128 = 0.28x at head size D = 32 (a bfloat16 scale would give 0.27x).
In exchange q * s is one correctly rounded float32 product of an exact integer and the stored scale, so the
cached value is exactly the value the uncached reference computes with ``roundtrip``; a bfloat16 scale
would add up to 0.4 % relative error to every row for 2 bytes. A row of zeros (or an unwritten slot) has
s = 0 and q = 0 and reads back as exact zeros, never NaN.

Scales are stored with a trailing axis of size 1 ([..., 1]) so they slice, gather and broadcast exactly like
the int8 rows they belong to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QMAX = 127.0
SCALE_DTYPE = jnp.float32
SCALE_BYTES = 4   # bytes of one scale (SCALE_DTYPE)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantize every row (last axis) of ``x`` to int8 with its own absmax scale.

    x: [..., W] any float dtype. Returns (q [..., W] int8 in [-127, 127], scale [..., 1] float32 with
    scale = max|x| / 127 over the row; 0 for an all-zero row, whose q is all zeros).
    """
    x = x.astype(jnp.float32)
    if x.shape[-1] == 0:  # an MLA RoPE key of width 0: nothing to scale
        return x.astype(jnp.int8), jnp.zeros(x.shape[:-1] + (1,), SCALE_DTYPE)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / QMAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe), -QMAX, QMAX).astype(jnp.int8)
    return q, scale.astype(SCALE_DTYPE)


def dequantize_rows(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """q * scale, in float32, then cast to ``dtype``. q: [..., W] int8; scale: [..., 1] float32 (broadcast
    over the row). Returns [..., W] ``dtype``."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def roundtrip(x: jax.Array, dtype=None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Quantize ``x`` ([..., W]) and read it back: (dequantize_rows(q, scale, dtype or x.dtype), (q, scale)).

    Attention uses the read-back value for the new tokens and stores (q, scale), so a new token and a cached
    one see bit-identical keys and values."""
    q, scale = quantize_rows(x)
    return dequantize_rows(q, scale, dtype or x.dtype), (q, scale)


def roundtrip_for(layer_cache, x: jax.Array, field: str) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``roundtrip(x)`` for the new rows of one cache field ("k", "v", or for MLA "c_kv", "k_rope"), unless
    the layer cache brings its own ``roundtrip_int8(x, field)`` with the same result layout: verify's int8
    reference does, to adopt the cached run's rounding-boundary flips (``dantinox.quality.int8_reference``). Every
    other cache (None for use_cache=False, the static and paged caches) gets the plain ``roundtrip``."""
    hook = getattr(layer_cache, "roundtrip_int8", None)
    return roundtrip(x) if hook is None else hook(x, field)
