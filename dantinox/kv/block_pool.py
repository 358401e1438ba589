"""BlockPool: the bookkeeping of the physical KV blocks, in plain Python (no device, no JAX).

A block is a fixed run of P token slots (P = block_size) in every layer's pool. The pool tracks, for each of
the N blocks (N = num_blocks):
  - a reference count: how many sequences' block tables hold it;
  - an optional content hash: set once the block is full of prompt tokens whose keys and values are final,
    so another request with the same prefix can reuse it (automatic prefix caching).

Free blocks (reference count 0) wait in one queue, least recently freed first. A freed block keeps its hash,
so a later request can still revive it by hash; ``allocate`` takes the block at the head of the queue and
evicts its hash only then. That makes cached prefixes an LRU cache living in otherwise idle memory: a block
is never held back from a request that needs it.

The device arrays live elsewhere (``dantinox.kv.paged``); this class only hands out block ids. With KV tiers
(``dantinox.kv.tiers``) the cache manager listens: ``on_evict`` hears of every hash ``allocate`` evicts (the
block's contents are still intact then, so they can be read out to the host tier before the new holder
writes), ``on_register`` of every hash registered (a disk tier writes it through).
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    """Every block is held by some sequence."""


class BlockPool:
    """Reference-counted KV blocks with a least-recently-freed queue and a hash index of cached blocks.

    Args:
      num_blocks: N, the number of physical blocks (> 0).
    Raises ValueError for num_blocks < 1.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is not allowed: a positive integer")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.first: set[int] = set()   # cached blocks that are a prefix's first block (their sinks go with them)
        self.on_evict = None      # called (block, hash, first) when allocate evicts a cached block's hash
        self.on_register = None   # called (block, hash, first) when a block's hash is registered

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are reclaimed on demand)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a prefix hash (held or free)."""
        return len(self._by_hash)

    def allocate(self) -> int:
        """Take the least recently freed block (evicting its cached hash); its reference count becomes 1.

        Raises NoFreeBlocksError when every block is held.
        """
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self._free.popitem(last=False)
        old, first = self.block_hash[block], block in self.first
        self._forget_hash(block)
        self.ref_counts[block] = 1
        if old is not None and self.on_evict is not None:
            self.on_evict(block, old, first)
        return block

    def hold(self, block: int) -> None:
        """Add one reference to ``block`` (a prefix-cache hit); a free block leaves the free queue."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block joins the tail of the free queue, keeping its hash.

        Raises ValueError if the block is not held (a double free).
        """
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} released while not held (double free)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, or None."""
        return self._by_hash.get(block_hash)

    def register(self, block: int, block_hash: bytes, first: bool = False) -> bool:
        """Record that held ``block`` is full and final with content hash ``block_hash`` (``first``: it is a
        prefix's first block). Returns whether it was registered.

        If another block already carries that hash (two requests computed the same prefix at once), the
        index keeps the first one and this block stays uncached.
        """
        if self.block_hash[block] is not None or block_hash in self._by_hash:
            return False
        self.block_hash[block] = block_hash
        self._by_hash[block_hash] = block
        if first:
            self.first.add(block)
        if self.on_register is not None:
            self.on_register(block, block_hash, first)
        return True

    def uncache(self, block: int) -> None:
        """Remove ``block`` from the hash index (it is about to be written)."""
        self._forget_hash(block)

    def forget_all_hashes(self) -> None:
        """Empty the hash index (the device contents of the blocks are gone, e.g. the pool was rebuilt)."""
        self.block_hash = [None] * self.num_blocks
        self._by_hash.clear()
        self.first.clear()

    def _forget_hash(self, block: int) -> None:
        old = self.block_hash[block]
        self.first.discard(block)
        if old is not None:
            self.block_hash[block] = None
            if self._by_hash.get(old) == block:
                del self._by_hash[old]
