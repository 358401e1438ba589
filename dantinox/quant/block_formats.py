"""ggml's block formats of quantized weights, as GGUF files store them, and their dequantization in JAX.

A weight matrix W [N, M] (N output channels, M input channels; a GGUF tensor of ggml shape [M, N]) is stored
as N rows of M / BS blocks, each block BYTES bytes (the layouts of llama.cpp's ggml-common.h, read here as the
``gguf`` package's ``gguf.quants`` reads them), so a matrix is a uint8 array [N, M / BS * BYTES]. Float16
values are little-endian; "nibbles as Q4_0" means value j < 16 is the low nibble of byte j and value j >= 16
the high nibble of byte j - 16.

  format  BS   BYTES  one block                                                        weight
  Q8_0    32   34     float16 d, 32 int8 q                                             d q
  Q4_0    32   18     float16 d, 16 bytes of nibbles                                   d (q - 8)
  Q4_1    32   20     float16 d, float16 m, nibbles as Q4_0                            d q + m
  Q5_0    32   22     float16 d, 4 bytes qh (bit j of the little-endian uint32: the     d (q - 16)
                      fifth bit of value j), nibbles as Q4_0
  Q5_1    32   24     float16 d, float16 m, qh and nibbles as Q5_0                     d q + m
  IQ4_NL  32   18     float16 d, nibbles as Q4_0 indexing a fixed table of 16 int8      d T[q]
                      values T (``IQ4_VALUES``, non-uniform)
  Q2_K    256  84     16 bytes of 4-bit scale (low) / min (high) per 16 values, 64      d sc_s q - dmin m_s
                      bytes of 2-bit q (value 128 h + 32 k + i: bits 2k of byte
                      32 h + i), float16 d, float16 dmin
  Q3_K    256  110    32 bytes hmask (value 32 k + i: bit k of byte i), 64 bytes of     d (sc_s - 32) (q - 4 (1 - hbit))
                      2-bit q as Q2_K, 12 bytes of 6-bit scales per 16 values (s < 8:
                      low nibble of byte s, else high nibble of byte s - 8; bits 4-5:
                      2 bits (shift 2 (s // 4)) of byte 8 + s % 4), float16 d
  Q4_K    256  144    float16 d, float16 dmin, 12 bytes of 6-bit scales / mins of the  d sc_s q - dmin m_s
                      8 sub-blocks of 32, 128 bytes of nibbles (sub-block s: low (s
                      even) / high (s odd) nibbles of bytes 32 (s // 2) .. + 32)
  Q5_K    256  176    as Q4_K with 32 bytes of high bits before the nibbles (bit s of  d sc_s q - dmin m_s
                      byte j: the fifth bit of value j of sub-block s)
  Q6_K    256  210    128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8     d sc_(v // 16) (q - 32)
                      scales, float16 d last
  IQ4_XS  256  136    float16 d, uint16 of 2 high scale bits per sub-block of 32, 4    d (sc_s - 32) T[q]
                      bytes of low scale nibbles (sub-block s: nibble s % 2 of byte
                      s // 2), 128 bytes: 16 per sub-block, nibbles as Q4_0

(sc_s, m_s: the scale and min of the value's sub-block, 16 values in Q2_K / Q3_K, 32 in the others.)
``dequantize_blocks(data, fmt, n_in)`` gives float32 [..., N, M] with the same operations in the same order as
``gguf.quants.dequantize`` (so the same float32 values); ``check_blocks`` finds non-finite scales (a damaged
file). The compiled kernel (``dantinox/quant/csrc``) reads the same layouts. ``bytes_per_weight`` is BYTES / BS.
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

    @property
    def bytes_per_weight(self) -> float:
        """Stored bytes per weight (block_bytes / block_size; float32 is 4)."""
        return self.block_bytes / self.block_size


FORMATS = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34, 0, (0,)),
    BlockFormat("Q4_0", 32, 18, 1, (0,)),
    BlockFormat("Q4_1", 32, 20, 2, (0, 2)),
    BlockFormat("Q4_K", 256, 144, 3, (0, 2)),
    BlockFormat("Q5_K", 256, 176, 4, (0, 2)),
    BlockFormat("Q6_K", 256, 210, 5, (208,)),
    BlockFormat("Q5_0", 32, 22, 6, (0,)),
    BlockFormat("Q5_1", 32, 24, 7, (0, 2)),
    BlockFormat("Q2_K", 256, 84, 8, (80, 82)),
    BlockFormat("Q3_K", 256, 110, 9, (108,)),
    BlockFormat("IQ4_NL", 32, 18, 10, (0,)),
    BlockFormat("IQ4_XS", 256, 136, 11, (0,)),
)}
BLOCK_FORMATS = tuple(FORMATS)
# The 16 values an IQ4_NL / IQ4_XS code selects (llama.cpp's kvalues_iq4nl, also ``gguf.quants.IQ4_NL.kvalues``).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


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


def _bits(b: jnp.ndarray, n: int) -> jnp.ndarray:
    """b [..., k] bytes -> [..., n, k] int32: entry (j, i) is bits 8 / n * j .. of byte i, n in {2, 4, 8}
    (n = 4: the 2-bit fields at shifts 0, 2, 4, 6; n = 8: single bits)."""
    width = 8 // n
    shifts = (jnp.arange(n) * width)[:, None]
    return (b.astype(jnp.int32)[..., None, :] >> shifts) & ((1 << width) - 1)


def _k_scales(sc: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K from their 12 bytes sc [..., 12] (int32 each)."""
    sc = sc.astype(jnp.int32)
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, mins


def _q8_0(b):
    return _int8(b[..., 2:]) * _half(b[..., 0:2])[..., None]


def _q4_0(b):
    q = _nibbles(b[..., 2:]).reshape(*b.shape[:-1], 32)
    return _half(b[..., 0:2])[..., None] * (q - 8).astype(jnp.float32)


def _q4_1(b):
    q = _nibbles(b[..., 4:]).reshape(*b.shape[:-1], 32).astype(jnp.float32)
    return _half(b[..., 0:2])[..., None] * q + _half(b[..., 2:4])[..., None]


def _q5(b, offset: int) -> jnp.ndarray:
    """The 32 five-bit codes (int32) of a Q5_0 / Q5_1 block whose qh starts at byte ``offset``."""
    low = _nibbles(b[..., offset + 4:]).reshape(*b.shape[:-1], 32)
    high = _bits(b[..., offset:offset + 4], 8).swapaxes(-1, -2).reshape(*b.shape[:-1], 32)
    return low | (high << 4)


def _q5_0(b):
    return _half(b[..., 0:2])[..., None] * (_q5(b, 2) - 16).astype(jnp.float32)


def _q5_1(b):
    return _half(b[..., 0:2])[..., None] * _q5(b, 4).astype(jnp.float32) + _half(b[..., 2:4])[..., None]


def _iq4_nl(b):
    q = _nibbles(b[..., 2:]).reshape(*b.shape[:-1], 32)
    return _half(b[..., 0:2])[..., None] * jnp.asarray(IQ4_VALUES, jnp.float32)[q]


def _two_bit(qs: jnp.ndarray) -> jnp.ndarray:
    """The 256 two-bit codes of Q2_K / Q3_K from their 64 bytes qs [..., 64] -> [..., 16, 16] int32."""
    q = _bits(qs.reshape(*qs.shape[:-1], 2, 32), 4)        # [..., half h, shift k, byte i]
    return q.reshape(*qs.shape[:-1], 16, 16)


def _q2_k(b):
    sc = b[..., :16].astype(jnp.int32)
    d, dmin = _half(b[..., 80:82]), _half(b[..., 82:84])
    dl = (d[..., None] * (sc & 0x0F).astype(jnp.float32))[..., None]
    ml = (dmin[..., None] * (sc >> 4).astype(jnp.float32))[..., None]
    return (dl * _two_bit(b[..., 16:80]).astype(jnp.float32) - ml).reshape(*b.shape[:-1], 256)


def _q3_k(b):
    raw = b[..., 96:108].astype(jnp.int32)
    low = jnp.concatenate([raw[..., :8] & 0x0F, raw[..., :8] >> 4], axis=-1)          # scale s: nibble
    high = _bits(b[..., 104:108], 4).reshape(*b.shape[:-1], 16)                       # s = 4 j + i
    dl = (_half(b[..., 108:110])[..., None] * ((low | (high << 4)) - 32).astype(jnp.float32))[..., None]
    hbit = _bits(b[..., :32], 8).reshape(*b.shape[:-1], 16, 16)
    q = _two_bit(b[..., 32:96]) - ((1 - hbit) << 2)
    return (dl * q.astype(jnp.float32)).reshape(*b.shape[:-1], 256)


def _q45_k(b, fmt: str):
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
    scale, mins = _k_scales(b[..., 4:16])
    qs = b[..., 48:] if fmt == "Q5_K" else b[..., 16:]
    q = _nibbles(qs.reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
    if fmt == "Q5_K":
        q = q | (_bits(b[..., 16:48], 8) << 4)
    ds = (d[..., None] * scale.astype(jnp.float32))[..., None]
    dm = (dmin[..., None] * mins.astype(jnp.float32))[..., None]
    return (ds * q.astype(jnp.float32) - dm).reshape(*b.shape[:-1], 256)


def _q6_k(b):
    ql = b[..., :128].astype(jnp.int32).reshape(*b.shape[:-1], 2, 1, 64)
    ql = ((ql >> jnp.array([0, 4]).reshape(2, 1)) & 0x0F).reshape(*b.shape[:-1], 2, 128)
    qh = b[..., 128:192].astype(jnp.int32).reshape(*b.shape[:-1], 2, 1, 32)
    qh = ((qh >> jnp.array([0, 2, 4, 6]).reshape(4, 1)) & 0x03).reshape(*b.shape[:-1], 2, 128)
    q = ((ql | (qh << 4)) - 32).reshape(*b.shape[:-1], 16, 16).astype(jnp.float32)
    d = (_half(b[..., 208:210])[..., None] * _int8(b[..., 192:208]))[..., None]
    return (d * q).reshape(*b.shape[:-1], 256)


def _iq4_xs(b):
    high = _bits(b[..., 2:4], 4).swapaxes(-1, -2).reshape(*b.shape[:-1], 8)   # 2 bits of the uint16 per s
    low = _nibbles(b[..., 4:8]).swapaxes(-1, -2).reshape(*b.shape[:-1], 8)     # nibble s % 2 of byte s // 2
    dl = (_half(b[..., 0:2])[..., None] * ((low | (high << 4)) - 32).astype(jnp.float32))[..., None]
    q = _nibbles(b[..., 8:].reshape(*b.shape[:-1], 8, 16)).reshape(*b.shape[:-1], 8, 32)
    return (dl * jnp.asarray(IQ4_VALUES, jnp.float32)[q]).reshape(*b.shape[:-1], 256)


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "IQ4_NL": _iq4_nl,
               "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": lambda b: _q45_k(b, "Q4_K"),
               "Q5_K": lambda b: _q45_k(b, "Q5_K"), "Q6_K": _q6_k, "IQ4_XS": _iq4_xs}


def _dequantize(b: jnp.ndarray, fmt: str) -> jnp.ndarray:
    """b [..., blocks, BYTES] uint8 -> [..., blocks, BS] float32 (the formulas of the module docstring)."""
    if fmt not in _DEQUANTIZE:
        raise ValueError(f"block format {fmt!r} is not supported: one of {', '.join(BLOCK_FORMATS)}")
    return _DEQUANTIZE[fmt](b)


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
