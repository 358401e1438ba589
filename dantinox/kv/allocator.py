"""BlockAllocator: block tables per sequence over a BlockPool, with prefix caching and copy-on-write.

Plain Python, testable without a device. Letters: P block size (tokens per block), N blocks in the pool.

A sequence's block table lists the physical blocks that hold its tokens: token t lives in block
``table[t // P]`` at offset ``t % P``. The allocator never touches the device; it only decides which blocks
to use and which block contents the engine must copy (copy-on-write).

Prefix caching. The hash of full prompt block i is ``H(hash of block i-1, tokens of block i)`` (a chain, so a
block's hash names its whole prefix). When a new sequence arrives, ``match_prefix`` walks its full prompt
blocks and holds every leading block already cached under the same hash: those tokens need no prefill.
After a chunk is computed, ``commit`` registers the sequence's newly completed full prompt blocks.

Tiers below the pool. With ``lower`` set (the cache manager, when KV tiers are on: ``dantinox.kv.tiers``), a
block hash the pool misses is asked of it: ``lower.restore(hash, first)`` returns a block taken from this
pool (held once, its hash registered) that the manager fills from host memory or disk before the step runs,
or None; the walk goes on from there, so a prefix can come back part from the pool, part from the tiers.

Copy-on-write. A cached block may be held by several sequences. Before a chunk writes positions
[start, end), ``grow`` checks the blocks that range touches: a block held by others is replaced in this
sequence's table by a fresh block and the pair (source, destination) is returned so the engine copies the
contents first; a cached block held by this sequence alone just leaves the hash index. (With whole-block
prefix hits this happens when a prompt is entirely cached: its last token is recomputed for its logits and
its key/value land in the last shared block.)
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from .block_pool import BlockPool


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Content hash of one full block chained to its parent block's hash (None for the first block)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if parent is not None else b"dantinox-root")
    digest.update(np.asarray(tokens, np.int64).tobytes())
    return digest.digest()


class BlockAllocator:
    """Per-sequence block tables over a reference-counted pool.

    Args:
      num_blocks: N physical blocks.  block_size: P tokens per block.
      enable_prefix_caching: share identical full prompt blocks between sequences.
    Counters: prefix_queries / prefix_hits (blocks looked up / found, in the pool or a tier below it),
    tier_hits (of those, found in a tier), cow_copies. ``lower``: the tiers below the pool (module docstring).
    Raises ValueError for a non-positive num_blocks or block_size.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is not allowed: a positive integer")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.tier_hits = 0
        self.cow_copies = 0
        self.lower = None

    # Queries --------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / P)."""
        return -(-int(num_tokens) // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        """The block table of ``seq_id`` (empty if it holds nothing)."""
        return self.tables.get(seq_id, [])

    def prompt_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """Chained hashes of the full blocks of ``prompt`` (len(prompt) // P of them)."""
        hashes, parent = [], None
        P = self.block_size
        for i in range(len(prompt) // P):
            parent = hash_block(parent, prompt[i * P:(i + 1) * P])
            hashes.append(parent)
        return hashes

    # Allocation -----------------------------------------------------------------------------------
    def match_prefix(self, seq_id: str, prompt: Sequence[int]) -> int:
        """Start ``seq_id``'s table with the cached blocks matching the leading full blocks of ``prompt``.

        Returns the number of prompt tokens already cached (a multiple of P; 0 with prefix caching off).
        Raises ValueError if ``seq_id`` already holds blocks.
        """
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id!r} already holds blocks {self.tables[seq_id]}")
        table = self.tables.setdefault(seq_id, [])
        if not self.enable_prefix_caching:
            return 0
        for i, block_hash in enumerate(self.prompt_hashes(prompt)):
            self.prefix_queries += 1
            block = self.pool.lookup(block_hash)
            if block is not None:
                self.pool.hold(block)
            elif self.lower is not None and self.pool.num_free:
                block = self.lower.restore(block_hash, i == 0)   # held once, hash registered
                self.tier_hits += block is not None
            if block is None:
                break
            table.append(block)
            self.prefix_hits += 1
        return len(table) * self.block_size

    def grow(self, seq_id: str, start: int, end: int) -> list[tuple[int, int]] | None:
        """Make positions [start, end) of ``seq_id`` writable: append blocks up to ceil(end / P) and replace
        shared blocks in that range by private copies. All or nothing.

        Returns the (source, destination) block copies the engine must perform before writing, or None
        (and changes nothing) when the pool has too few free blocks.
        """
        table = self.tables.setdefault(seq_id, [])
        P = self.block_size
        shared = [i for i in range(start // P, min(self.blocks_for(end), len(table)))
                  if self.pool.ref_counts[table[i]] > 1]
        needed = max(self.blocks_for(end) - len(table), 0) + len(shared)
        if needed > self.pool.num_free:
            return None
        copies = []
        for i in shared:
            fresh = self.pool.allocate()
            copies.append((table[i], fresh))
            self.pool.release(table[i])
            table[i] = fresh
        for i in range(start // P, min(self.blocks_for(end), len(table))):
            self.pool.uncache(table[i])  # held by this sequence alone now; its contents will change
        while len(table) < self.blocks_for(end):
            table.append(self.pool.allocate())
        self.cow_copies += len(copies)
        return copies

    def allocate_blocks(self, seq_id: str, count: int) -> list[int] | None:
        """Give ``seq_id`` (holding nothing) ``count`` fresh blocks, e.g. to swap its contents back in.

        Returns the new table, or None (and changes nothing) when fewer than ``count`` blocks are free.
        """
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id!r} already holds blocks {self.tables[seq_id]}")
        if count > self.pool.num_free:
            return None
        self.tables[seq_id] = [self.pool.allocate() for _ in range(count)]
        return self.tables[seq_id]

    def commit(self, seq_id: str, prompt: Sequence[int], num_computed: int) -> None:
        """Register the full prompt blocks of ``seq_id`` whose tokens are all computed (< num_computed)."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq_id, [])
        full = min(num_computed, len(prompt)) // self.block_size
        for i, block_hash in enumerate(self.prompt_hashes(prompt[:full * self.block_size])):
            if i < len(table):
                self.pool.register(table[i], block_hash, first=i == 0)

    def free(self, seq_id: str) -> None:
        """Release every block of ``seq_id``, last block first (so a prefix's tail is reclaimed before its
        head), and forget its table. Freeing an unknown sequence does nothing."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self.pool.release(block)
