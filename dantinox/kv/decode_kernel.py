"""Decode attention through the compiled CPU kernel: a few new tokens per row over a float32 static cache.

At decode (T = 1) attention reads every cached key and value once for a handful of multiply-adds each, so its
cost is the bytes of the cache it reads. XLA runs the two small batched dots of ``model.scores`` on one thread
and over every slot of the window, the empty ones too. The kernel (``attention_handler`` in the extension
``dantinox.quant._block_matmul``, C++ in ``dantinox/quant/csrc/decode_attention.inc``) reads only the slots a
token may see, [lo, hi) (written, past its left padding, inside the sliding window), cuts each KV head's slots
into ranges of 128 that both cores take, and merges the ranges' partial softmaxes in a fixed order
(Milakov & Gimelshein 2018; flash-decoding's split over the keys, Dao et al. 2023), so a row's output does
not depend on the batch or the thread count. Float32 throughout; the result equals ``attention.attend``'s to
float32 rounding (other summation order).

Two uses, both causal over a float32 LayerKV cache without float32 sink rows, float32 queries, the CPU backend
with the extension built, no ambient mesh (a sharded cache keeps XLA's attention) and ``DANTINOX_ATTENTION_KERNEL``
not "off":
  decode     one new token (``decode_kernel_applies``, from ``attention.attend``): it sees [lo, cache_index)
             of the cache as it was before the call, then itself.
  verify     2 .. MAX_VERIFY_TOKENS new tokens over a cache (``verify_kernel_applies``: a speculative verify
             call, a short chunk): the new tokens are written first and token t sees [lo_t, cache_index + t)
             of the written cache, then itself (``verify_attention``): the same slots, ranges and merge order
             as a decode step at slot cache_index + t, so it gives that step's float32 result exactly, and
             greedy speculation reproduces plain decoding however close the logits.
Otherwise XLA's path runs.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from ..quant.block_kernel import ATTENTION_TARGET, ISA_CODES, PAGED_ATTENTION_TARGET, extension

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
    return q.shape[3] == 1 and sinks is None and _kernel_reads(q, old)


def _kernel_reads(q: jax.Array, old) -> bool:
    """The kernel can attend q [B, K, G, T, D] over cache layer ``old``: a float32 LayerKV of q's head size
    (MLA's expanded values are narrower), float32 q, no ambient mesh, the kernel available."""
    return (getattr(old, "_fields", None) == ("k", "v") and old.k.ndim == 4   # a float LayerKV's layout
            and q.shape[-1] == old.k.shape[-1] == old.v.shape[-1]
            and q.dtype == jnp.float32 and old.k.dtype == jnp.float32 and old.v.dtype == jnp.float32
            and jax.sharding.get_abstract_mesh().empty and kernel_available())


MAX_VERIFY_TOKENS = 32   # new tokens per row above which a cached call keeps XLA's attention (prefill chunks)


def verify_kernel_applies(q: jax.Array, layer_cache, read_slots) -> bool:
    """Whether a causal cached call of q [B, K, G, T, D] with 2 <= T <= MAX_VERIFY_TOKENS over ``layer_cache``
    (a float32 LayerKV; read_slots not 0: an old cache is attended) runs ``verify_attention`` (module
    docstring); a static decision, made when the call is traced."""
    return 2 <= q.shape[3] <= MAX_VERIFY_TOKENS and read_slots != 0 and _kernel_reads(q, layer_cache)


def visible_slots(cache_index: jax.Array, key_start, window: int | None, T: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
    """The cached slots new token t at slot cache_index[b] + t may see, [lo[b, t], hi[b, t]) ([B, T] int32
    each): from the row's first real slot (key_start, 0 when None) and, with a sliding window, from its own
    slot - window + 1, up to the slot before its own (``attention.old_slot_mask`` for T = 1)."""
    hi = cache_index.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    lo = jnp.zeros_like(hi) if key_start is None else jnp.broadcast_to(key_start.astype(jnp.int32)[:, None],
                                                                        hi.shape)
    if window is not None:
        lo = jnp.maximum(lo, hi - window + 1)
    return lo, hi


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, old, lo: jax.Array, hi: jax.Array,
                     isa: str = "auto") -> jax.Array:
    """Softmax attention of T new tokens per row, each over its visible cached slots and itself.

    q: [B, K, G, T, D] float32 (scaled by 1/sqrt(D)); k, v: [B, K, T, D] the new tokens' keys and values;
    old: LayerKV of k, v [B, K, L, D] float32; lo, hi: [B, T] int32 (or [B] when T = 1), the cached slots
    [lo, hi) token t reads (clipped to [0, L]; an empty range leaves it attending to itself; slots past hi are
    never read, so they may hold the new tokens already). isa: "auto" (CPUID) or a forced "scalar" / "avx2" /
    "avx512" (tests; the CPU must have it). Returns [B, K, G, T, D] float32. RuntimeError when the extension
    has no attention handler.
    """
    if extension() is None or not hasattr(extension(), "attention_handler"):
        raise RuntimeError("the decode attention kernel is unavailable: rebuild the extension (pip install .)")
    B, K, G, T, D = q.shape
    out = jax.ShapeDtypeStruct((B, K, T, G, D), jnp.float32)
    call = jax.ffi.ffi_call(ATTENTION_TARGET, out, vmap_method="sequential")
    y = call(q.transpose(0, 1, 3, 2, 4), old.k, old.v, k.astype(jnp.float32), v.astype(jnp.float32),
             lo.reshape(B, T).astype(jnp.int32), hi.reshape(B, T).astype(jnp.int32), isa=np.int64(ISA_CODES[isa]))
    return y.transpose(0, 1, 3, 2, 4)


def verify_attention(q: jax.Array, k: jax.Array, v: jax.Array, written, cache_index: jax.Array, key_start,
                     window: int | None) -> jax.Array:
    """Attention of T new tokens over ``written``, the LayerKV [B, K, S, D] with their keys and values already
    written at slots cache_index .. cache_index + T - 1 (module docstring, "verify"). q: [B, K, G, T, D];
    k, v: [B, K, T, D]; cache_index: [B] int32; key_start: [B] int32 or None. Returns [B, K, G, T, D] float32."""
    return decode_attention(q, k, v, written, *visible_slots(cache_index, key_start, window, q.shape[3]))


def paged_kernel_applies(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array) -> bool:
    """Whether a causal call of q [B, K, G, T, D] over a float32 pool layer (k, v [N, P, K, D]) attends in the
    compiled kernel (``paged_attention``): float32 queries and pool of q's head size, no ambient mesh, the
    extension with the paged handler, ``DANTINOX_ATTENTION_KERNEL`` not "off". A static decision."""
    return (q.dtype == jnp.float32 and pool_k.dtype == jnp.float32 and pool_v.dtype == jnp.float32
            and pool_k.ndim == 4 and q.shape[-1] == pool_k.shape[-1] == pool_v.shape[-1]
            and jax.sharding.get_abstract_mesh().empty and kernel_available()
            and hasattr(extension(), "paged_attention_handler"))


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                    table: jax.Array, cache_index: jax.Array, window: int | None, isa: str = "auto") -> jax.Array:
    """Attention of T new tokens per row over a paged pool they have already been written into, in the compiled
    kernel: token t of row b sees slots [lo, cache_index[b] + t) of its blocks (lo: 0, or inside the sliding
    window) and then itself, cut into ranges and merged exactly as ``decode_attention`` does for a static cache
    (so a served token equals the static cache's decode step at the same slot). Only the blocks a row has filled
    are read, and nothing is gathered into a [B, K, M P, D] copy.

    q: [B, K, G, T, D] float32 (scaled); k, v: [B, K, T, D] the new tokens' keys and values; pool_k, pool_v:
    [N, P, K, D] float32 with the new tokens written; table: [B, M] int32 block tables (every entry a valid block
    id; padding rows' zeros are never read past their bounds); cache_index: [B] int32. Returns
    [B, K, G, T, D] float32. RuntimeError without the extension's paged handler."""
    if extension() is None or not hasattr(extension(), "paged_attention_handler"):
        raise RuntimeError("the paged attention kernel is unavailable: rebuild the extension (pip install .)")
    B, K, G, T, D = q.shape
    lo, hi = visible_slots(cache_index, None, window, T)
    out = jax.ShapeDtypeStruct((B, K, T, G, D), jnp.float32)
    call = jax.ffi.ffi_call(PAGED_ATTENTION_TARGET, out, vmap_method="sequential")
    y = call(q.transpose(0, 1, 3, 2, 4), pool_k, pool_v, table.astype(jnp.int32), k.astype(jnp.float32),
             v.astype(jnp.float32), lo.astype(jnp.int32), hi.astype(jnp.int32), isa=np.int64(ISA_CODES[isa]))
    return y.transpose(0, 1, 3, 2, 4)
