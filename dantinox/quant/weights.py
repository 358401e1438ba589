"""Low-precision weights: bf16, weight-only int8 (one scale per output channel), or int4 / Q8_0 blocks.

``quantize_weights(model, "bf16" | "int8" | "int4" | "q8_0")`` rewrites a built Transformer in place and
returns it:

  bf16  every projection kernel (attention, MLP, lm_head), the embedding table and MLA's W_UK / W_UV are stored
        bfloat16; each matmul converts the kernel to float32 (exact) right before the dot and accumulates in
        float32 (see ``_dot_last`` for why not a bf16 x bf16 dot).
  int8  every projection kernel and the embedding table become int8 with one float32 scale per output channel
        (symmetric absmax: scale = max |W[:, n]| / 127, q = round(W / scale); Jacob et al. 2018, "Quantization
        and Training of Neural Networks for Efficient Integer-Arithmetic-Only Inference", section 2.1, with the
        zero point fixed at 0). In each matmul the int8 kernel is converted to float32 (exact) right before
        the dot, the dot accumulates in float32 and the fp32 scale multiplies the output columns; no
        dequantized weight is kept between steps, and activations stay float32. The weights take about a
        quarter of their float32 bytes; it saves memory, not necessarily time (measured decode speed:
        docs/explanation/quantization.md, "Decode speed").
        A tied embedding is one int8 table with one scale per vocabulary row: the row of the lookup and the
        output channel of the logits share it. MLA's W_UK / W_UV (used inside the absorbed attention
        einsums) stay float32.

  int4  every projection becomes ggml Q4_1 blocks (32 input channels per block, a float16 scale and minimum
  q8_0  each: 0.625 bytes per weight), the embedding table and the output head Q8_0 blocks (a float16 scale per
        32: 1.0625 bytes per weight); q8_0 makes every one of them Q8_0. Quantized by ``block_quantize``; the
        modules are the ``block_linear`` ones an imported GGUF file gets, so the compiled block kernel runs
        decode and the exact dequantization prefill. Every quantized matrix's input width (M, E for the table)
        must divide by 32: another width is refused naming the tensor (not padded). MLA's W_UK / W_UV stay
        float32. On a mesh the blocks are split by rows (``dantinox.parallel.sharding``), as a GGUF run's are.

RMSNorm scales stay float32 in every mode. Parameters are real nnx.Param leaves, so ``dantinox.param_bytes``
counts the int8 kernels and their scales as they are allocated. Decoding still compiles once per (batch size,
model shape, dtype): the rewritten modules are ordinary pytrees.

Why not qwix (Google's JAX quantization library): see docs/explanation/quantization.md, "Low-precision weights".
Shape letters: see ``dantinox.model.layers`` (E model width, V vocabulary; N output channels, M input channels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .block_formats import check_blocks
from .block_linear import BlockEmbed, BlockLinear, BlockPart, describe_blocks
from .block_quantize import HEAD_FORMAT, QUANTIZE_FORMATS, quantize_to_blocks

QUANTIZE_CHOICES = ("bf16", "int8", "int4", "q8_0")
INT8_MAX = 127.0


def check_quantize(value, name: str = "quantize"):
    """The quantize setting as given, or ValueError naming ``name`` (as the user typed it: "--quantize" for a
    flag, "quantize" for a keyword argument), the value and the allowed values. None means float32 weights."""
    if value is None or (isinstance(value, str) and value in QUANTIZE_CHOICES):
        return value
    shown = f"{name} {value}" if name.startswith("--") else f"{name}={value!r}"
    raise ValueError(f"{shown} is not allowed: one of {', '.join(QUANTIZE_CHOICES)} (or none for float32 "
                     "weights)")


def quantize_channels(w: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax int8 with one scale per slice along ``axis`` (the output channel).

    w: float array, e.g. a kernel [M, N] with axis=1 (scale per column) or a table [V, E] with axis=0.
    Returns (q int8 of w's shape, scale float32 of w.shape[axis]); w ~= q * scale. An all-zero channel gets
    scale 1 (its q is 0), so nothing divides by zero.
    """
    w = jnp.asarray(w, jnp.float32)
    reduce = tuple(a for a in range(w.ndim) if a != axis % w.ndim)
    absmax = jnp.max(jnp.abs(w), axis=reduce)
    scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0).astype(jnp.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = jnp.clip(jnp.round(w / scale.reshape(shape)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def _dot_last(x: jax.Array, kernel: jax.Array, contract_kernel_axis: int) -> jax.Array:
    """x [..., M] . kernel (contracted on ``contract_kernel_axis``) with float32 operands and accumulation.

    A bf16 or int8 kernel is converted to float32 (exactly) right before the dot; x stays float32. XLA CPU
    emits the convert as a small loop fusion feeding the dot: a kernel-sized float32 temporary that lives only
    within the step, while the weights read from memory are 2 or 1 bytes each. Not done, and why:
      - a bf16 x bf16 -> f32 dot (YNNPACK on XLA CPU): the activations must then be rounded to bf16, and the
        one-row decode step and the whole-sequence forward round a few of them to neighbouring bf16 values
        (their float32 values differ in the last bits), so the cached and uncached logits of the bundled model
        differed far beyond verify's tolerance (``dantinox verify --quantize bf16`` failed); float32 operands
        keep them at the float32 floor (figures: docs/explanation/quantization.md, "Low-precision weights");
      - converting int8 to bf16: XLA CPU emits a separate s8 -> bf16 convert loop that costs more than the
        whole float32 dot (docs/explanation/quantization.md).
    """
    dims = (((x.ndim - 1,), (contract_kernel_axis,)), ((), ()))
    return jax.lax.dot_general(x.astype(jnp.float32), kernel.astype(jnp.float32), dims,
                               preferred_element_type=jnp.float32)


class Bf16Linear(nnx.Module):
    """A bias-free projection with a bfloat16 kernel [M, N]: x [..., M] -> [..., N] in x's dtype (fp32 acc.)."""

    def __init__(self, kernel: jax.Array):
        self.kernel = nnx.Param(jnp.asarray(kernel).astype(jnp.bfloat16))

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dot_last(x, self.kernel[...], 0).astype(x.dtype)


class Int8Linear(nnx.Module):
    """A bias-free projection with an int8 kernel [M, N] and float32 scales [N] (one per output channel).

    x [..., M] -> [..., N] in x's dtype: (f32(x) . f32(q)) accumulated in float32, times scale.
    """

    def __init__(self, kernel: jax.Array):
        q, scale = quantize_channels(kernel, axis=1)
        self.kernel = nnx.Param(q)
        self.scale = nnx.Param(scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        return (_dot_last(x, self.kernel[...], 0) * self.scale[...]).astype(x.dtype)


class LowPrecisionEmbed(nnx.Module):
    """Token embedding [V, E] stored bf16, or int8 with one float32 scale per vocabulary row.

    ``__call__(ids [B, T]) -> [B, T, E]`` in ``dtype``; ``attend(h [B, T, E]) -> [B, T, V]`` float32 (the tied
    output projection with float32 accumulation, times the row scales for int8).
    """

    def __init__(self, table: jax.Array, mode: str, dtype):
        self.dtype = dtype
        if mode == "int8":
            q, scale = quantize_channels(table, axis=0)
            self.embedding = nnx.Param(q)
            self.scale = nnx.Param(scale)
        else:
            self.embedding = nnx.Param(jnp.asarray(table).astype(jnp.bfloat16))
            self.scale = None

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.embedding[...], ids, axis=0).astype(jnp.float32)
        if self.scale is not None:
            rows = rows * jnp.take(self.scale[...], ids, axis=0)[..., None]
        return rows.astype(self.dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        out = _dot_last(h, self.embedding[...], 1)
        return out if self.scale is None else out * self.scale[...]


def weights_setting(model) -> str | None:
    """How ``model``'s weights are stored: "int8", "bf16" or None (as built: float32), from its modules."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Int8Linear) or (isinstance(node, LowPrecisionEmbed) and node.scale is not None):
            return "int8"
        if isinstance(node, (Bf16Linear, LowPrecisionEmbed)):
            return "bf16"
    return None


def describe_weights(model) -> str:
    """How ``model``'s weights are stored, for a report line: "float32", "bf16", "int8", or for an imported
    GGUF's blocks "GGUF blocks Q4_1+Q8_0, compiled kernel (avx512)" (or the pure-JAX path and why)."""
    return describe_blocks(model) or weights_setting(model) or "float32"


def quantize_weights(model, quantize: str | None):
    """Rewrite ``model``'s weights for ``quantize`` ("bf16", "int8", "int4", "q8_0" or None = leave float32);
    returns model.

    Every bias-free nnx.Linear becomes a Bf16Linear / Int8Linear (a one-part BlockLinear of Q4_1 / Q8_0 blocks
    for int4 / q8_0), the embedding a LowPrecisionEmbed (a BlockEmbed); for "bf16" any other matrix parameter
    (MLA's W_UK / W_UV) is stored bfloat16 as well. Works on a real model and under ``nnx.eval_shape`` (for
    byte counts). Raises ValueError for another quantize value, a model already quantized (GGUF block weights
    included: ``dantinox.quant.block_linear``), and for int4 / q8_0 a matrix whose input width does not divide
    by 32 or whose block scales overflow float16 (naming the tensor).
    """
    check_quantize(quantize)
    if quantize is None:
        return model
    nodes = list(nnx.iter_graph(model))
    if any(isinstance(n, (BlockLinear, BlockEmbed)) for _, n in nodes):
        raise ValueError(f"quantize={quantize!r}: this model's weights are GGUF blocks, already quantized; import "
                         "the file with --dtype float32 to quantize its dequantized weights instead")
    if any(isinstance(n, (Bf16Linear, Int8Linear, LowPrecisionEmbed)) for _, n in nodes):
        raise ValueError("this model's weights are already quantized; load it again to choose another setting")
    if quantize in QUANTIZE_FORMATS:
        return _to_blocks(model, nodes, quantize)
    for path, node in nodes:
        if not path:
            continue
        parent = _node_at(model, path[:-1])
        if isinstance(node, nnx.Linear):
            if node.bias is not None:
                raise ValueError(f"{'/'.join(map(str, path))}: a Linear with a bias is not supported")
            kind = Int8Linear if quantize == "int8" else Bf16Linear
            _replace(parent, path[-1], kind(node.kernel[...]))
        elif isinstance(node, nnx.Embed):
            _replace(parent, path[-1], LowPrecisionEmbed(node.embedding[...], quantize, node.dtype))
        elif (quantize == "bf16" and isinstance(node, nnx.Param) and node[...].ndim >= 2
              and node[...].dtype == jnp.float32 and not _inside_replaced(parent)):
            node.set_value(node[...].astype(jnp.bfloat16))
    return model


def _block_part(w, quantize: str, name: str, head: bool = False) -> BlockPart:
    """W [N, M] float as a BlockPart of the blocks ``quantize`` stores (HEAD_FORMAT for int4's embedding and
    output head: ``head``); ValueError naming ``name`` for a width that does not divide by 32 or (concrete
    weights only) a float16 scale that overflows."""
    fmt = HEAD_FORMAT if head else QUANTIZE_FORMATS[quantize]
    try:
        data = quantize_to_blocks(w, fmt, name)
    except ValueError as err:
        raise ValueError(f"quantize={quantize!r}: {err}; use int8 or bf16 for this model") from None
    if not isinstance(data, jax.core.Tracer) and check_blocks(jax.device_get(data), fmt):
        raise ValueError(f"quantize={quantize!r}: {name} has weights too large for a {fmt} block's float16 "
                         "scale (beyond 65504 for int4, 127 x 65504 for q8_0); use int8 or bf16 for this model")
    return BlockPart(data, fmt, w.shape[0], w.shape[1], origin=quantize)


def _to_blocks(model, nodes, quantize: str):
    """Every bias-free nnx.Linear -> a one-part BlockLinear, the embedding -> a BlockEmbed (``quantize``'s
    blocks); the model, rewritten in place."""
    for path, node in nodes:
        if not path or not isinstance(node, (nnx.Linear, nnx.Embed)):
            continue
        name = "/".join(map(str, path))
        parent = _node_at(model, path[:-1])
        if isinstance(node, nnx.Linear):
            if node.bias is not None:
                raise ValueError(f"{name}: a Linear with a bias is not supported")
            part = _block_part(node.kernel[...].T, quantize, name, head=path[-1] == "lm_head")
            _replace(parent, path[-1], BlockLinear([part]))
        else:
            part = _block_part(node.embedding[...], quantize, name, head=True)
            _replace(parent, path[-1], BlockEmbed(part, node.dtype))
    return model


def _inside_replaced(parent) -> bool:
    return isinstance(parent, (nnx.Linear, nnx.Embed, Bf16Linear, Int8Linear, LowPrecisionEmbed))


def _node_at(root, path):
    node = root
    for key in path:
        node = node[key] if isinstance(node, (list, tuple, nnx.List, dict)) else getattr(node, key)
    return node


def _replace(parent, key, value) -> None:
    if isinstance(parent, (nnx.List, list)):
        parent[key] = value
    else:
        setattr(parent, key, value)
