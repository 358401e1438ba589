"""The two batched matmuls of grouped-query attention, shared by every attention over a KV cache
(``dantinox.model.attention``, ``dantinox.kv.channel_attention``, the cache views). Shape letters as in
``dantinox.model.attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q . k for every query head of a group. q: [B, K, G, T, D]; k: [B, K, S, D] -> [B, K, G, T, S] float32.

    Written as one batched matmul over (B K) with the group's G*T queries as rows, so the cached keys are
    read in their stored layout; the equivalent 5-D einsum makes XLA transpose them every step (the speed
    difference on the CPU: docs/explanation/performance.md, "Costs behind choices in the code").
    """
    B, K, G, T, D = q.shape
    S = k.shape[2]
    dims = (((2,), (2,)), ((0,), (0,)))
    out = jax.lax.dot_general(q.reshape(B * K, G * T, D), k.reshape(B * K, S, D), dims,
                              preferred_element_type=jnp.float32)
    return out.reshape(B, K, G, T, S)


def grouped_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """Probability-weighted values. probs: [B, K, G, T, S]; v: [B, K, S, D] -> [B, K, G, T, D] float32."""
    B, K, G, T, S = probs.shape
    D = v.shape[-1]
    dims = (((2,), (1,)), ((0,), (0,)))
    out = jax.lax.dot_general(probs.reshape(B * K, G * T, S), v.reshape(B * K, S, D), dims,
                              preferred_element_type=jnp.float32)
    return out.reshape(B, K, G, T, D)
