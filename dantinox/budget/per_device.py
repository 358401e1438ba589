"""Memory per device on a (data, model) mesh: weights, KV cache and reserve, replication counted.

Each figure follows the layout of ``dantinox.parallel.sharding`` exactly (tests check it against the bytes of
``jax.Array.addressable_shards``):

  weights per device   sum over parameters of  bytes / (product of the mesh axes that split it)
                       (a replicated parameter counts whole on every device; with fsdp the embed
                       dimension is split over data too)
  KV per sequence      bytes_per_token x S / Mk, Mk = model where the cache splits over KV heads
                       (kv_heads divisible by model), else 1 (MQA, model > kv_heads, MLA: replicated)
  rows per device      a batch of B rows puts ceil(B / data) rows on each device

so the largest batch on the mesh is data x floor(kv_budget_per_device / KV per sequence per device), where
kv_budget_per_device = device_bytes - reserve - weights per device. Plans are pure arithmetic on the
config and the mesh sizes: they need no devices (plan for 8 accelerators on a laptop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..kv.sizes import cache_bytes
from ..model.transformer import abstract_transformer
from ..parallel.mesh import mesh_shape
from ..parallel.sharding import cache_layout, cache_specs, check_model_fits, param_spec


def _sizes(mesh) -> dict[str, int]:
    return dict(mesh) if isinstance(mesh, dict) else mesh_shape(mesh)


def _split(spec, sizes: dict[str, int]) -> int:
    return math.prod(sizes[a] for a in spec if a is not None)


def weights_bytes_per_device(cfg: ModelConfig, mesh, fsdp: bool = False) -> int:
    """Bytes of parameters each device holds on ``mesh`` (a Mesh or {"data": D, "model": M}; None = 1 device).

    The Transformer is built abstractly (``abstract_transformer``: nothing allocated). Raises MeshError when n_heads or
    mlp_hidden does not divide by the model axis.
    """
    sizes = _sizes(mesh)
    check_model_fits(cfg, sizes)
    abstract = abstract_transformer(cfg)
    total = 0
    for path, node in nnx.iter_graph(abstract):
        if isinstance(node, nnx.Param):
            x = node.get_value()
            nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
            total += nbytes // _split(param_spec(path, x.shape, sizes, fsdp), sizes)
    return int(total)


def kv_split(cfg: ModelConfig, mesh) -> int:
    """How many ways the cache of one sequence is split over ``model`` (1 when it is replicated)."""
    sizes = _sizes(mesh)
    spec = cache_specs(cfg, sizes["data"], sizes)[0]
    return sizes["model"] if "model" in spec else 1


def kv_bytes_per_sequence_per_device(cfg: ModelConfig, mesh, seq_len: int | None = None,
                                     dtype: str | None = None) -> int:
    """Cache bytes one sequence of seq_len tokens (default max_context) puts on each device that holds it: its
    whole cache (``dantinox.kv.sizes.cache_bytes``) / kv_split (scales, sinks and rings split over model like
    the keys and values)."""
    seq_len = cfg.max_context if seq_len is None else int(seq_len)
    return cache_bytes(cfg, 1, seq_len, dtype) // kv_split(cfg, mesh)


@dataclass(frozen=True)
class DevicePlan:
    """One mesh's memory per device (bytes) and the largest batch of seq_len-token sequences (tokens)."""

    data: int
    model: int
    device_bytes: int
    weights_bytes: int          # parameters per device (replication counted)
    reserve_bytes: int          # ceil(reserve_fraction x device_bytes)
    kv_budget_bytes: int        # device - reserve - weights (may be negative: the weights do not fit)
    kv_bytes_per_sequence: int  # cache of one sequence on each device that holds it
    max_batch: int              # data x floor(kv_budget / kv_bytes_per_sequence), 0 if nothing fits
    cache_layout: str           # how the cache is laid out (sharding.cache_layout)


def plan_mesh(cfg: ModelConfig, mesh, device_bytes: int, seq_len: int | None = None,
              reserve_fraction: float = 0.1, dtype: str | None = None, fsdp: bool = False) -> DevicePlan:
    """Memory per device and the largest batch on ``mesh`` (a Mesh or {"data": D, "model": M}).

    device_bytes: memory of ONE device. Raises MeshError when the model does not divide over the mesh,
    ValueError for reserve_fraction outside [0, 1) or device_bytes < 1.
    """
    if not isinstance(reserve_fraction, (int, float)) or not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction={reserve_fraction!r} is not allowed: a number in [0, 1)")
    if not isinstance(device_bytes, (int, np.integer)) or device_bytes < 1:
        raise ValueError(f"device_bytes={device_bytes!r} is not allowed: a positive integer")
    sizes = _sizes(mesh)
    weights = weights_bytes_per_device(cfg, sizes, fsdp)
    reserve = math.ceil(round(device_bytes * reserve_fraction, 6))
    budget = int(device_bytes) - reserve - weights
    per_seq = kv_bytes_per_sequence_per_device(cfg, sizes, seq_len, dtype)
    fits = max(budget, 0) // per_seq
    return DevicePlan(sizes["data"], sizes["model"], int(device_bytes), weights, reserve, budget, per_seq,
                      int(fits * sizes["data"]), cache_layout(cfg, sizes))


def mesh_shapes_for(devices: int) -> list[dict[str, int]]:
    """Every (data, model) split of a device count, model = 1 first: e.g. 4 -> (4,1), (2,2), (1,4)."""
    return [{"data": devices // m, "model": m} for m in range(1, devices + 1) if devices % m == 0]
