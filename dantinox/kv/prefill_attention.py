"""Prefill attention through the compiled CPU kernel: a prompt's tokens over their own keys, blocked.

XLA's attention over T new tokens (``attention.attend`` with no old cache) forms the [B, K, G, T, T] scores,
masks them, takes a softmax over each row and multiplies by the values: O(T^2) memory (604 MB of scores per SmolLM2
layer at T = 4,096) and every masked score computed. The kernel (``prefill_attention_handler`` in the extension
``dantinox.quant._block_matmul``, C++ in ``dantinox/quant/csrc/prefill_attention.inc``) is FlashAttention's
forward pass (Dao et al. 2022, algorithm 1): per KV head and block of 32 tokens it walks the blocks of 128 keys
those tokens may see (the keys handed over in panels of 32, ``key_panels``), keeping a running maximum, sum and
output per query (the online softmax of Milakov & Gimelshein 2018), so it holds a few hundred KiB instead of the
score matrix, skips the keys above the diagonal and spreads the blocks over both cores. Float32 throughout; results
equal ``attend``'s to float32 rounding.

It runs for causal calls with no old cache (prefill at slot 0, the uncached forward) of at least
PREFILL_KERNEL_MIN_TOKENS tokens, float32 q, k, v of one head size, a multiple of 32, on the CPU backend with the
extension built, no ambient mesh, and ``DANTINOX_ATTENTION_KERNEL`` not "off" (``prefill_kernel_applies``).
Token i of row b sees new key j when j <= i, c + j >= key_start[b] (left padding; c = cache_index[b]) and
i - j < window; with ``valid``, a token at or past valid[b] (right padding) sees nothing and gets zeros: its
output only ever reaches padding slots, which nothing reads (XLA's path gives such rows other values).
Shape letters as in ``dantinox.model.attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..quant.block_kernel import ISA_CODES, PREFILL_ATTENTION_TARGET, extension
from .decode_kernel import kernel_available

# New tokens from which a call takes the kernel. Below this XLA's [T, T] attention is small.
PREFILL_KERNEL_MIN_TOKENS = 64


def prefill_kernel_applies(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> bool:
    """Whether ``attend`` hands q [B, K, G, T, D] over the new keys k and values v [B, K, T, D] (no old cache)
    to the kernel (module docstring); a static decision, made when the call is traced."""
    T, D = q.shape[3], q.shape[4]
    module = extension()
    return (causal and T >= PREFILL_KERNEL_MIN_TOKENS and D % 32 == 0 and k.shape[-1] == v.shape[-1] == D
            and q.dtype == k.dtype == v.dtype == jnp.float32 and jax.sharding.get_abstract_mesh().empty
            and kernel_available() and hasattr(module, "prefill_attention_handler"))


def visible_keys(T: int, cache_index: jax.Array, key_start, window: int | None, valid=None
                 ) -> tuple[jax.Array, jax.Array]:
    """The new keys token t of row b sees, [lo[b, t], hi[b, t]) ([B, T] int32 each): from the row's first real
    slot (key_start - cache_index, 0 when key_start is None) and, with a sliding window, from t - window + 1, up
    to t itself; empty (hi = lo) for t >= valid[b] when valid ([B] int32) is given (module docstring)."""
    B = cache_index.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    hi = jnp.broadcast_to(t + 1, (B, T))
    lo = jnp.zeros((B, T), jnp.int32)
    if key_start is not None:
        lo = jnp.maximum(lo, (key_start.astype(jnp.int32) - cache_index.astype(jnp.int32))[:, None])
    if window is not None:
        lo = jnp.maximum(lo, t - window + 1)
    if valid is not None:
        hi = jnp.where(t < jnp.asarray(valid, jnp.int32)[:, None], hi, lo)
    return lo, hi


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_index: jax.Array, key_start,
                      window: int | None, valid=None, isa: str = "auto") -> jax.Array:
    """Causal softmax attention of T new tokens per row over their own keys and values (no cache).

    q: [B, K, G, T, D] float32 (scaled by 1/sqrt(D)); k, v: [B, K, T, D] float32; cache_index: [B] int32 (the
    slot of the first new token, used with key_start); key_start: [B] int32 or None; window: sliding window or
    None; valid: [B] int32 real tokens per row or None (``visible_keys``). isa: "auto" (CPUID) or a forced
    "scalar" / "avx2" / "avx512" (tests; the CPU must have it). Returns [B, K, G, T, D] float32.
    Raises RuntimeError when the extension has no prefill attention handler, ValueError when D is not a
    multiple of 32.
    """
    module = extension()
    if module is None or not hasattr(module, "prefill_attention_handler"):
        raise RuntimeError("the prefill attention kernel is unavailable: rebuild the extension (pip install .)")
    B, K, G, T, D = q.shape
    if D % 32:
        raise ValueError(f"prefill attention needs a head size that is a multiple of 32; got {D}")
    lo, hi = visible_keys(T, cache_index, key_start, window, valid)
    # The kernel reads q and v and writes y token-major ([B, T, K, G, D], [B, T, K, D]): the layout the
    # projections produce and the output projection reads, so XLA cancels these transposes with attention's own.
    call = jax.ffi.ffi_call(PREFILL_ATTENTION_TARGET, jax.ShapeDtypeStruct((B, T, K, G, D), jnp.float32),
                            vmap_method="sequential")
    y = call(q.transpose(0, 3, 1, 2, 4), key_panels(k.astype(jnp.float32)),
             v.astype(jnp.float32).transpose(0, 2, 1, 3), lo, hi, isa=np.int64(ISA_CODES[isa]))
    return y.transpose(0, 2, 3, 1, 4)


def key_panels(k: jax.Array) -> jax.Array:
    """The keys k [B, K, T, D] as the kernel reads them: panels of 32 keys, each channel's 32 values together,
    [B, K, ceil(T / 32), D, 32] (keys past T zero). Transposed once per call (by XLA) instead of once per block
    of queries in the kernel."""
    B, K, T, D = k.shape
    padded = jnp.pad(k, ((0, 0), (0, 0), (0, -T % 32), (0, 0)))
    return padded.reshape(B, K, -1, 32, D).transpose(0, 1, 2, 4, 3)
