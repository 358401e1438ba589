"""Building blocks shared by every attention kind: RMSNorm, the gated MLP (SwiGLU / GeGLU) and rotary position
embeddings.

Shape letters (used in every docstring of the package):
  B batch, T new tokens in this call, S cache length (max_context), H query heads, K KV heads,
  G = H // K query heads per KV head, D head size, E model width (dim), F MLP hidden width, V vocabulary;
  MLA only: C latent width (kv_latent_dim), R RoPE width (rope_head_dim), Q query latent (q_latent_dim).
"""

from __future__ import annotations

import math

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


ACTIVATIONS = {  # ModelConfig.mlp_activation -> the gate's nonlinearity
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),   # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
}


class GatedMLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer"): SwiGLU with
    activation "silu", GeGLU with "gelu_tanh" (GELU's tanh approximation, Hendrycks & Gimpel 2016, section 2;
    Gemma's ``gelu_pytorch_tanh``).

    The gate and up projections are fused into one [E, 2F] matmul (gate columns first). x: [B, T, E] ->
    [B, T, E]. KeyError for an activation not in ACTIVATIONS (ModelConfig validates the name first).
    """

    def __init__(self, dim: int, hidden: int, dtype, *, rngs: nnx.Rngs, activation: str = "silu"):
        init = nnx.initializers.normal(stddev=0.02)
        self.gate_up = nnx.Linear(dim, 2 * hidden, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                                  kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                               kernel_init=init, rngs=rngs)
        self.activation = activation
        ACTIVATIONS[activation]   # noqa: B018 - an unknown name fails here, not at the first call

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(ACTIVATIONS[self.activation](gate) * up)


def rope_angles(positions: jax.Array, head_size: int, theta: float,
                scaling: tuple | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles (Su et al. 2021, "RoFormer", section 3.4.2).

    positions: [B, T] int32 absolute token positions; scaling: ``ModelConfig.rope_scaling`` (None, or sorted
    (key, value) pairs; see ``rope_inv_freq``). Returns (cos, sin), each [B, T, D/2] float32.
    """
    inv_freq = rope_inv_freq(head_size, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    params = dict(scaling or ())
    if params.get("type") == "yarn":  # YaRN scales cos and sin, i.e. the rotated q and k (section 3.4)
        factor = params["attention_factor"]
        return jnp.cos(angles) * factor, jnp.sin(angles) * factor
    return jnp.cos(angles), jnp.sin(angles)


def rope_inv_freq(head_size: int, theta: float, scaling: tuple | None = None) -> jax.Array:
    """The D/2 rotary frequencies theta^(-2i/D), float32, optionally rescaled.

    scaling None: plain RoPE. type "linear": every frequency divided by ``factor`` (Chen et al. 2023,
    "Extending Context Window of Large Language Models via Positional Interpolation"). type "llama3": Llama 3.1's
    band-wise rule: with wavelength w = 2 pi / f and L = original_max_position_embeddings, frequencies with
    w < L / high_freq_factor are kept, those with w > L / low_freq_factor are divided by ``factor``, and the band
    between interpolates linearly in L / w (Meta's Llama 3.1 reference ``apply_scaling``). type "yarn": see
    ``_yarn_inv_freq`` (rope_angles also multiplies cos and sin by its attention_factor).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size))
    if scaling is None:
        return inv_freq
    params = dict(scaling)
    factor = params["factor"]
    if params["type"] == "linear":
        return inv_freq / factor
    if params["type"] == "yarn":
        return _yarn_inv_freq(head_size, theta, params)
    old_len = params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_size: int, theta: float, params: dict) -> jax.Array:
    """YaRN's frequencies (Peng et al. 2023, section 3.2, "NTK-by-parts"): dims that turn fewer than beta_slow
    times over the original context are interpolated (divided by factor), those that turn more than beta_fast
    times are kept, with a linear ramp between; the ramp bounds are floored / ceiled when ``truncate``."""
    old_len = params["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return head_size * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(params["beta_fast"]), correction_dim(params["beta_slow"])
    if params["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(head_size // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size)
    keep = 1 - ramp
    return (1.0 / (params["factor"] * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (x[..., i], x[..., i + D/2]) by the position angle ("rotate half" layout).

    x: [B, T, N, D] for N heads; cos, sin: [B, T, D/2]. Returns [B, T, N, D] in x's dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
