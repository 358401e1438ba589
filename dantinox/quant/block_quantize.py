"""Float weights quantized into ggml's Q4_1 and Q8_0 block layouts (``--quantize int4`` / ``--quantize q8_0``).

A float checkpoint or a trained run gets the block formats an imported GGUF file keeps (``block_formats``), so
the same modules (``block_linear``), the same compiled kernel and the same exact dequantization run them. Each
row of W [N, M] is cut into M / 32 blocks of 32 consecutive input channels x_0 .. x_31 (M must divide by 32):

  Q4_1 (int4)  lo = min x_j, hi = max x_j; the block stores m = f16(lo) and d = f16((hi - lo) / 15) (f16: the
               nearest float16) and q_j = clip(round((x_j - m) / d), 0, 15) (q_j = 0 when d = 0); the weight
               read back is d q_j + m. 20 bytes per 32 weights (0.625 bytes per weight, 0.156 of float32).
               int4 keeps the embedding table and the output head (tied or not) in Q8_0 (HEAD_FORMAT): on
               SmolLM2-135M a Q4_1 head cost +1.2-1.5 % loss per character against the Q8_0 one
               (docs/explanation/performance.md, "Weight formats on SmolLM2").
  Q8_0         d = f16(max |x_j| / 127), q_j = clip(round(x_j / d), -127, 127) (0 when d = 0); weight d q_j.
               34 bytes per 32 weights.

round is round-half-to-even, computed in float32 with the float16 scales the block stores, so each code is the
nearest one to x_j on the stored grid (the clip only acts where a float16 rounding of d or m moved the grid's
end inside the block's range). Error per weight: at most d / 2, plus for Q4_1 |lo - m| and 15 max(0, (hi - lo)
/ 15 - d) where the rounding of m or d cut the range (both within a float16 ulp of the block's figures).
Asymmetric min / scale blocks as ggml's Q4_1 (Gerganov et al., ggml, ``ggml-common.h`` block layouts; the
rounding here is computed against the stored float16 scales rather than the float32 ones).

Jitted (one compile per matrix shape) and traceable (works under ``nnx.eval_shape``); a block whose scale
overflows float16 (|weights| beyond 65,504) gives an inf scale, which ``block_formats.check_blocks`` finds
(``weights.quantize_weights`` refuses it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32
QUANTIZE_FORMATS = {"int4": "Q4_1", "q8_0": "Q8_0"}   # --quantize value -> the block format it stores
HEAD_FORMAT = "Q8_0"   # int4's embedding table and output head (what llama.cpp's Q4_1 files keep there too)


def _f16_bytes(x: jnp.ndarray) -> jnp.ndarray:
    """x [...] float -> [..., 2] uint8: the float16 nearest x, little-endian (as the block layouts store it)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
    return jnp.stack([bits & 0xFF, bits >> 8], axis=-1).astype(jnp.uint8)


def _check_width(w, name: str) -> None:
    """ValueError naming ``name`` unless w is a matrix [N, M] with M a multiple of 32."""
    if len(w.shape) != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"{name} has shape {list(w.shape)}: its input channels (last axis) are not a multiple "
                         f"of {BLOCK} (the block size)")


def _blocks(w: jnp.ndarray) -> jnp.ndarray:
    """w [N, M] -> float32 [N, M / 32, 32]."""
    n, m = w.shape
    return jnp.asarray(w, jnp.float32).reshape(n, m // BLOCK, BLOCK)


def quantize_q4_1(w: jnp.ndarray, name: str = "weight") -> jnp.ndarray:
    """W [N, M] float -> uint8 [N, M / 32 * 20], Q4_1 blocks (module docstring): per block f16 d, f16 m, then
    16 bytes whose low nibble is q_j and high nibble q_(j + 16). ValueError naming ``name`` if M % 32."""
    _check_width(w, name)
    return _q4_1(w)


def quantize_q8_0(w: jnp.ndarray, name: str = "weight") -> jnp.ndarray:
    """W [N, M] float -> uint8 [N, M / 32 * 34], Q8_0 blocks: per block f16 d, then the 32 int8 codes (two's
    complement bytes). ValueError naming ``name`` if M % 32."""
    _check_width(w, name)
    return _q8_0(w)


@jax.jit
def _q4_1(w: jnp.ndarray) -> jnp.ndarray:
    x = _blocks(w)
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    d = ((hi - lo) / 15.0).astype(jnp.float16).astype(jnp.float32)
    m = lo.astype(jnp.float16).astype(jnp.float32)
    safe = jnp.where(d > 0, d, 1.0)[..., None]
    q = jnp.where(d[..., None] > 0, jnp.round((x - m[..., None]) / safe), 0.0)
    q = jnp.clip(q, 0, 15).astype(jnp.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    out = jnp.concatenate([_f16_bytes(d), _f16_bytes(m), packed], axis=-1)
    return out.reshape(w.shape[0], -1)


@jax.jit
def _q8_0(w: jnp.ndarray) -> jnp.ndarray:
    x = _blocks(w)
    d = (jnp.abs(x).max(axis=-1) / 127.0).astype(jnp.float16).astype(jnp.float32)
    safe = jnp.where(d > 0, d, 1.0)[..., None]
    q = jnp.where(d[..., None] > 0, jnp.round(x / safe), 0.0)
    q = jax.lax.bitcast_convert_type(jnp.clip(q, -127, 127).astype(jnp.int8), jnp.uint8)
    out = jnp.concatenate([_f16_bytes(d), q], axis=-1)
    return out.reshape(w.shape[0], -1)


def quantize_to_blocks(w: jnp.ndarray, fmt: str, name: str = "weight") -> jnp.ndarray:
    """W [N, M] float -> uint8 [N, row bytes] in block format ``fmt`` ("Q4_1" or "Q8_0"); ValueError naming
    ``name`` when M does not divide by 32, or for another format."""
    if fmt == "Q4_1":
        return quantize_q4_1(w, name)
    if fmt == "Q8_0":
        return quantize_q8_0(w, name)
    raise ValueError(f"block format {fmt!r} cannot be produced here: one of Q4_1, Q8_0")
