"""Device meshes: ``make_mesh(data=D, model=M)``, the ``--mesh data=D,model=M`` flag, and the mesh in scope.

dantinox runs one program over a ``jax.sharding.Mesh`` with two named axes (GSPMD partitions it and inserts
the collectives; Xu et al. 2021, "GSPMD", arXiv 2105.04663):

  data   the batch (rows of a generation batch, sequences of a training batch) is split over it;
  model  attention heads, the MLP hidden width and the vocabulary are split over it (tensor parallelism,
         Shoeybi et al. 2019, "Megatron-LM", section 3), and so are the static cache's KV heads where
         kv_heads is divisible by its size (see ``dantinox.parallel.sharding``).

Both axes are ``AxisType.Auto``: shardings are given for parameters and caches, and XLA propagates them
through the rest of the program. Inside a compiled function the mesh is read from the ambient mesh
(``jax.set_mesh``), which :func:`mesh_scope` enters; the mesh is part of JAX's compile-cache key, so the same
function traced with and without a mesh compiles separately and never mixes the two.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

AXES = ("data", "model")


class MeshError(ValueError):
    """A mesh that cannot be built or cannot shard the model (the message names the flag or field)."""


def parse_mesh(text: str, flag: str = "--mesh") -> dict[str, int]:
    """Parse ``"data=D,model=M"`` (either axis may be omitted, default 1) into {"data": D, "model": M}.

    Raises MeshError naming ``flag``, the text and what is allowed: an axis other than data/model, a repeated
    axis, or a size that is not an integer >= 1.
    """
    sizes = {axis: 1 for axis in AXES}
    seen = set()
    for part in str(text).split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in AXES or name in seen:
            what = f"axis {name!r}" if eq else f"{part.strip()!r}"
            raise MeshError(f"{flag} {text!r}: {what} is not allowed; write data=D,model=M with the axes "
                            f"{' and '.join(AXES)} (each at most once)")
        if not value.strip().isdigit() or int(value) < 1:
            raise MeshError(f"{flag} {text!r}: {name}={value!r} is not allowed: an integer >= 1")
        seen.add(name)
        sizes[name] = int(value)
    return sizes


FORCE_CPU_DEVICES = "XLA_FLAGS=--xla_force_host_platform_device_count"


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model of ``devices`` (default: every device of every
    process, ``jax.devices()``).

    A mesh smaller than the device count uses the first data * model devices and leaves the others idle (as
    vLLM's ``tensor_parallel_size`` does); over several processes (``jax.distributed``) it must span every
    device, since every process takes part in each step. Devices are laid out so that the ``model`` axis
    spans neighbouring devices (on one host where possible: its collectives run every layer, ``data``'s only
    once per training step). Raises MeshError naming the mesh, its product and the device count (with how to
    force CPU devices) when the mesh needs more devices than there are, or a size below 1.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("data", data), ("model", model)):
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh {name}={size!r} is not allowed: an integer >= 1")
    needed = int(data) * int(model)
    if needed > len(devices):
        raise MeshError(f"mesh data={data} x model={model} = {needed} devices, but {len(devices)} device(s) are "
                        f"available ({devices[0].platform}); use a smaller mesh, or on a CPU host force more "
                        f"devices before JAX starts: {FORCE_CPU_DEVICES}={needed}")
    processes = {getattr(d, "process_index", 0) for d in devices}
    if needed < len(devices) and len(processes) > 1:
        raise MeshError(f"mesh data={data} x model={model} = {needed} devices, but the {len(processes)} "
                        f"processes hold {len(devices)} devices: over several processes the mesh must span "
                        f"every device")
    grid = np.array(devices[:needed], dtype=object).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_from_flag(text: str | None, flag: str = "--mesh") -> Mesh | None:
    """The mesh a ``--mesh data=D,model=M`` flag asks for, or None when the flag is absent.
    Raises MeshError as :func:`parse_mesh` and :func:`make_mesh` (with the flag named)."""
    if text is None:
        return None
    sizes = parse_mesh(text, flag)
    try:
        return make_mesh(**sizes)
    except MeshError as err:
        raise _with_flag(err, flag, text) from None


def mesh_shape(mesh: Mesh | None) -> dict[str, int]:
    """{"data": D, "model": M} of a mesh (1 and 1 for None: one device)."""
    if mesh is None:
        return {axis: 1 for axis in AXES}
    return {axis: int(mesh.shape.get(axis, 1)) for axis in AXES}


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of a pytree are placed on (the first NamedSharding found), or None."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and not isinstance(leaf, jax.core.Tracer):
            return sharding.mesh
    return None


def mesh_scope(mesh: Mesh | None):
    """Context manager that makes ``mesh`` the ambient mesh (``jax.set_mesh``); a no-op for None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def ambient_mesh_shape() -> dict[str, int] | None:
    """{"data": D, "model": M} of the mesh in scope while tracing (see :func:`mesh_scope`), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return None
    return {axis: int(mesh.shape[axis]) for axis in AXES}


@contextlib.contextmanager
def naming_flag(text: str | None, flag: str = "--mesh"):
    """Re-raise a MeshError from the block (e.g. heads not divisible) with ``flag`` and its value in front."""
    try:
        yield
    except MeshError as err:
        raise _with_flag(err, flag, text) from None


def _with_flag(err: MeshError, flag: str, text: str | None) -> MeshError:
    """``err`` with ``flag`` and its value in front, once (an error that already names them is kept as is)."""
    prefix = f"{flag} {text!r}: "
    message = str(err)
    return MeshError(message if message.startswith(prefix) else prefix + message)
