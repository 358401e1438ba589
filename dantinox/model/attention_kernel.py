"""Decode attention through the compiled CPU kernel: one new token per row over a float32 static cache.

At decode (T = 1) attention reads every cached key and value once for a handful of multiply-adds each, so its
cost is the bytes of the cache it reads. XLA runs the two small batched dots of ``model.scores`` on one thread
and over every slot of the window, the empty ones too. The kernel (``attention_handler`` in the extension
``dantinox.quant._block_matmul``, C++ in ``dantinox/quant/csrc/decode_attention.inc``) reads only the slots a
row may see, [lo, hi) (written, past its left padding, inside the sliding window), cuts each KV head's slots
into ranges of 128 that both cores take, and merges the ranges' partial softmaxes in a fixed order
(Milakov & Gimelshein 2018; flash-decoding's split over the keys, Dao et al. 2023), so a row's output does
not depend on the batch or the thread count. Float32 throughout; the result equals ``attention.attend``'s to
float32 rounding (other summation order).

Used by ``attention.attend`` when ``decode_kernel_applies``: one new token, causal, a float32 LayerKV cache
without float32 sink rows, float32 queries, the CPU backend with the extension built, no ambient mesh (a
sharded cache keeps XLA's attention), and ``DANTINOX_ATTENTION_KERNEL`` not "off". Otherwise XLA's path runs.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from ..quant.block_kernel import ATTENTION_TARGET, ISA_CODES, extension
from .cache import LayerKV

ENV = "DANTINOX_ATTENTION_KERNEL"


def kernel_available() -> bool:
    """True when decode attention may use the compiled kernel in this process (CPU backend, extension with the
    attention handler, ``DANTINOX_ATTENTION_KERNEL`` not "off")."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    if jax.default_backend() != "cpu":
        return False
    module = extension()
    return module is not None and hasattr(module, "attention_handler")


def decode_kernel_applies(q: jax.Array, old, sinks) -> bool:
    """Whether ``attend`` hands q [B, K, G, T, D] over ``old`` (a cache layer) to the kernel (module
    docstring); a static decision, made when the call is traced."""
    return (q.shape[3] == 1 and sinks is None and type(old) is LayerKV
            and q.shape[-1] == old.k.shape[-1] == old.v.shape[-1]   # MLA's expanded values are narrower
            and q.dtype == jnp.float32 and old.k.dtype == jnp.float32 and old.v.dtype == jnp.float32
            and jax.sharding.get_abstract_mesh().empty and kernel_available())


def visible_slots(cache_index: jax.Array, key_start, window: int | None) -> tuple[jax.Array, jax.Array]:
    """The cached slots a new token at slot cache_index[b] may see, [lo[b], hi[b]) ([B] int32 each): from the
    row's first real slot (key_start, 0 when None) and, with a sliding window, from cache_index - window + 1,
    up to the slot before its own (``attention.old_slot_mask`` for T = 1)."""
    hi = cache_index.astype(jnp.int32)
    lo = jnp.zeros_like(hi) if key_start is None else key_start.astype(jnp.int32)
    if window is not None:
        lo = jnp.maximum(lo, hi - window + 1)
    return lo, hi


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, old, lo: jax.Array, hi: jax.Array,
                     isa: str = "auto") -> jax.Array:
    """Softmax attention of one new token per row over its visible cached slots and itself.

    q: [B, K, G, 1, D] float32 (scaled by 1/sqrt(D)); k, v: [B, K, 1, D] the new token's key and value;
    old: LayerKV of k, v [B, K, L, D] float32; lo, hi: [B] int32, the visible cached slots [lo, hi) (clipped to
    [0, L]; an empty range leaves the token attending to itself). isa: "auto" (CPUID) or a forced "scalar" /
    "avx2" / "avx512" (tests; the CPU must have it). Returns [B, K, G, 1, D] float32. RuntimeError when the
    extension has no attention handler.
    """
    if extension() is None or not hasattr(extension(), "attention_handler"):
        raise RuntimeError("the decode attention kernel is unavailable: rebuild the extension (pip install .)")
    B, K, G, _, D = q.shape
    out = jax.ShapeDtypeStruct((B, K, G, D), jnp.float32)
    call = jax.ffi.ffi_call(ATTENTION_TARGET, out, vmap_method="sequential")
    y = call(q.reshape(B, K, G, D), old.k, old.v, k.reshape(B, K, D).astype(jnp.float32),
             v.reshape(B, K, D).astype(jnp.float32), lo.astype(jnp.int32), hi.astype(jnp.int32),
             isa=np.int64(ISA_CODES[isa]))
    return y.reshape(B, K, G, 1, D)
