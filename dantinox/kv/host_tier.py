"""The host-memory tier: prefix-cache blocks evicted from the pool, kept in host memory up to a byte bound.

Plain Python over numpy arrays (``dantinox.kv.tier_block.TierBlock``), keyed by the prefix hash. Least recently
used first out: a lookup or a store moves a block to the back; a store that passes the bound drops blocks
from the front (with a disk tier they are on disk already: ``dantinox.kv.tiers`` writes through). After
vLLM's CPU offloading of prefix blocks and llama.cpp's ``--cache-ram`` host prompt cache.
"""

from __future__ import annotations

from collections import OrderedDict

from .tier_block import TierBlock


class HostTier:
    """An LRU of TierBlocks bounded by ``capacity`` bytes.

    Args: capacity: bytes (int); block_bytes: the bytes of the largest block (a first block with its sinks).
    Raises ValueError naming kv_host_bytes when the capacity holds not one block.
    Counters: hits, stores, evictions; ``bytes`` the bytes held.
    """

    name = "host"

    def __init__(self, capacity: int, block_bytes: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < block_bytes:
            raise ValueError(f"kv_host_bytes={capacity!r} holds no block: one block takes {block_bytes} bytes "
                             f"({block_bytes / 2**20:.2f} MiB) for this model and block size; give at least that")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, TierBlock] = OrderedDict()
        self.bytes = 0
        self.hits = self.stores = self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: bytes) -> TierBlock | None:
        """The block stored under ``block_hash`` (now the most recently used), or None."""
        block = self._blocks.get(block_hash)
        if block is not None:
            self._blocks.move_to_end(block_hash)
            self.hits += 1
        return block

    def put(self, block_hash: bytes, block: TierBlock) -> None:
        """Store ``block`` (a block already held moves to the back), then drop least recently used blocks
        until the bytes fit the capacity."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        self._blocks[block_hash] = block
        self.bytes += block.nbytes
        self.stores += 1
        while self.bytes > self.capacity:
            _, dropped = self._blocks.popitem(last=False)
            self.bytes -= dropped.nbytes
            self.evictions += 1

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return dict(blocks=len(self._blocks), bytes=self.bytes, capacity_bytes=self.capacity, hits=self.hits,
                    stores=self.stores, evictions=self.evictions)
