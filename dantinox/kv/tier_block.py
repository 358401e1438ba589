"""One KV block outside the pool (``TierBlock``) and the layout that says which pools may read it (``TierLayout``).

A block of the paged pool leaves it for the host-memory and disk tiers (``dantinox.kv.tiers``) as its block
fields, one array per field per layer ([rows(P), K, W], or [rows(P), W] for an MLA layer: the pool's arrays
without their block axis, ``LayerSpec.paged_shapes``), and, for the first block of a prefix of an int8 pool,
the float32 sink rows of that prefix ([A, K, W] per sink field: ``dantinox.kv.sink_slots``). Per-channel keys
need no residual ring: only full blocks are stored, and their key groups are complete
(``dantinox.kv.residual_slots``).

A stored block is found by its prefix hash (``dantinox.kv.allocator.hash_block``: it names the block's tokens
and every token before them) under a layout key that names everything else its bytes depend on: the model
(its weights digest, and a draft model's when one shares the pool), the cache dtype and codec, the key group,
the sink tokens, the block size and every array's shape and dtype. Two pools with different layouts never
read each other's blocks (their keys differ), and a file from another layout is refused naming the first
difference (``TierLayout.difference``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..config import ModelConfig
from .sizes import tier_block_bytes
from .spec import layer_specs

FORMAT = 1   # bump when what a block file holds changes


def _pool_arrays(cfg: ModelConfig, block_size: int, rows: tuple[str, ...]) -> tuple:
    """Per layer of ``cfg``'s pool, (shape, dtype str) of one block's (rows "slot" / "group") or one sink
    slot's (rows "sink") arrays, in the pool layer's field order, without the block / slot axis."""
    out = []
    for spec in layer_specs(cfg):
        fields = spec.codec.paged_fields(spec.latent)
        shapes = spec.paged_shapes(1, block_size, 1, 1)
        out.append(tuple((tuple(shape[1:]), np.dtype(dtype).str) for f, (shape, dtype) in zip(fields, shapes)
                         if f.rows in rows))
    return tuple(out)


@dataclass(frozen=True)
class TierLayout:
    """What a stored block's bytes depend on (module docstring). identity: the model digest, draft digest,
    cache dtype, codec, key group, sink tokens and block size, by name; blocks / sinks: per pool layer, the
    (shape, dtype str) of one block's arrays and of one sink slot's (empty tuples without sinks)."""

    identity: tuple
    blocks: tuple
    sinks: tuple
    page_bytes: int = 0    # bytes of a stored block (``sizes.tier_block_bytes``)
    first_bytes: int = 0   # bytes of a stored first block (with its sink rows)

    @property
    def block_size(self) -> int:
        """P, tokens per block."""
        return int(dict(self.identity)["block_size"])

    @property
    def has_sinks(self) -> bool:
        """Whether a prefix's first block carries sink rows (an int8 pool)."""
        return any(self.sinks)

    def as_dict(self) -> dict:
        """The layout as JSON data (block files and sessions record it)."""
        return dict(self.identity, format=FORMAT,
                    blocks=[[[list(s), d] for s, d in layer] for layer in self.blocks],
                    sinks=[[[list(s), d] for s, d in layer] for layer in self.sinks])

    @property
    def key(self) -> str:
        """32 hex digits naming the layout (the disk tier's folder)."""
        text = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def block_bytes(self, first: bool = False) -> int:
        """Bytes of one stored block (a first block of an int8 pool: with its sink rows)."""
        return self.first_bytes if first else self.page_bytes

    def difference(self, other: dict) -> str | None:
        """The first way ``other`` (a recorded ``as_dict``) differs from this layout, in words ("model weights
        digest 1a2b... here, 3c4d... in the file"), or None when they are the same."""
        return first_difference(self.as_dict(), other)


_NAMES = {"model": "model weights digest", "draft_model": "draft model", "cache_dtype": "cache dtype",
          "codec": "cache codec", "key_group": "key group", "sink_tokens": "sink tokens", "block_size": "block size",
          "format": "file format", "kind": "cache kind", "fields": "cache fields", "blocks": "block arrays",
          "sinks": "sink arrays"}


def first_difference(mine: dict, other: dict) -> str | None:
    """The first entry where two layout dicts differ, in words ("cache dtype int8 here, float32 in the file"),
    or None. Array lists are shown cut short."""
    other = other if isinstance(other, dict) else {}
    for name in list(mine) + [k for k in other if k not in mine]:
        if mine.get(name) != other.get(name):
            if isinstance(mine.get(name), list) or isinstance(other.get(name), list):
                return (f"the {_NAMES.get(name, name)} differ (here {_short(mine.get(name))}, in the file "
                        f"{_short(other.get(name))})")
            return f"{_NAMES.get(name, name)} {_show(mine.get(name))} here, {_show(other.get(name))} in the file"
    return None


def _show(value) -> str:
    return "none" if value is None else (value[:97] + "..." if isinstance(value, str) and len(value) > 100 else
                                         str(value))


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tier_layout(cfg: ModelConfig, block_size: int, model_digest: str,
                draft_cfg: ModelConfig | None = None) -> TierLayout:
    """The TierLayout of a pool of ``cfg`` (with a draft model's float layers after it when ``draft_cfg`` is
    given) and blocks of ``block_size`` tokens, for the weights named by ``model_digest`` (the draft model's
    included, when there is one)."""
    spec = layer_specs(cfg)[0]
    identity = (("model", str(model_digest)),
                ("draft_model", None if draft_cfg is None else f"{draft_cfg.num_blocks} layers"),
                ("cache_dtype", cfg.cache_dtype), ("codec", spec.codec.name), ("key_group", spec.group),
                ("sink_tokens", spec.sinks), ("block_size", int(block_size)))
    blocks = _pool_arrays(cfg, block_size, ("slot", "group"))
    sinks = _pool_arrays(cfg, block_size, ("sink",))
    if draft_cfg is not None:
        blocks += _pool_arrays(draft_cfg, block_size, ("slot", "group"))
        sinks += _pool_arrays(draft_cfg, block_size, ("sink",))
    return TierLayout(identity, blocks, sinks, tier_block_bytes(cfg, block_size, False, draft_cfg),
                      tier_block_bytes(cfg, block_size, True, draft_cfg))


class TierBlock(NamedTuple):
    """One block outside the pool. blocks: per pool layer, a tuple of numpy arrays (one block of each block
    field, ``TierLayout.blocks``); sinks: per layer the sink rows (``TierLayout.sinks``) for a prefix's first
    block of an int8 pool, else None."""

    blocks: tuple
    sinks: tuple | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return int(sum(a.nbytes for a in self.arrays()))

    def arrays(self) -> list[np.ndarray]:
        """Every array, block fields first, then the sink rows (the order of a block file)."""
        out = [a for layer in self.blocks for a in layer]
        return out + ([a for layer in self.sinks for a in layer] if self.sinks is not None else [])

    @classmethod
    def from_arrays(cls, layout: TierLayout, arrays: list[np.ndarray]) -> "TierBlock":
        """The block whose ``arrays()`` these are. ValueError when they are not the layout's (count, shape or
        dtype), so a file's arrays are checked before they reach the pool."""
        counts = [len(layer) for layer in layout.blocks]
        sink_counts = [len(layer) for layer in layout.sinks]
        with_sinks = len(arrays) == sum(counts) + sum(sink_counts) and sum(sink_counts) > 0
        if len(arrays) != sum(counts) + (sum(sink_counts) if with_sinks else 0):
            raise ValueError(f"{len(arrays)} arrays, not the {sum(counts)} (or {sum(counts) + sum(sink_counts)} "
                             "with sinks) of this layout")
        expected = [x for layer in layout.blocks for x in layer]
        expected += [x for layer in layout.sinks for x in layer] if with_sinks else []
        for i, (a, (shape, dtype)) in enumerate(zip(arrays, expected)):
            if tuple(a.shape) != tuple(shape) or a.dtype.str != dtype:
                raise ValueError(f"array {i} is {a.dtype.str} {tuple(a.shape)}, not {dtype} {tuple(shape)}")
        it = iter(arrays)
        blocks = tuple(tuple(next(it) for _ in range(n)) for n in counts)
        sinks = tuple(tuple(next(it) for _ in range(n)) for n in sink_counts) if with_sinks else None
        return cls(blocks, sinks)
