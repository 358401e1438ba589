"""Building blocks shared by every attention kind: RMSNorm, the SwiGLU MLP and rotary position embeddings.

Shape letters (used in every docstring of the package):
  B batch, T new tokens in this call, S cache length (max_context), H query heads, K KV heads,
  G = H // K query heads per KV head, D head size, E model width (dim), F MLP hidden width, V vocabulary;
  MLA only: C latent width (kv_latent_dim), R RoPE width (rope_head_dim), Q query latent (q_latent_dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

    Computed in float32 whatever the input dtype; returns the input dtype. x: [..., E] -> [..., E].
    """

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


class SwiGLU(nnx.Module):
    """Gated MLP with a SiLU gate (Shazeer 2020, "GLU Variants Improve Transformer").

    The gate and up projections are fused into one [E, 2F] matmul. x: [B, T, E] -> [B, T, E].
    """

    def __init__(self, dim: int, hidden: int, dtype, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.gate_up = nnx.Linear(dim, 2 * hidden, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                                  kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                               kernel_init=init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)


def rope_angles(positions: jax.Array, head_size: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles (Su et al. 2021, "RoFormer", section 3.4.2).

    positions: [B, T] int32 absolute token positions. Returns (cos, sin), each [B, T, D/2] float32.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (x[..., i], x[..., i + D/2]) by the position angle ("rotate half" layout).

    x: [B, T, N, D] for N heads; cos, sin: [B, T, D/2]. Returns [B, T, N, D] in x's dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
