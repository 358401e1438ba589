"""Training on a (data, model) mesh: data parallelism, tensor parallelism and FSDP, all by sharding.

How a step runs on the mesh (``dantinox.parallel.mesh``, ``dantinox.parallel.sharding``):
  1. The parameters are placed with the same layout as for generation (heads and MLP width over ``model``);
     with ``fsdp`` the ``embed`` dimension of every matrix is split over ``data`` too. The AdamW moments are
     made by ``optax`` with ``zeros_like`` of the parameters, so they take the same layout: with fsdp each
     device holds 1 / (data x model) of most parameters and of the optimizer state (ZeRO stage 3,
     Rajbhandari et al. 2020, section 5).
  2. Each [B, T+1] batch is split by rows over ``data`` (B must divide by its size).
  3. The loss is the mean over the whole (global) batch, so the gradient XLA computes is already the mean
     over every data shard: the all-reduce (or reduce-scatter, with fsdp) that data parallelism needs is
     inserted by GSPMD from the shardings, not written by hand.
  4. The new parameters and optimizer state are pinned to the layout of step 1 (:func:`constrain_state`),
     so every step sees the same input shardings and the update compiles once.
Checkpoints stay the single-host safetensors file of ``dantinox.train.checkpoint``: arrays are gathered to
full size on the host when written and placed on the current mesh when read (:func:`place_like`), so a run
saved on one mesh shape resumes on any other (or on one device). Orbax would write shards in parallel, which
pays off when one host cannot hold the state; the models this project trains fit a host many times over.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..parallel.mesh import MeshError, ambient_mesh_shape, mesh_shape
from ..parallel.sharding import param_spec


def _names(path) -> tuple:
    """Attribute, key and index names of a pytree path (e.g. ('blocks', 0, 'attn', 'qkv', 'kernel'))."""
    out = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                out.append(getattr(entry, attr))
                break
    return tuple(n for n in out if n != "value")


def state_spec(path, shape, sizes: dict[str, int], fsdp: bool) -> P:
    """PartitionSpec of a parameter or optimizer-state leaf from its path: the parameter rules
    (``dantinox.parallel.sharding.param_spec``) match the path's tail, so AdamW's mu and nu follow their parameter;
    scalars (the step count) are replicated."""
    return param_spec(_names(path), tuple(shape), sizes, fsdp) if len(shape) else P()


def constrain_state(tree, fsdp: bool):
    """Inside the compiled step: pin every leaf of ``tree`` (parameters or optimizer state) to
    :func:`state_spec` on the ambient mesh; a no-op without one."""
    sizes = ambient_mesh_shape()
    if sizes is None:
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.lax.with_sharding_constraint(x, state_spec(path, x.shape, sizes, fsdp)), tree)


def place_state(tree, mesh, fsdp: bool):
    """Put every leaf of ``tree`` on ``mesh`` with :func:`state_spec` (None: unchanged)."""
    if mesh is None:
        return tree
    sizes = mesh_shape(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, state_spec(path, np.shape(x), sizes, fsdp))),
        tree)


def place_like(tree, template):
    """``tree``'s arrays with the shardings of ``template``'s (same structure): how a checkpoint read on the
    host lands on the mesh of the running session."""
    return jax.tree_util.tree_map(lambda x, ref: jax.device_put(x, ref.sharding), tree, template)


def check_batch(batch_size: int, mesh) -> None:
    """Raise MeshError unless batch_size divides by the mesh's data axis (rows are split over it)."""
    D = mesh_shape(mesh)["data"]
    if batch_size % D:
        raise MeshError(f"batch_size={batch_size} is not divisible by mesh axis data={D}: data parallelism "
                        f"splits the batch's rows over 'data'")


def place_batch(windows: np.ndarray, mesh):
    """A [B, T+1] host batch as a device array split by rows over ``data`` (replicated over ``model``)."""
    if mesh is None:
        return jax.numpy.asarray(windows)
    return jax.device_put(windows, NamedSharding(mesh, P("data", *([None] * (np.ndim(windows) - 1)))))
