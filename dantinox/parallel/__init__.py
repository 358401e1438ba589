"""Several devices and processes on JAX's SPMD machinery (docs/how-to/multi-device.md).

  mesh.py          make_mesh(data=D, model=M), the ``--mesh`` text, the mesh in scope
  sharding.py      how every parameter and cache array is laid out on the mesh
  distributed.py   one mesh over several processes (``jax.distributed``), and arrays back to the host
"""

from .distributed import DistributedError, to_host
from .mesh import MeshError, make_mesh, mesh_from_flag, mesh_shape, parse_mesh
from .sharding import check_model_fits, shard_cache, shard_model

__all__ = ["DistributedError", "MeshError", "check_model_fits", "make_mesh", "mesh_from_flag", "mesh_shape",
           "parse_mesh", "shard_cache", "shard_model", "to_host"]
