"""KV tiers under the pool: prefix-cache blocks that leave the pool go to host memory, then disk, and come back.

The paged pool's prefix cache (``dantinox.kv.block_pool``) keeps a finished prompt's full blocks only until
their blocks are taken for other work. With tiers (``TierConfig``; ``dantinox serve --kv-host-memory``,
``--kv-disk-dir``, ``--kv-disk-bytes``):
  1. a block whose hash the pool evicts is read to the host-memory tier (``dantinox.kv.host_tier``) first;
  2. with a disk tier (``dantinox.kv.disk_tier``) every block the prefix cache registers is also written to
     disk (write-through, in a background thread), so a restarted server finds the prefixes it had;
  3. a lookup the pool misses (``BlockAllocator.match_prefix``) asks the host tier, then the disk tier; a hit
     takes a pool block, is written into it before the step runs and is registered under its hash again
     (a hit from disk also enters the host tier). Each tier drops its least recently used blocks at its bound.
Keys are the prefix cache's chained block hashes under the layout key (``dantinox.kv.tier_block``): the model
digest, cache dtype and codec, block size and every array's shape, so a block is never found under another
model or layout. An int8 pool's prefix keeps its float32 sink rows with its first block; per-channel keys need
no residual (full blocks only).

Where time goes: the block reads and writes between the pool and host memory are synchronous, on the engine
thread, just before the step that needs them (``dantinox.kv.tier_moves``), and so are disk reads (at the
lookup); only disk writes overlap compute (their own thread). The scheduler does not count a hit's restore
time in the step's token budget: a restored block costs a copy of its bytes (host) or a file read (disk),
far below recomputing its tokens. The copies into the pool fall inside the step's measured time, which the
token budget (``serving/token_budget.py``) reads; disk reads happen during scheduling, before it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import jax
import numpy as np

from .disk_tier import DiskTier
from .host_tier import HostTier
from .tier_block import TierBlock, TierLayout

DEFAULT_DISK_BYTES = 10 * 2**30   # --kv-disk-bytes when --kv-disk-dir is given alone


@dataclass(frozen=True)
class TierConfig:
    """The tiers of one engine. host_bytes: bytes of the host-memory tier (None or 0: none); disk_dir: the
    disk tier's directory (None: none); disk_bytes: its bound in bytes (None: DEFAULT_DISK_BYTES);
    model_digest: names the model's weights (a run directory's weights sha256, plus whatever else changes
    them, e.g. weight quantization); None: the engine hashes its parameters."""

    host_bytes: int | None = None
    disk_dir: str | None = None
    disk_bytes: int | None = None
    model_digest: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes) or self.disk_dir is not None


def with_model_digest(config: TierConfig | None, params) -> TierConfig | None:
    """``config`` with its model_digest set: as given, or when None the SHA-256 of ``params``' arrays (every
    leaf's dtype, shape and bytes, in tree order), so an engine built from a model object still never reads
    another model's blocks. None stays None."""
    if config is None or not config.enabled or config.model_digest is not None:
        return config
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        a = np.asarray(jax.device_get(leaf))
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return dataclasses.replace(config, model_digest="params-" + digest.hexdigest())


class KVTiers:
    """The host and disk tiers of one pool layout, asked nearest first (module docstring).

    Args: config: TierConfig; layout: the pool's TierLayout. Raises ValueError naming kv_host_bytes /
    kv_disk_bytes for a tier that holds not one block, kv_disk_dir for a directory that cannot be written.
    """

    def __init__(self, config: TierConfig, layout: TierLayout):
        self.layout = layout
        self.host = HostTier(int(config.host_bytes), layout.block_bytes(first=True)) if config.host_bytes else None
        self.disk = None
        if config.disk_dir is not None:
            bound = DEFAULT_DISK_BYTES if config.disk_bytes is None else config.disk_bytes
            self.disk = DiskTier(str(config.disk_dir), bound, layout)
        self.restored = {"host": 0, "disk": 0}   # blocks written back into the pool, by the tier they came from

    @property
    def tiers(self) -> list:
        return [t for t in (self.host, self.disk) if t is not None]

    def has(self, block_hash: bytes) -> bool:
        """Whether a tier holds (or, on disk, is writing) the block."""
        return any(t.has(block_hash) for t in self.tiers)

    def get(self, block_hash: bytes, first: bool) -> tuple[TierBlock, str] | None:
        """(the block stored under ``block_hash``, the tier's name) from the nearest tier that has it, or None.
        first: the block is a prefix's first block, so in a pool with sinks it must carry its sink rows (one
        without is a miss). A block found on disk enters the host tier."""
        for tier in self.tiers:
            block = tier.get(block_hash)
            if block is None or (first and self.layout.has_sinks and block.sinks is None):
                continue
            if tier is self.disk and self.host is not None:
                self.host.put(block_hash, block)
            return block, tier.name
        return None

    def put(self, block_hash: bytes, block: TierBlock) -> None:
        """Store a block read out of the pool in every tier (the disk's copy is written in the background)."""
        for tier in self.tiers:
            tier.put(block_hash, block)

    def flush(self) -> None:
        """Wait for the disk tier's queued writes."""
        if self.disk is not None:
            self.disk.flush()

    def stats(self) -> dict:
        """{tier name: its counters and bytes} plus each tier's blocks restored into the pool ("promotions")."""
        return {t.name: dict(t.stats(), promotions=self.restored[t.name]) for t in self.tiers}
