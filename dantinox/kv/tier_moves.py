"""Blocks on their way between the paged pool and the KV tiers, moved before the pool is next written.

The block pool and the allocator decide in plain Python, during scheduling, which block leaves or enters the
pool (``dantinox.kv.tiers``); the device work waits in two lists until the cache manager flushes them, which
it does before any write to the pool (a block move, a slot write, a compiled step:
``CacheManager.flush_moves``):
  reads   blocks whose hash the pool evicted (``BlockPool.on_evict``), whose sinks a reused sink slot drops, or
          that a disk tier writes through (``BlockPool.on_register``): their contents, and a first block's
          sink rows, are still intact until the next write, so they are read out then and stored in the tiers;
  writes  blocks restored from a tier for a prefix hit (``restore``, called by ``BlockAllocator.match_prefix``):
          each took a pool block (held once, its hash registered again, a first block's sinks a slot of their
          own: ``SinkSlots.adopt``) and is written into it.
Reads go first: a block may be read out (its old hash evicted) and then receive a restored block. A block
restored and evicted again before the flush is simply dropped from the writes (a tier still has it). Transfers
run ``width`` blocks per compiled call (``read_blocks`` / ``write_blocks`` at one fixed shape, compiled once).
Letters: N blocks, P tokens per block, W blocks per transfer call.
"""

from __future__ import annotations

import jax
import numpy as np

from .block_moves import read_blocks, read_sinks, write_blocks, write_sinks
from .tier_block import TierBlock
from .tiers import KVTiers

TRANSFER_BLOCKS = 16   # W: blocks per read / write call between the pool and host memory


class TierMoves:
    """The pending reads and writes between one pool and its tiers (module docstring).

    Args: tiers: KVTiers; block_pool: the allocator's BlockPool (its eviction and registration callbacks are
    set here); sinks: the int8 pool's SinkSlots or None; width: W (at most the pool's N).
    """

    def __init__(self, tiers: KVTiers, block_pool, sinks, width: int = TRANSFER_BLOCKS):
        self.tiers, self.block_pool, self.sinks = tiers, block_pool, sinks
        self.width = max(1, min(int(width), block_pool.num_blocks))
        self.reads: dict[int, tuple[bytes, int | None]] = {}               # block -> (hash, sink slot)
        self.writes: dict[int, tuple[bytes, TierBlock, int | None]] = {}   # block -> (hash, block, sink slot)
        block_pool.on_evict = self.evicted
        if tiers.disk is not None:
            block_pool.on_register = self.registered

    # What the bookkeeping reports -------------------------------------------------------------------------
    def _queue_read(self, block: int, block_hash: bytes, first: bool) -> None:
        if block in self.reads or self.tiers.has(block_hash):
            return
        slot = None
        if first and self.tiers.layout.has_sinks:
            slot = None if self.sinks is None else self.sinks.of_block.get(block)
            if slot is None:   # its sinks are gone: a first block without them cannot come back
                return
        self.reads[block] = (block_hash, slot)

    def evicted(self, block: int, block_hash: bytes, first: bool) -> None:
        """``BlockPool.allocate`` took ``block`` and evicted its hash: read it out unless a tier has it."""
        if self.writes.pop(block, None) is not None:
            return   # restored from a tier this pass and not written yet: the tier still has it
        self._queue_read(block, block_hash, first)

    def registered(self, block: int, block_hash: bytes, first: bool) -> None:
        """The prefix cache registered ``block`` (disk tier: write it through)."""
        if block not in self.writes:
            self._queue_read(block, block_hash, first)

    def sinks_dropped(self, block: int) -> None:
        """A reused sink slot drops ``block``'s sinks (``SinkSlots.adopt``): read the block out first, then
        take it out of the prefix cache (it cannot be hit without its sinks)."""
        block_hash = self.block_pool.block_hash[block]
        if block_hash is not None and self.writes.pop(block, None) is None:
            self._queue_read(block, block_hash, block in self.block_pool.first)
        self.block_pool.uncache(block)

    def restore(self, block_hash: bytes, first: bool) -> int | None:
        """A pool block that will hold the tiers' copy of ``block_hash`` (held once, hash registered, written
        at the next flush), or None when no tier has it (or no sink slot is idle for a first block)."""
        found = self.tiers.get(block_hash, first)
        if found is None:
            return None
        stored, tier = found
        block = self.block_pool.allocate()
        slot = None
        if first and stored.sinks is not None and self.sinks is not None:
            slot = self.sinks.adopt(block, keep=set(self.writes))   # never the slot of a block restored now
            if slot is None:
                self.block_pool.release(block)
                return None
        self.writes[block] = (block_hash, stored, slot)
        self.block_pool.register(block, block_hash, first)
        self.tiers.restored[tier] += 1
        return block

    def clear(self) -> None:
        """Forget every pending move (the pool was rebuilt; the tiers keep what they hold)."""
        self.reads.clear()
        self.writes.clear()

    # The device work --------------------------------------------------------------------------------------
    def flush(self, pool):
        """Do the pending reads, then the pending writes; returns the updated pool."""
        if self.reads:
            reads, self.reads = self.reads, {}
            self._read_out(pool, reads)
        if self.writes:
            writes, self.writes = self.writes, {}
            pool = self._write_in(pool, writes)
        return pool

    def _read_out(self, pool, reads: dict) -> None:
        """Read ``reads``' blocks (and first blocks' sink rows) to host memory and store them in the tiers."""
        blocks = list(reads)
        sinks = {slot: jax.device_get(read_sinks(pool, np.int32(slot)))
                 for _, slot in reads.values() if slot is not None}
        for i in range(0, len(blocks), self.width):
            part = blocks[i:i + self.width]
            ids = np.zeros(self.width, np.int32)
            ids[:len(part)] = part
            data = jax.device_get(read_blocks(pool, ids))
            for j, block in enumerate(part):
                block_hash, slot = reads[block]
                arrays = tuple(tuple(np.array(a[j]) for a in layer) for layer in data)
                rows = None if slot is None else tuple(tuple(np.array(a) for a in layer) for layer in sinks[slot])
                self.tiers.put(block_hash, TierBlock(arrays, rows))

    def _write_in(self, pool, writes: dict):
        """Write ``writes``' restored blocks into the pool (and their sink rows into their slots)."""
        blocks, N = list(writes), self.block_pool.num_blocks
        for i in range(0, len(blocks), self.width):
            part = blocks[i:i + self.width]
            ids = np.full(self.width, N, np.int32)
            ids[:len(part)] = part
            first = writes[part[0]][1].blocks
            data = tuple(tuple(_stack([writes[b][1].blocks[layer][f] for b in part], self.width)
                               for f in range(len(first[layer]))) for layer in range(len(first)))
            pool = write_blocks(pool, ids, data)
        for _, stored, slot in writes.values():
            if slot is not None:
                pool = write_sinks(pool, np.int32(slot), stored.sinks)
        return pool

    def warm(self, pool) -> None:
        """Compile the transfer calls at width W without running them."""
        ids = np.zeros(self.width, np.int32)
        read_blocks.lower(pool, ids).compile()
        write_blocks.lower(pool, ids, jax.eval_shape(read_blocks, pool, ids)).compile()


def _stack(arrays: list[np.ndarray], width: int) -> np.ndarray:
    """The arrays stacked on a new first axis and padded with zeros to ``width`` rows."""
    out = np.zeros((width,) + arrays[0].shape, arrays[0].dtype)
    out[:len(arrays)] = arrays
    return out
