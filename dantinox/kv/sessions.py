"""Sessions: one sequence's KV cache with its tokens in a file, saved and restored later (another process too).

Two forms, one file format (``dantinox.kv.block_file``: a JSON header with the layout and the tokens, the
arrays, a checksum), each refusing a file written under another model or cache layout with one line that
names the file and the first difference (``tier_block.first_difference``):
  - a server's ("session-blocks"): the full KV blocks of a token sequence's prefix as the paged pool holds
    them (``TierBlock``s under a ``TierLayout``: block size, codec, a prefix's sink rows with its first block;
    per-channel keys need no residual, full blocks only). ``export_prefix`` collects them from the pool and
    the KV tiers, ``import_prefix`` puts them back into the pool's prefix cache under the chained hashes of
    the tokens, where the next request with that prefix finds them (the tokens past the last full block are
    computed again: fewer than one block);
  - a Generator's ("session-static"): the static cache of one sequence cut to its length (every field's rows:
    per-token rows to n slots, per-channel key groups to ceil(n / G), the int8 sinks and the residual ring
    whole; ``static_session_arrays``), loaded into a fresh static cache (``load_static_session``). A
    sliding-window layer whose static cache is a ring (``dantinox.kv.ring``: R slots, position p in slot p mod R)
    keeps min(n, R) rows, the whole ring once the sequence has wrapped it, so the loaded cache at slot n is
    the one the sequence left; the ring's size is part of the layout.
In the paged pool (server sessions, the KV tiers) window layers are full-length, as every pool layer is.
"""

from __future__ import annotations

import jax
import numpy as np

from ..config import ModelConfig
from .block_file import DamagedRecord, read_record, write_record
from .block_moves import read_sinks, write_sinks
from .cache import init_cache
from .spec import layer_specs
from .tier_block import TierBlock, TierLayout, first_difference

BLOCKS, STATIC = "session-blocks", "session-static"
_KIND_NAMES = {BLOCKS: "a server session (paged KV blocks; POST /sessions/restore reads it)",
               STATIC: "a Generator session (a static cache; Generator.load_session reads it)"}


class SessionError(ValueError):
    """A session file that cannot be used here: damaged, of the other form, or from another model or layout.
    The message starts with the file's path."""


def _read(path: str, kind: str) -> tuple[dict, list[np.ndarray]]:
    """(header, arrays) of a session file of ``kind``; SessionError naming it otherwise (FileNotFoundError /
    OSError from the file system pass through)."""
    try:
        header, arrays = read_record(path)
    except DamagedRecord as err:
        raise SessionError(f"{err}: not a whole session file") from None
    found = header.get("kind")
    if found != kind:
        what = _KIND_NAMES.get(found, f"not a session file (kind {found!r})")
        raise SessionError(f"{path} is {what}, not {_KIND_NAMES[kind].split(' (')[0]}")
    return header, arrays


def _check_layout(path: str, mine: dict, header: dict) -> None:
    difference = first_difference(mine, header.get("layout"))
    if difference is not None:
        raise SessionError(f"{path} was saved under another model or cache layout: {difference}")


def _tokens(path: str, header: dict) -> list[int]:
    tokens = header.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise SessionError(f"{path}: its tokens are not a list of token ids")
    return tokens


# A server's sessions: prefix blocks ---------------------------------------------------------------------------
def save_block_session(path: str, layout: TierLayout, tokens: list[int], blocks: list[TierBlock]) -> int:
    """Write ``tokens`` and the KV ``blocks`` of their first len(blocks) full blocks to ``path`` (atomically).
    Returns the bytes written; OSError from the file system."""
    header = dict(kind=BLOCKS, layout=layout.as_dict(), tokens=[int(t) for t in tokens], blocks=len(blocks),
                  first_sinks=bool(blocks) and blocks[0].sinks is not None)
    arrays = [a for block in blocks for a in block.arrays()]
    return write_record(path, header, arrays)


def load_block_session(path: str, layout: TierLayout) -> tuple[list[int], list[TierBlock]]:
    """(tokens, blocks) of a server session file. Raises SessionError naming the file (damaged, a Generator
    session, another model or layout: the first difference named), OSError from the file system."""
    header, arrays = _read(path, BLOCKS)
    _check_layout(path, layout.as_dict(), header)
    tokens, count = _tokens(path, header), header.get("blocks")
    per_block = sum(len(layer) for layer in layout.blocks)
    per_sinks = sum(len(layer) for layer in layout.sinks) if header.get("first_sinks") else 0
    if not isinstance(count, int) or count * layout.block_size > len(tokens) or \
            len(arrays) != count * per_block + per_sinks:
        raise SessionError(f"{path}: its arrays do not match its {count!r} blocks")
    blocks, at = [], 0
    for i in range(count):
        n = per_block + (per_sinks if i == 0 else 0)
        try:
            blocks.append(TierBlock.from_arrays(layout, arrays[at:at + n]))
        except ValueError as err:
            raise SessionError(f"{path}: block {i}: {err}") from None
        at += n
    return tokens, blocks


def export_prefix(manager, tokens: list[int]) -> list[TierBlock]:
    """The KV blocks of ``tokens``' leading full blocks as the prefix cache holds them (the pool first, then
    the KV tiers), up to the first block it does not hold; a prefix's first block carries its sink rows in an
    int8 pool. ``manager``: a CacheManager."""
    manager.flush_moves()   # blocks restored from a tier this step are written before they are read
    alloc, layout_sinks = manager.allocator, manager.sinks is not None
    found = []
    for i, block_hash in enumerate(alloc.prompt_hashes(tokens)):
        block = alloc.pool.lookup(block_hash)
        if block is not None:
            slot = manager.sinks.of_block.get(block) if layout_sinks and i == 0 else None
            if layout_sinks and i == 0 and slot is None:
                break
            found.append(("pool", block, slot))
            continue
        stored = manager.tiers.get(block_hash, i == 0) if manager.tiers is not None else None
        if stored is None:
            break
        found.append(("tier", stored[0], None))
    pool_blocks = [b for where, b, _ in found if where == "pool"]
    contents = iter(_per_block(manager.read_host(pool_blocks))) if pool_blocks else iter(())
    out = []
    for where, item, slot in found:
        if where == "tier":
            out.append(item)
            continue
        rows = None if slot is None else _host(read_sinks(manager.pool, np.int32(slot)))
        out.append(TierBlock(next(contents), rows))
    return out


def import_prefix(manager, tokens: list[int], blocks: list[TierBlock]) -> int:
    """Put ``blocks`` (the KV of ``tokens``' leading full blocks) into the pool's prefix cache under the chained
    hashes of ``tokens``: free, cached blocks the next request with that prefix hits. Blocks already cached are
    kept; it stops where the pool has no free block left. Returns the prompt tokens now cached (a multiple of
    the block size)."""
    alloc = manager.allocator
    pool, P = alloc.pool, alloc.block_size
    hashes = alloc.prompt_hashes(tokens)[:len(blocks)]
    held, new = [], []   # every block of the prefix, held while this runs; those that take a fresh block
    for i, (block_hash, stored) in enumerate(zip(hashes, blocks)):
        block = pool.lookup(block_hash)
        if block is not None:
            pool.hold(block)
        elif pool.num_free and not (i == 0 and manager.sinks is not None and stored.sinks is None):
            block = pool.allocate()
            new.append((i, block, block_hash, stored))
        else:
            break
        held.append(block)
    slot = None
    if new and new[0][0] == 0 and manager.sinks is not None:
        slot = manager.sinks.adopt(new[0][1])
        if slot is None:   # every sink slot is held: the prefix cannot start here now
            new, held = [], _release(pool, held)
    if new:
        manager.write_host([b for _, b, _, _ in new], _stacked([s for _, _, _, s in new]))
        if slot is not None:
            manager.pool = write_sinks(manager.pool, np.int32(slot), new[0][3].sinks)
        for i, block, block_hash, _ in new:
            pool.register(block, block_hash, first=i == 0)
    _release(pool, held)
    return len(held) * P


def _release(pool, blocks: list) -> list:
    """Release ``blocks``, last first (a prefix's tail is reclaimed before its head); returns []."""
    for block in reversed(blocks):
        pool.release(block)
    return []


def _per_block(data: tuple) -> list[tuple]:
    """``read_host``'s per-layer arrays [n, ...] as n per-block tuples of per-layer tuples of arrays."""
    n = len(data[0][0]) if data and data[0] else 0
    return [tuple(tuple(np.array(a[j]) for a in layer) for layer in data) for j in range(n)]


def _stacked(blocks: list[TierBlock]) -> tuple:
    """``write_host``'s data: per layer, per field, the blocks' arrays stacked [n, ...]."""
    first = blocks[0].blocks
    return tuple(tuple(np.stack([b.blocks[layer][f] for b in blocks]) for f in range(len(first[layer])))
                 for layer in range(len(first)))


def _host(tree) -> tuple:
    return tuple(tuple(np.array(a) for a in layer) for layer in jax.device_get(tree))


# A Generator's sessions: the static cache --------------------------------------------------------------------
def static_layout(cfg: ModelConfig, model_digest: str) -> dict:
    """What a static session's arrays depend on: the model digest, the cache dtype and codec, the key group,
    the sink tokens and every layer's fields (name, rows, dtype, shape with the rows axis as -1)."""
    specs = layer_specs(cfg)
    fields = []
    for spec in specs:
        shapes = spec.static_shapes(1, 1)
        fields.append([[f.name, f.rows, np.dtype(dtype).str, list(shape[:-2]) + [-1, shape[-1]], spec.ring]
                       for f, (shape, dtype) in zip(spec.codec.static_fields(spec.latent), shapes)])
    return dict(kind="static", model=str(model_digest), cache_dtype=cfg.cache_dtype, codec=specs[0].codec.name,
                key_group=specs[0].group, sink_tokens=specs[0].sinks, fields=fields)


def _rows(spec, rows: str, n: int, full: int) -> int:
    """Rows a session keeps of a field of ``rows`` kind for n tokens (``full``: the field's rows in the cache: a
    ring's R slots are all kept once n passes them)."""
    return {"slot": min(n, full), "group": min(-(-n // spec.group), full)}.get(rows, full)


def static_session_arrays(cfg: ModelConfig, cache, n: int) -> list[np.ndarray]:
    """The arrays of a one-row static ``cache`` cut to its first n slots, layer by layer in field order."""
    out = []
    for spec, layer in zip(layer_specs(cfg), cache):
        for field, array in zip(spec.codec.static_fields(spec.latent), layer):
            keep = _rows(spec, field.rows, n, array.shape[-2])
            out.append(np.asarray(jax.device_get(array[..., :keep, :])))
    return out


def save_static_session(path: str, cfg: ModelConfig, model_digest: str, tokens: list[int], cache) -> int:
    """Write a Generator session: ``tokens`` (the sequence whose keys and values the one-row static ``cache``
    holds in its first len(tokens) slots) and the cache cut to them. Returns bytes written; OSError."""
    header = dict(kind=STATIC, layout=static_layout(cfg, model_digest), tokens=[int(t) for t in tokens])
    return write_record(path, header, static_session_arrays(cfg, cache, len(tokens)))


def load_static_session(path: str, cfg: ModelConfig, model_digest: str) -> tuple[list[int], tuple]:
    """(tokens, a one-row static cache of ``cfg`` holding them in its first slots) from a Generator session.
    Raises SessionError naming the file (damaged, a server session, another model or layout, longer than
    max_context), OSError from the file system."""
    header, arrays = _read(path, STATIC)
    _check_layout(path, static_layout(cfg, model_digest), header)
    tokens = _tokens(path, header)
    if len(tokens) > cfg.max_context:
        raise SessionError(f"{path} holds {len(tokens)} tokens, more than this model's max_context="
                           f"{cfg.max_context}")
    cache, it = init_cache(cfg, 1), iter(arrays)
    layers = []
    for spec, layer in zip(layer_specs(cfg), cache):
        new = []
        for field, array in zip(spec.codec.static_fields(spec.latent), layer):
            saved = next(it, None)
            keep = _rows(spec, field.rows, len(tokens), array.shape[-2])
            if saved is None or saved.shape != array.shape[:-2] + (keep, array.shape[-1]):
                raise SessionError(f"{path}: field {field.name} is not the {keep} rows its tokens need")
            new.append(array.at[..., :keep, :].set(saved))
        layers.append(type(layer)(*new))
    return tokens, tuple(layers)
