"""ggml's block formats of quantized weights, as GGUF files store them, and their dequantization in JAX.

A weight matrix W [N, M] (N output channels, M input channels; a GGUF tensor of ggml shape [M, N]) is stored
as N rows of M / BS blocks, each block BYTES bytes (the layouts of llama.cpp's ggml-common.h, read here as the
``gguf`` package's ``gguf.quants`` reads them), so a matrix is a uint8 array [N, M / BS * BYTES]:

  format  BS   BYTES  one block                                                        weight
  Q8_0    32   34     float16 d, 32 int8 q                                             d q
  Q4_0    32   18     float16 d, 16 bytes: value j < 16 low nibble of byte j, j >= 16   d (q - 8)
                      the high nibble of byte j - 16
  Q4_1    32   20     float16 d, float16 m, nibbles as Q4_0                            d q + m
  Q4_K    256  144    float16 d, float16 dmin, 12 bytes of 6-bit scales / mins of the  d sc_s q - dmin m_s
                      8 sub-blocks of 32, 128 bytes of nibbles (sub-block s: low (s
                      even) / high (s odd) nibbles of bytes 32 (s // 2) .. + 32)
  Q5_K    256  176    as Q4_K with 32 bytes of high bits before the nibbles (bit s of  d sc_s q - dmin m_s
                      byte j: the fifth bit of value j of sub-block s)
  Q6_K    256  210    128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8     d sc_(v // 16) (q - 32)
                      scales, float16 d last

``dequantize_blocks(data, fmt, n_in)`` gives float32 [..., N, M] with the same operations in the same order as
``gguf.quants.dequantize`` (so the same float32 values); ``check_blocks`` finds non-finite scales (a damaged
file). The compiled kernel (``dantinox/quant/csrc``) reads the same layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    """One block format: name, values per block (block_size), bytes per block, the kernel's format code and
    the byte offsets of its float16 scales inside a block (checked for NaN / inf at import)."""

    name: str
    block_size: int
    block_bytes: int
    code: int
    scale_offsets: tuple[int, ...]


FORMATS = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34, 0, (0,)),
    BlockFormat("Q4_0", 32, 18, 1, (0,)),
    BlockFormat("Q4_1", 32, 20, 2, (0, 2)),
    BlockFormat("Q4_K", 256, 144, 3, (0, 2)),
    BlockFormat("Q5_K", 256, 176, 4, (0, 2)),
    BlockFormat("Q6_K", 256, 210, 5, (208,)),
)}
BLOCK_FORMATS = tuple(FORMATS)


def block_format(name: str) -> BlockFormat:
    """The BlockFormat called ``name``; ValueError naming the allowed formats otherwise."""
    if name not in FORMATS:
        raise ValueError(f"block format {name!r} is not supported: one of {', '.join(BLOCK_FORMATS)}")
    return FORMATS[name]


def row_bytes(fmt: str, n_in: int) -> int:
    """Bytes of one stored row of ``n_in`` weights; ValueError if n_in is not a multiple of the block size."""
    spec = block_format(fmt)
    if n_in % spec.block_size:
        raise ValueError(f"{fmt} rows hold multiples of {spec.block_size} weights; got {n_in}")
    return n_in // spec.block_size * spec.block_bytes


def check_blocks(data: np.ndarray, fmt: str) -> int:
    """The number of blocks of ``data`` (uint8 [N, row bytes]) whose float16 scales are NaN or inf."""
    spec = block_format(fmt)
    blocks = np.ascontiguousarray(data).reshape(-1, spec.block_bytes)
    bad = np.zeros(len(blocks), bool)
    for offset in spec.scale_offsets:
        scale = blocks[:, offset:offset + 2].copy().view(np.float16)[:, 0]
        bad |= ~np.isfinite(scale)
    return int(bad.sum())


def _half(b: jnp.ndarray) -> jnp.ndarray:
    """float16 values of little-endian byte pairs b [..., 2] (uint8), as float32."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _int8(b: jnp.ndarray) -> jnp.ndarray:
    """uint8 bytes read as int8 (two's complement), as float32."""
    return jax.lax.bitcast_convert_type(b, jnp.int8).astype(jnp.float32)


def _nibbles(q: jnp.ndarray) -> jnp.ndarray:
    """q [..., 16 k] bytes -> [..., 2, 16 k] (low nibbles first, then high), as int32."""
    q = q.astype(jnp.int32)
    return jnp.stack([q & 0x0F, q >> 4], axis=-2)


def _k_scales(sc: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K from their 12 bytes sc [..., 12] (int32 each)."""
    sc = sc.astype(jnp.int32)
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, mins


def _dequantize(b: jnp.ndarray, fmt: str) -> jnp.ndarray:
    """b [..., blocks, BYTES] uint8 -> [..., blocks, BS] float32 (the formula of the module docstring)."""
    f32 = jnp.float32
    if fmt == "Q8_0":
        return _int8(b[..., 2:]) * _half(b[..., 0:2])[..., None]
    if fmt == "Q4_0":
        q = _nibbles(b[..., 2:]).reshape(*b.shape[:-1], 32)
        return _half(b[..., 0:2])[..., None] * (q - 8).astype(f32)
    if fmt == "Q4_1":
        q = _nibbles(b[..., 4:]).reshape(*b.shape[:-1], 32).astype(f32)
        return _half(b[..., 0:2])[..., None] * q + _half(b[..., 2:4])[..., None]
    if fmt in ("Q4_K", "Q5_K"):
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        scale, mins = _k_scales(b[..., 4:16])
        qs = b[..., 48:] if fmt == "Q5_K" else b[..., 16:]
        q = _nibbles(qs.reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
        if fmt == "Q5_K":
            high = (b[..., 16:48].astype(jnp.int32)[..., None, :] >> jnp.arange(8)[:, None]) & 1
            q = q | (high << 4)
        ds = (d[..., None] * scale.astype(f32))[..., None]
        dm = (dmin[..., None] * mins.astype(f32))[..., None]
        return (ds * q.astype(f32) - dm).reshape(*b.shape[:-1], 256)
    if fmt == "Q6_K":
        ql = b[..., :128].astype(jnp.int32).reshape(*b.shape[:-1], 2, 1, 64)
        ql = ((ql >> jnp.array([0, 4]).reshape(2, 1)) & 0x0F).reshape(*b.shape[:-1], 2, 128)
        qh = b[..., 128:192].astype(jnp.int32).reshape(*b.shape[:-1], 2, 1, 32)
        qh = ((qh >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 0x03).reshape(*b.shape[:-1], 2, 128)
        q = ((ql | (qh << 4)) - 32).reshape(*b.shape[:-1], 16, 16).astype(f32)
        scales = _int8(b[..., 192:208])
        d = (_half(b[..., 208:210])[..., None] * scales)[..., None]
        return (d * q).reshape(*b.shape[:-1], 256)
    raise ValueError(f"block format {fmt!r} is not supported: one of {', '.join(BLOCK_FORMATS)}")


def dequantize_blocks(data: jnp.ndarray, fmt: str, n_in: int) -> jnp.ndarray:
    """data uint8 [..., N, row_bytes(fmt, n_in)] -> the weights float32 [..., N, n_in] (traceable)."""
    spec = block_format(fmt)
    blocks = data.reshape(*data.shape[:-1], n_in // spec.block_size, spec.block_bytes)
    return _dequantize(blocks, fmt).reshape(*data.shape[:-1], n_in)


@dataclass(frozen=True, eq=False)
class BlockMatrix:
    """One weight matrix W [n_out, n_in] as a checkpoint stores it: ``fmt`` a block format (``data`` uint8
    [n_out, row_bytes(fmt, n_in)], the rows as stored) or "F32" (``data`` float32 [n_out, n_in])."""

    fmt: str
    data: np.ndarray
    n_out: int
    n_in: int

    def dequantized(self) -> np.ndarray:
        """W as float32 [n_out, n_in] (exact)."""
        if self.fmt == "F32":
            return np.asarray(self.data, np.float32)
        return np.asarray(dequantize_blocks(jnp.asarray(self.data), self.fmt, self.n_in))
