"""Attention sinks in the int8 KV cache: the first A tokens of every sequence are also kept in float32.

Why. Trained language models put a very large key and value on the first tokens of a sequence, which most
heads attend to whatever the text (Xiao et al. 2023, "Efficient Streaming Language Models with Attention
Sinks", sections 3.1-3.2, who call them attention sinks). Per-row absmax int8 (``dantinox.kv.int8_rows``)
keeps every row's *relative* error the same, so a sink row 50 times larger than the others carries 50 times
their absolute error, and every later query's score against it moves by that much. StreamingLLM keeps the
first four tokens; KIVI (Liu et al. 2024, section 3) and KVQuant (Hooper et al. 2024, section 3.5) likewise
keep a few tokens in full precision next to the quantized ones. docs/explanation/quantization.md, "Attention sinks", has
the measured effect; "Attention sinks or per-channel keys" has SmolLM2's figures, where per-channel keys
(``dantinox.kv.channel_keys``, eval only so far) measured better.

Which tokens. A = ``cfg.sink_slots`` (``ModelConfig.kv_sink_tokens``, 4 by default, 0 for float caches): the
first A positions of each row's sequence, i.e. cache slots key_start .. key_start + A - 1 (key_start is the
row's left padding, 0 when there is none, and always 0 in the paged cache).

What is stored. The int8 rows and scales of every slot as before, plus the float32 rows of the A sink
positions in arrays of their own ([B, K, A, D] per k and v; MLA [B, A, C] and [B, A, R]; the paged pool one
such set per block). Attention reads sink slots from the float32 arrays and every other slot from int8, and
the new tokens that are sinks attend with their float values too, so cached and uncached runs still see the
same keys and values. The bytes are A x (2 K D, or C + R) x 4 per layer and sequence (per block in the paged
pool), counted by ``dantinox.kv.static.sink_bytes_per_layer``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SINK_DTYPE = jnp.float32
SINK_BYTES = 4   # bytes of one stored sink element (SINK_DTYPE)


def sink_flags(cache_index, key_start, T: int, count: int) -> jax.Array:
    """Is new token j of row b one of the row's first ``count`` tokens? [B or 1, T] bool.

    cache_index: scalar or [B] int32, the slot of the row's first new token; key_start: [B] int32 or None (0).
    """
    slot = jnp.reshape(jnp.asarray(cache_index, jnp.int32), (-1, 1)) + jnp.arange(T, dtype=jnp.int32)[None]
    start = 0 if key_start is None else jnp.reshape(key_start, (-1, 1))
    return (slot >= start) & (slot < start + count)


def keep_sinks(read_back: jax.Array, x: jax.Array, flags: jax.Array) -> jax.Array:
    """The values attention uses for the new tokens: x (full precision) where ``flags`` marks a sink token,
    its int8 read-back elsewhere. read_back, x: [B, ..., T, W] (slot axis second to last); flags: [B or 1, T]
    bool. Returns [B, ..., T, W] in read_back's dtype."""
    mask = jnp.reshape(flags, flags.shape[:1] + (1,) * (x.ndim - 3) + flags.shape[1:] + (1,))
    return jnp.where(mask, x.astype(read_back.dtype), read_back)


def write_sinks(sinks: jax.Array, new: jax.Array, cache_index, key_start) -> jax.Array:
    """Copy the new tokens that are sinks into a row's float32 sink array.

    sinks: [B, ..., A, W] float32 (sink n of row b is the token at slot key_start[b] + n); new: [B, ..., T, W]
    the new tokens' full-precision rows, the first at slot cache_index[b]; cache_index: scalar or [B] int32;
    key_start: [B] int32 or None (0). Sinks that no new token covers keep their value. Returns the sinks.
    """
    A, T = sinks.shape[-2], new.shape[-2]
    if A == 0:
        return sinks
    start = 0 if key_start is None else jnp.reshape(key_start, (-1, 1))
    j = start + jnp.arange(A, dtype=jnp.int32)[None] - jnp.reshape(jnp.asarray(cache_index, jnp.int32), (-1, 1))
    shape = j.shape[:1] + (1,) * (new.ndim - 3) + (A, 1)                        # [B, 1.., A, 1]
    picked = jnp.take_along_axis(new, jnp.reshape(jnp.clip(j, 0, T - 1), shape), axis=-2)
    covered = jnp.reshape((j >= 0) & (j < T), shape)
    return jnp.where(covered, picked.astype(sinks.dtype), sinks)
