"""ResidualSlots: which residual slot of a per-channel key pool each running sequence reads and writes (plain
Python).

With per-channel int8 keys (KIVI, ``dantinox.kv.channel_paged``) the keys of a sequence's group still
filling (fewer than G tokens) stay in float32, in a residual slot of the pool ([Q, 2 G, K, D] per layer: a ring
that also keeps the group before, for speculative rollbacks), until the group completes and is quantized into
its block. Unlike the sink slots (``dantinox.kv.sink_slots``) a
residual is never shared: only full blocks enter the prefix cache, and all their groups are complete, so a
prefix hit starts with an empty residual (a hit on a whole prompt resumes at a group boundary,
``ContextPolicy.resume_align``), and n > 1 choices take their prompt blocks from the prefix cache. So a slot
belongs to one running sequence: taken when it is scheduled (admission, resumption), released when it
finishes or is preempted (a swapped-out sequence takes its residual to host memory with its blocks and gets
a fresh slot when swapped back in; a recomputed one recomputes it). Q = max_running slots suffice.
"""

from __future__ import annotations


class ResidualSlots:
    """A free list of Q residual slots keyed by sequence id. Raises ValueError for num_slots < 1."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} is not allowed: a positive integer")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))   # pop() takes the lowest
        self.of_seq: dict[str, int] = {}

    def slot(self, seq_id: str) -> int | None:
        """The slot ``seq_id`` holds, or None."""
        return self.of_seq.get(seq_id)

    def take(self, seq_id: str) -> int:
        """Give ``seq_id`` a free slot. Raises ValueError if it holds one, RuntimeError if none is free (more
        running sequences than slots: the pool was built for a smaller max_running)."""
        if seq_id in self.of_seq:
            raise ValueError(f"sequence {seq_id!r} already holds residual slot {self.of_seq[seq_id]}")
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} residual slots are held")
        self.of_seq[seq_id] = slot = self._free.pop()
        return slot

    def release(self, seq_id: str) -> None:
        """``seq_id`` no longer holds its slot (finished, preempted). Unknown ids do nothing."""
        slot = self.of_seq.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
