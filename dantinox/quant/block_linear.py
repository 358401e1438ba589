"""Projections and the token embedding whose weights stay in GGUF's block formats (``block_formats``).

``BlockLinear``   a projection x [..., M] -> [..., N] (+ a float32 bias [N] when the model's has one: Qwen2's
                  q | k | v) whose weight W [N, M] is the row-wise
                  concatenation of parts, each in its own format (a fused q | k | v or gate | up whose source
                  tensors were quantized differently, as llama.cpp's mixed files do), computed by
                  ``block_kernel.block_matmul`` (the compiled kernel: its few-row loops for decode, its tiled
                  product for prefill; XLA's dot on the dequantized blocks without it); the output is cast to x's
                  dtype.
``BlockEmbed``    the token table [V, E] as blocks: a lookup dequantizes only the rows it reads; ``attend(h)`` is
                  the tied output head (the table's rows are the head's output channels), through the kernel.

A part of format "F32" holds float32 rows [N, M] (a tensor the file stored as F32 / F16 / BF16, widened).
The run directory stores each part's array as ``<module>.parts.<i>.data`` and the layout ({module path:
[[format, N, M], ...]}) in the safetensors metadata under LAYOUT_KEY; ``apply_block_layout`` rebuilds the
modules of a freshly built Transformer from it before the arrays are loaded (``dantinox.runs.run_dir``).
Shape letters: see ``dantinox.model.layers`` (N output channels, M input channels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .block_formats import FORMATS, block_format, dequantize_blocks, row_bytes
from .block_kernel import block_matmul, kernel_status

LAYOUT_KEY = "dantinox_block_layout"
EMBED = "embed"


class BlockPart(nnx.Module):
    """W [n_out, n_in] in ``fmt``: data uint8 [n_out, row bytes] (a block format) or float32 [n_out, n_in].
    ``origin``: "GGUF" (blocks read from a file) or the ``--quantize`` setting that made them ("int4", "q8_0"),
    for reports only."""

    def __init__(self, data, fmt: str, n_out: int, n_in: int, origin: str = "GGUF"):
        if fmt != "F32":
            block_format(fmt)
        self.fmt, self.n_out, self.n_in, self.origin = fmt, int(n_out), int(n_in), origin
        self.data = nnx.Param(jnp.asarray(data))

    def weights(self) -> jax.Array:
        """W dequantized, float32 [n_out, n_in]."""
        data = self.data[...]
        return data.astype(jnp.float32) if self.fmt == "F32" else dequantize_blocks(data, self.fmt, self.n_in)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., n_in] -> x . W^T [..., n_out] float32."""
        if self.fmt == "F32":
            dims = (((x.ndim - 1,), (1,)), ((), ()))
            return jax.lax.dot_general(x.astype(jnp.float32), self.data[...], dims,
                                       preferred_element_type=jnp.float32)
        return block_matmul(x, self.data[...], self.fmt, self.n_in)


def empty_part(fmt: str, n_out: int, n_in: int) -> BlockPart:
    """A BlockPart of zeros with the array shape and dtype that ``fmt`` stores (filled by a loader)."""
    if fmt == "F32":
        return BlockPart(np.zeros((n_out, n_in), np.float32), fmt, n_out, n_in)
    return BlockPart(np.zeros((n_out, row_bytes(fmt, n_in)), np.uint8), fmt, n_out, n_in)


class BlockLinear(nnx.Module):
    """A projection x [..., M] -> [..., N] (N = sum of the parts' n_out) plus ``bias`` [N] float32 when given
    (added in float32), output in x's dtype."""

    def __init__(self, parts: list[BlockPart], bias=None):
        self.parts = nnx.List(parts)
        self.bias = None if bias is None else nnx.Param(jnp.asarray(bias, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        outs = [part(x) for part in self.parts]
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
        if self.bias is not None:
            out = out + self.bias[...]
        return out.astype(x.dtype)


class BlockEmbed(nnx.Module):
    """Token embedding [V, E] as one BlockPart. ``__call__(ids [B, T]) -> [B, T, E]`` in ``dtype``;
    ``attend(h [B, T, E]) -> [B, T, V]`` float32 (the tied output head)."""

    def __init__(self, part: BlockPart, dtype):
        self.parts = nnx.List([part])
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        part = self.parts[0]
        rows = jnp.take(part.data[...], ids, axis=0)
        if part.fmt != "F32":
            rows = dequantize_blocks(rows, part.fmt, part.n_in)
        return rows.astype(self.dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        return self.parts[0](h)


def _node_at(root, path: str):
    node = root
    for key in path.split("."):
        node = node[int(key)] if key.isdigit() else getattr(node, key)
    return node


def _set_at(root, path: str, value) -> None:
    parent_path, _, key = path.rpartition(".")
    parent = _node_at(root, parent_path) if parent_path else root
    if key.isdigit():
        parent[int(key)] = value
    else:
        setattr(parent, key, value)


def apply_block_layout(model, layout: dict) -> None:
    """Replace, in place, each module named in ``layout`` ({path: [[format, N, M], ...]}) by a BlockLinear
    (with a zero bias of the same shape when the nnx.Linear has one) / BlockEmbed ("embed") of zeros of those
    parts. ValueError naming the path when it is not an nnx.Linear / nnx.Embed whose shape the parts add up to,
    or a format is unknown."""
    for path, parts in layout.items():
        try:
            node = _node_at(model, path)
        except (AttributeError, IndexError, TypeError):
            raise ValueError(f"block layout names {path!r}, which the model does not have") from None
        blocks = [empty_part(str(fmt), int(n), int(m)) for fmt, n, m in parts]
        rows, cols = sum(p.n_out for p in blocks), {p.n_in for p in blocks}
        if isinstance(node, nnx.Embed) and path == EMBED and len(blocks) == 1:
            want = tuple(node.embedding.get_value().shape)
            replacement = BlockEmbed(blocks[0], node.dtype)
        elif isinstance(node, nnx.Linear):
            want = tuple(node.kernel.get_value().shape)[::-1]
            bias = None if node.bias is None else np.zeros(node.bias.get_value().shape, np.float32)
            replacement = BlockLinear(blocks, bias)
        else:
            raise ValueError(f"block layout names {path!r}, which is not a projection or the embedding")
        if len(cols) != 1 or (rows, cols.pop()) != want:
            raise ValueError(f"block layout of {path!r}: parts {parts} do not make the matrix {list(want)}")
        _set_at(model, path, replacement)


def block_layout(model) -> dict:
    """The layout of ``model``'s block modules ({path: [[format, N, M], ...]}; {} for a model without)."""
    layout = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (BlockLinear, BlockEmbed)):
            layout[".".join(map(str, path))] = [[p.fmt, p.n_out, p.n_in] for p in node.parts]
    return layout


def block_formats_of(model) -> list[str]:
    """The block formats ``model``'s weights use (sorted; [] for a model without block weights)."""
    return sorted({fmt for parts in block_layout(model).values() for fmt, _, _ in parts if fmt in FORMATS})


def describe_blocks(model) -> str | None:
    """'GGUF blocks Q4_1+Q8_0, compiled kernel (avx512)' for a model with block weights ('int4 (Q4_1 blocks),
    ...' when --quantize made them), else None."""
    formats = block_formats_of(model)
    if not formats:
        return None
    origins = {n.origin for _, n in nnx.iter_graph(model) if isinstance(n, BlockPart) and n.fmt in FORMATS}
    names = "+".join(formats)
    quantized = len(origins) == 1 and origins != {"GGUF"}
    label = f"{origins.pop()} ({names} blocks)" if quantized else f"GGUF blocks {names}"
    return f"{label}, {kernel_status()[1]}"
