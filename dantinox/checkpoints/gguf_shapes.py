"""A GGUF file's metadata checked against its tensors before any tensor is read: the layer count and the
shape of every tensor the mapping knows, each mismatch named by the metadata key at fault.

A tensor's shape comes from its description in the file (numpy order [rows, cols]: the reverse of ggml's
shape), so nothing is dequantized for the check. ``expected`` gives, per GGUF tensor name without its
``blk.N.`` prefix, one (size, key) pair per dimension: the size the metadata implies and the unprefixed key it
comes from (``attention.head_count`` for the rows of ``attn_q``). A key of None means the size follows from
another tensor (the vocabulary: the embedding's rows).
"""

from __future__ import annotations

import re

from .errors import GGUFError
from .gguf_metadata import Metadata

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
Expected = dict[str, tuple[tuple[int, str | None], ...]]


def tensor_shape(tensor) -> tuple[int, ...]:
    """The numpy shape of a ``gguf.ReaderTensor`` from its description (ggml's shape reversed)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def check_block_count(m: Metadata, names) -> int:
    """``{arch}.block_count`` L, checked against the blocks the tensor names hold (blk.0 .. blk.L-1 exactly).
    Raises GGUFError naming the key and the blocks found."""
    count = m.int("block_count")
    found = sorted({int(match.group(1)) for match in map(BLOCK.match, names) if match})
    if found != list(range(count)):
        held = f"blocks {found[0]}..{found[-1]} ({len(found)} distinct)" if found else "no blk.N tensors"
        raise GGUFError(f"{m.path}: {m.key('block_count')}={count} disagrees with the file's tensors, which hold "
                        f"{held}")
    return count


def check_shapes(m: Metadata, tensors: dict, expected: Expected) -> None:
    """Every tensor of ``tensors`` (name -> gguf.ReaderTensor) whose name (less ``blk.N.``) ``expected`` lists
    has the shape listed. Raises GGUFError naming the first key at fault, its value, the tensor and the shapes
    (expected and found), e.g. ``qwen2.attention.head_count=8 disagrees with tensor blk.0.attn_q.weight of
    shape [64, 64] (the metadata implies [128, 64])``."""
    for name, tensor in tensors.items():
        match = BLOCK.match(name)
        want = expected.get(match.group(2) if match else name)
        if want is None:
            continue
        shape = tensor_shape(tensor)
        sizes = tuple(size for size, _ in want)
        if shape == sizes:
            continue
        if len(shape) != len(sizes):
            raise GGUFError(f"{m.path}: tensor {name} has shape {list(shape)}; the metadata implies "
                            f"{list(sizes)}")
        key = next(k for (size, k), got in zip(want, shape) if size != got)
        where = f"{m.key(key)}={m.get(key)!r}" if key else "the embedding's vocabulary rows"
        raise GGUFError(f"{m.path}: {where} disagrees with tensor {name} of shape {list(shape)} (the metadata "
                        f"implies {list(sizes)})")
