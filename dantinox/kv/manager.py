"""The cache manager: the paged pool and everything that decides where a sequence's keys and values live.

After vLLM's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``) and the blocks it hands the scheduler,
and JetStream's split of storage from its manager. ``CacheManager`` owns
  - the pool on the device (``dantinox.kv.pool.init_pool``, one layer per decoder block; with a draft model the
    draft's float layers after the target's, under the same block tables);
  - the block allocator and its prefix cache (``dantinox.kv.allocator``: block tables, reference counts,
    copy-on-write) — the scheduler sees blocks through it and nothing else;
  - the int8 pool's per-sequence sink slots (``dantinox.kv.sink_slots``) and the per-channel key pool's
    residual slots (``dantinox.kv.residual_slots``);
  - the moves between them (``dantinox.kv.block_moves``): swap to host memory and back, copy-on-write copies;
  - with KV tiers (``tiers``: ``dantinox.kv.tiers``), the host-memory and disk tiers under the prefix cache and
    the moves between them and the pool (``dantinox.kv.tier_moves``), flushed before every write to the pool.
The engine asks it for one ``BlockTables`` argument per compiled call (``tables``), tells it what the scheduler
decided before a step (``apply``) and which sequences ended (``release``). Host-side bookkeeping is plain
Python; the device work is the block moves' compiled functions. Letters: N blocks, P tokens per block, M
block-table entries, R sink slots, Q residual slots.
"""

from __future__ import annotations

import jax
import numpy as np

from ..config import ModelConfig
from .allocator import BlockAllocator
from .block_moves import (copy_blocks, copy_sinks, read_blocks, read_residual, read_sinks, write_blocks,
                          write_residual, write_sinks)
from .paged import BlockTables
from .pool import init_pool
from .residual_slots import ResidualSlots
from .sink_slots import SinkSlots
from .sizes import pool_bytes, sink_slot_bytes
from .tier_block import tier_layout
from .tier_moves import TierMoves
from .tiers import KVTiers, TierConfig


class CacheManager:
    """The paged pool of one engine and its bookkeeping (module docstring).

    Args: cfg: the model's config; num_blocks: N; block_size: P; sink_slots: R (int8 pools; 1 otherwise);
    residual_slots: Q (per-channel keys; 1 otherwise); enable_prefix_caching; max_copies: copy-on-write copies
    per compiled call (the engine's max_running); draft_cfg: a draft model's config whose float layers share
    the blocks, or None; place: a function placing a freshly allocated pool on its devices (the sharded
    engine's; None: as allocated); tiers: a TierConfig with its model_digest set (``with_model_digest``;
    naming the draft model's weights too when there is one), or None. Raises ValueError naming the pool's
    bytes when the host cannot allocate it, and KVTiers' errors for tiers that cannot be opened.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, sink_slots: int = 1,
                 residual_slots: int = 1, enable_prefix_caching: bool = True, max_copies: int = 1,
                 draft_cfg: ModelConfig | None = None, place=None, tiers: TierConfig | None = None):
        self.cfg, self.draft_cfg, self.block_size = cfg, draft_cfg, block_size
        self.num_sink_slots, self.num_residual_slots, self.max_copies = sink_slots, residual_slots, max_copies
        self.table_width = -(-cfg.max_context // block_size)   # M of a full-context sequence
        self._place = place or (lambda pool: pool)
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.sinks = SinkSlots(sink_slots, self._drop_sinks) if sink_slot_bytes(cfg) else None
        self.residuals = ResidualSlots(residual_slots) if cfg.channel_keys else None
        self.tiers = self.moves = None
        if tiers is not None and tiers.enabled and enable_prefix_caching:
            layout = tier_layout(cfg, block_size, tiers.model_digest, draft_cfg)
            self.tiers = KVTiers(tiers, layout)
            self.moves = TierMoves(self.tiers, self.allocator.pool, self.sinks)
            self.allocator.lower = self.moves
        self.pool = self._new_pool()

    def _drop_sinks(self, block: int) -> None:
        """A reused sink slot drops ``block``'s sinks: it leaves the prefix cache (read out to the tiers
        first, when there are tiers)."""
        if self.moves is not None:
            self.moves.sinks_dropped(block)
        else:
            self.allocator.pool.uncache(block)

    def flush_moves(self) -> None:
        """Do the KV tiers' pending reads and writes (``TierMoves.flush``): called before anything writes the pool
        (and before a session reads it)."""
        if self.moves is not None:
            self.pool = self.moves.flush(self.pool)

    # The pool ----------------------------------------------------------------------------------------------
    def _new_pool(self):
        """A zero pool of the manager's blocks and slots, placed; ValueError when the host cannot hold it."""
        N, P = self.allocator.num_blocks, self.block_size
        try:
            pool = init_pool(self.cfg, N, P, self.num_sink_slots, self.num_residual_slots)
            if self.draft_cfg is not None:
                pool += init_pool(self.draft_cfg, N, P)
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            nbytes = pool_bytes(self.cfg, N, P, self.num_sink_slots, self.num_residual_slots)
            raise ValueError(f"the KV pool of {N} blocks ({nbytes / 2**20:.0f} MiB, "
                             f"{nbytes // self.cfg.num_blocks / 2**20:.0f} MiB per layer) could not be allocated "
                             f"on this host ({str(err).splitlines()[0][:120]}): lower kv_memory_bytes or "
                             f"max_running (serve: --kv-memory, --max-running)") from None
        return self._place(pool)

    def reset(self) -> None:
        """After a failed device step: a fresh zero pool (allocated and placed once), an empty prefix cache (its
        blocks pointed into the old pool) and no sink mappings. The caller ends the sequences that held blocks."""
        self.pool = None   # let the old buffers go before the new ones are allocated
        self.pool = self._new_pool()
        self.allocator.pool.forget_all_hashes()
        if self.moves is not None:
            self.moves.clear()
        if self.sinks is not None:
            self.sinks.reset()

    # One call's rows --------------------------------------------------------------------------------------
    def tables(self, seq_ids: list[str], B: int, M: int) -> BlockTables:
        """The BlockTables of a compiled call for the sequences ``seq_ids`` padded to B rows, block tables cut
        to M entries: padding rows get zeros, sink slot R and residual slot Q (written nowhere). The tiers'
        pending moves are done first (the call that follows writes the pool)."""
        self.flush_moves()
        table = np.zeros((B, M), np.int32)
        sink_slot = np.full(B, self.num_sink_slots if self.sinks is not None else 1, np.int32)
        residual = None if self.residuals is None else np.full(B, self.residuals.num_slots, np.int32)
        for b, seq_id in enumerate(seq_ids):
            blocks = self.allocator.table(seq_id)[:M]
            table[b, :len(blocks)] = blocks
            slot = None if self.sinks is None else self.sinks.slot(seq_id)
            if slot is not None:
                sink_slot[b] = slot
            if residual is not None:
                residual[b] = self.residuals.slot(seq_id)
        return BlockTables(table, sink_slot, residual)

    # What the scheduler decided ---------------------------------------------------------------------------
    def apply(self, sched, running) -> None:
        """Carry out a Schedule's block work before its step runs: swap-outs read to host memory (the request's
        ``swap_data``), preempted sequences' slots released, sink and residual slots given to every running
        sequence that lacks one (``running``: the scheduler's running requests), swap-ins written back and
        copy-on-write copies made."""
        self.flush_moves()
        for req, blocks in sched.swap_out:
            seq = req.request_id
            req.swap_data = self.read_host(blocks), self._read_sinks(seq), self._read_residual(seq)
        for req in sched.preempted:
            self.release(req.request_id)
        if self.sinks is not None:  # copies of first blocks first: a hit may read its sinks through the copy
            for src, dst in sched.copies:
                self.sinks.copied(src, dst)
        self._assign_sinks(running, skip={req.request_id for req, _ in sched.swap_in})
        self._assign_residuals(running)
        self.flush_moves()   # reads of blocks whose sink slots were just reused, before anything writes
        for req, blocks in sched.swap_in:
            self._swap_in(req, blocks)
        self.copy_blocks(sched.copies)

    def _swap_in(self, req, blocks: list[int]) -> None:
        """Write a swapped-out request's host copy back into ``blocks`` (its residual and sinks into slots of
        their own) and drop the host copy."""
        data, sinks, residual = req.swap_data
        self.write_host(blocks, data)   # flushes the tiers' moves first
        if residual is not None:   # the filling key group comes back in the slot just taken
            self.pool = write_residual(self.pool, np.int32(self.residuals.slot(req.request_id)), residual)
        if self.sinks is not None:   # the sinks come back in a slot of their own, mapped to the new block
            slot = self.sinks.fresh(req.request_id, blocks[0])
            self.pool = write_sinks(self.pool, np.int32(slot), sinks)
        req.swap_data = None

    def release(self, seq_id: str) -> None:
        """``seq_id`` no longer reads its sink and residual slots (finished or preempted). With KV tiers the
        pending moves are done now too, so a finished request's blocks reach the tiers (and the disk) even
        when no step follows."""
        if self.sinks is not None:
            self.sinks.release(seq_id)
        if self.residuals is not None:
            self.residuals.release(seq_id)
        if self.moves is not None:
            self.flush_moves()

    def _assign_residuals(self, running) -> None:
        """Give every running request without a residual slot one (per-channel keys only)."""
        if self.residuals is None:
            return
        for req in running:
            if self.residuals.slot(req.request_id) is None:
                self.residuals.take(req.request_id)

    def _assign_sinks(self, running, skip=frozenset()) -> None:
        """Give every running request without a sink slot (but those in ``skip``: swapped in, their sinks come
        from host memory) one: the slot of its first block when its first tokens are computed (a prefix-cache
        hit), else a fresh one. Hits go first, so a fresh slot never takes the sinks a hit of the same step is
        about to read."""
        if self.sinks is None:
            return
        waiting = [r for r in running if r.request_id not in skip
                   and self.sinks.slot(r.request_id) is None and self.allocator.table(r.request_id)]
        for req in sorted(waiting, key=lambda r: r.num_computed == 0):
            first = self.allocator.table(req.request_id)[0]
            if req.num_computed > 0:
                self.sinks.share(req.request_id, first)
            else:
                self.sinks.fresh(req.request_id, first)

    # Moves ------------------------------------------------------------------------------------------------
    def copy_blocks(self, pairs: list) -> int:
        """Copy-on-write copies [(source, destination)], max_copies per compiled call; a copy of a first block
        stands for the same sinks. Returns the compiled calls made."""
        C, calls = self.max_copies, 0
        self.flush_moves()
        for i in range(0, len(pairs), C):
            self.pool = copy_blocks(self.pool, *self._pad_copies(pairs[i:i + C]))
            calls += 1
        if self.sinks is not None:
            for src, dst in pairs:
                self.sinks.copied(src, dst)
        return calls

    def _pad_copies(self, pairs: list) -> tuple[np.ndarray, np.ndarray]:
        src = np.zeros(self.max_copies, np.int32)
        dst = np.full(self.max_copies, self.allocator.num_blocks, np.int32)  # N: dropped
        for i, (s, d) in enumerate(pairs):
            src[i], dst[i] = s, d
        return src, dst

    def read_host(self, blocks: list) -> tuple:
        """The contents of ``blocks`` in host memory: per layer a tuple of numpy arrays [len(blocks), P, ...]."""
        ids = np.zeros(self.table_width, np.int32)
        ids[:len(blocks)] = blocks
        data = jax.device_get(read_blocks(self.pool, ids))
        n = len(blocks)
        return tuple(tuple(a[:n].copy() for a in layer) for layer in data)

    def write_host(self, blocks: list, data: tuple) -> None:
        """Write ``data`` (``read_host``'s) into ``blocks``."""
        M = self.table_width
        self.flush_moves()
        ids = np.full(M, self.allocator.num_blocks, np.int32)
        ids[:len(blocks)] = blocks

        def pad(a):
            return np.concatenate([a, np.zeros((M - len(a),) + a.shape[1:], a.dtype)])

        self.pool = write_blocks(self.pool, ids, tuple(tuple(pad(a) for a in layer) for layer in data))

    def _read_sinks(self, seq_id: str):
        """The host copy of ``seq_id``'s sink rows (None without int8 sinks)."""
        slot = None if self.sinks is None else self.sinks.slot(seq_id)
        return None if slot is None else jax.device_get(read_sinks(self.pool, np.int32(slot)))

    def _read_residual(self, seq_id: str):
        """The host copy of ``seq_id``'s residual keys (None without per-channel keys)."""
        slot = None if self.residuals is None else self.residuals.slot(seq_id)
        return None if slot is None else jax.device_get(read_residual(self.pool, np.int32(slot)))

    def warm_block_moves(self) -> None:
        """Compile every block move (copy-on-write, swap out and in, sink and residual slots) without running."""
        src, dst = self._pad_copies([])
        copy_blocks.lower(self.pool, src, dst).compile()
        ids = np.zeros(self.table_width, np.int32)
        read_blocks.lower(self.pool, ids).compile()
        write_blocks.lower(self.pool, ids, jax.eval_shape(read_blocks, self.pool, ids)).compile()
        if self.sinks is not None:
            last = np.int32(self.sinks.num_slots - 1)
            copy_sinks.lower(self.pool, last, last).compile()
            read_sinks.lower(self.pool, last).compile()
            write_sinks.lower(self.pool, last, jax.eval_shape(read_sinks, self.pool, last)).compile()
        if self.residuals is not None:
            last = np.int32(self.residuals.num_slots - 1)
            read_residual.lower(self.pool, last).compile()
            write_residual.lower(self.pool, last, jax.eval_shape(read_residual, self.pool, last)).compile()
        if self.moves is not None:
            self.moves.warm(self.pool)

    def tier_stats(self) -> dict:
        """{tier: counters and bytes} of the KV tiers (``KVTiers.stats``); {} without tiers."""
        return {} if self.tiers is None else self.tiers.stats()
