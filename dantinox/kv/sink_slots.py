"""SinkSlots: which per-sequence sink slot of an int8 pool each running sequence reads and writes (plain Python).

An int8 paged pool keeps the float32 rows of every sequence's first A tokens (its attention sinks,
``dantinox.kv.sinks``) in R sink slots of their own, [R, A, ...] per layer
(``dantinox.kv.paged``), not in its blocks. A <= P, so the sinks are a function of a sequence's first
block's contents; sequences that share that block (a prefix-cache hit, copy-on-write copies of it) share the
slot, and a slot outlives its sequences while the first block stays in the prefix cache, so a later hit finds
its sinks. R = 2 x max_running (``slots_for``): the running sequences hold at most max_running, the rest keep
the sinks of cached prefixes. When a fresh slot is needed and none is free, the least recently released one
is taken and the first block it served leaves the prefix cache (its sinks are gone, so no later request may
hit it; a hit always starts at the first block, so its whole chain is unreachable).

The invariant: a block that is some cached prefix's first block, or that a sequence holds as its first block,
maps to a slot that holds its first A tokens' full rows (or will, once that sequence computes them).
"""

from __future__ import annotations

from collections import OrderedDict

SPARE_PER_RUNNING = 1  # sink slots kept for cached prefixes, per running sequence


def slots_for(max_running: int) -> int:
    """R, the sink slots of an engine that runs at most ``max_running`` sequences at once."""
    return int(max_running) * (1 + SPARE_PER_RUNNING)


class SinkSlots:
    """Reference-counted sink slots keyed by first block.

    Args: num_slots: R (> 0); uncache: called with a block id whose sinks are dropped (it must leave the
    prefix cache). Raises ValueError for num_slots < 1.
    """

    def __init__(self, num_slots: int, uncache):
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} is not allowed: a positive integer")
        self.num_slots, self._uncache = num_slots, uncache
        self.refs = [0] * num_slots
        self.blocks: list[set[int]] = [set() for _ in range(num_slots)]   # first blocks each slot serves
        self.of_block: dict[int, int] = {}
        self.of_seq: dict[str, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # refs == 0

    def slot(self, seq_id: str) -> int | None:
        """The slot ``seq_id`` holds, or None."""
        return self.of_seq.get(seq_id)

    def share(self, seq_id: str, first_block: int) -> int:
        """``seq_id`` holds ``first_block`` with its first tokens already computed (a prefix-cache hit): it
        reads that block's slot. Raises LookupError if the block has none (the invariant is broken)."""
        if first_block not in self.of_block:
            raise LookupError(f"first block {first_block} of {seq_id!r} has no sink slot: its sinks are lost")
        return self._hold(seq_id, self.of_block[first_block])

    def fresh(self, seq_id: str, first_block: int) -> int:
        """``seq_id`` will compute its first tokens into ``first_block``: take an idle slot (the least recently
        released; the first blocks it served leave the prefix cache) and map the block to it. RuntimeError
        when every slot is held (more running sequences than the pool was built for)."""
        slot = self.adopt(first_block)
        if slot is None:
            raise RuntimeError(f"all {self.num_slots} sink slots are held")
        return self._hold(seq_id, slot)

    def adopt(self, first_block: int, keep=frozenset()) -> int | None:
        """An idle slot for ``first_block``'s sinks with no sequence holding it yet (a first block restored
        from a KV tier, ``dantinox.kv.tiers``, whose sink rows are written into it before the step runs): the
        least recently released idle slot that serves none of the blocks in ``keep`` (the first blocks it served
        leave the prefix cache), mapped to the block and left idle at the back of the queue, so a hit then
        shares it. None when no slot qualifies."""
        slot = next((s for s in self._idle if not self.blocks[s] & keep), None)
        if slot is None:
            return None
        del self._idle[slot]
        for block in self.blocks[slot]:
            self._uncache(block)
            del self.of_block[block]
        self.blocks[slot] = set()
        self._idle[slot] = None  # the back of the queue; _hold takes it out again
        self.map_block(first_block, slot)
        return slot

    def map_block(self, block: int, slot: int) -> None:
        """``block`` (a copy of a first block, or a fresh one) now stands for the sinks in ``slot``."""
        old = self.of_block.get(block)
        if old is not None:
            self.blocks[old].discard(block)
        self.of_block[block] = slot
        self.blocks[slot].add(block)

    def copied(self, src: int, dst: int) -> None:
        """Copy-on-write of block src into dst: if src is a first block, dst shares its sinks."""
        if src in self.of_block:
            self.map_block(dst, self.of_block[src])

    def release(self, seq_id: str) -> None:
        """``seq_id`` no longer reads its slot (finished, preempted); at no holder the slot keeps its sinks
        for the prefix cache until it is needed (least recently released first). Unknown ids do nothing."""
        slot = self.of_seq.pop(seq_id, None)
        if slot is None:
            return
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._idle[slot] = None

    def reset(self) -> None:
        """Forget every mapping (the pool was rebuilt); held slots stay held by their sequences."""
        self.of_block.clear()
        self.blocks = [set() for _ in range(self.num_slots)]

    def _hold(self, seq_id: str, slot: int) -> int:
        if seq_id in self.of_seq:
            raise ValueError(f"sequence {seq_id!r} already holds sink slot {self.of_seq[seq_id]}")
        if self.refs[slot] == 0:
            del self._idle[slot]
        self.refs[slot] += 1
        self.of_seq[seq_id] = slot
        return slot
