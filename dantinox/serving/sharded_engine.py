"""The paged serving engine on a (data, model) mesh: the block pool split over KV heads.

``ShardedPagedEngine`` is the ``PagedEngine`` with three differences, nothing else (the scheduler, the
allocator and the compiled calls are the same):
  1. the model's parameters are sharded over the mesh (``dantinox.parallel.sharding``: heads and MLP width over model);
  2. the pool [N, P, K, D] per layer is split over KV heads on ``model`` where K divides by its size, and
     replicated otherwise (MQA, model > K, and MLA's latent pool [N, P, C]); it is never split over
     blocks, since any row may read any block. With ``kv_memory_bytes`` the budget is per device, so the pool
     holds kv_split times the blocks one device would (``blocks_per_device`` says how much each holds);
  3. every step runs with the mesh in scope (``dantinox.parallel.mesh.mesh_scope``), and the pool keeps its layout
     from call to call (checked by the tests: same tokens as one device, no recompilation).
The ``data`` axis replicates the pool and batches; serving gains nothing from it (use model).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..budget.per_device import kv_split
from ..parallel.mesh import mesh_scope, mesh_shape
from ..parallel.sharding import shard_model
from .engine import EngineConfig, PagedEngine
from ..kv.sizes import residual_slot_bytes
from ..kv.sizes import page_bytes, sink_slot_bytes
from .warmup import WarmupItem


def pool_spec(cfg, mesh) -> P:
    """PartitionSpec of one pool array: [N, P, K, D] -> (None, None, model?, None); MLA [N, P, C] replicated."""
    if cfg.attention == "mla":
        return P(None, None, None)
    return P(None, None, "model" if kv_split(cfg, mesh) > 1 else None, None)


def shard_pool(pool, cfg, mesh):
    """Place a pool (``init_pool``) on ``mesh`` as :func:`pool_spec` says."""
    sharding = NamedSharding(mesh, pool_spec(cfg, mesh))
    return tuple(type(layer)(*(jax.device_put(a, sharding) for a in layer)) for layer in pool)


class ShardedPagedEngine(PagedEngine):
    """PagedEngine over a mesh (see the module docstring). Args: model (sharded here, in place), config
    (kv_memory_bytes, if set, is per device), mesh. Raises MeshError when the model does not divide over the
    mesh, ValueError as PagedEngine and for draft-model speculation (not carried on a mesh)."""

    def __init__(self, model, config: EngineConfig, mesh):
        if config.speculative is not None and config.speculative.proposer == "draft":
            raise ValueError("speculative proposer 'draft' is not allowed on a mesh: the sharded engine does not "
                             "carry a draft model's pool (--mesh with --speculative draft:RUN)")
        self.mesh = mesh
        shard_model(model, mesh)
        with mesh_scope(mesh):
            super().__init__(model, config)

    def _budget_block_bytes(self, cfg) -> int:
        """One device's share of a block: kv_memory_bytes is a per-device budget."""
        return page_bytes(cfg, self.config.block_size) // kv_split(cfg, self.mesh)

    def _budget_sink_bytes(self, cfg) -> int:
        """One device's share of an int8 sink slot (split over model like the keys and values)."""
        return sink_slot_bytes(cfg) // kv_split(cfg, self.mesh)

    def _budget_residual_bytes(self, cfg) -> int:
        """One device's share of a residual slot of per-channel keys (split over model like the keys)."""
        return residual_slot_bytes(cfg) // kv_split(cfg, self.mesh)

    def blocks_per_device(self) -> dict:
        """{"devices", "blocks", "heads_per_device", "bytes_per_device"}: each device holds every block, with
        K / kv_split of its KV heads (the whole latent for MLA)."""
        split = kv_split(self.cfg, self.mesh)
        sizes = mesh_shape(self.mesh)
        shard = sum(a.addressable_shards[0].data.nbytes for layer in self.pool for a in layer)
        return dict(devices=sizes["data"] * sizes["model"], blocks=self.allocator.num_blocks,
                    heads_per_device=None if self.cfg.attention == "mla" else self.cfg.kv_heads // split,
                    bytes_per_device=int(shard))

    def step(self):
        with mesh_scope(self.mesh):
            return super().step()

    def warmup(self):
        with mesh_scope(self.mesh):
            return super().warmup()

    def warmup_items(self):
        """The PagedEngine's items, each run under the mesh (serve runs them one at a time in the background)."""
        def scoped(run):
            def call():
                with mesh_scope(self.mesh):
                    run()
            return call

        return [WarmupItem(item.label, scoped(item.run)) for item in super().warmup_items()]

    def _tables_read_filled(self) -> bool:
        """False: on a mesh the pool is attended by XLA, which reads the table's whole width."""
        return False

    def _place_pool(self, pool):
        """A freshly allocated pool placed on the mesh (``shard_pool``): at start and after a failed step, once."""
        return shard_pool(pool, self.cfg, self.mesh)
