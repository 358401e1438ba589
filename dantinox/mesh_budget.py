"""``dantinox budget --mesh data=D,model=M``: memory per device and the largest batch on a mesh.

Printed after the single-device tables, one row per attention variant: weights per device (replication
counted), the reserve, one sequence's cache per device at each context and the largest batch on the whole
mesh (``dantinox.device_memory.plan_mesh``), plus how the cache is laid out (split over KV heads, or
replicated over model). A variant the mesh cannot shard (n_heads not divisible by model) says so in its row.
"""

from __future__ import annotations

from .config import ModelConfig
from .device_memory import plan_mesh
from .mesh import MeshError, parse_mesh

MIB = 2 ** 20


def mesh_sizes_from_flag(text: str | None) -> dict[str, int] | None:
    """{"data": D, "model": M} from ``--mesh`` (no devices needed: budget plans for any mesh), or None."""
    return None if text is None else parse_mesh(text, "--mesh")


def mesh_rows(rows: list[tuple[str, ModelConfig]], sizes: dict[str, int], device_bytes: int,
              contexts: list[int], reserve: float, dtype: str) -> list[list[str]]:
    """Table rows: attention, weights MiB/device, reserve MiB, then per context 'KV MiB/seq -> max batch',
    then the cache layout."""
    table = []
    for label, cfg in rows:
        try:
            plans = [plan_mesh(cfg, sizes, device_bytes, c, reserve, dtype) for c in contexts]
        except MeshError as err:
            table.append([label, "-", "-"] + ["-" for _ in contexts] + [f"cannot shard: {err}"])
            continue
        first = plans[0]
        cells = [f"{p.kv_bytes_per_sequence / MIB:.4g} -> {p.max_batch}" for p in plans]
        table.append([label, f"{first.weights_bytes / MIB:.4g}", f"{first.reserve_bytes / MIB:.4g}"] + cells
                     + [first.cache_layout])
    return table


def print_mesh_budget(rows, sizes: dict[str, int], device_bytes: int, contexts: list[int], reserve: float,
                      dtype: str, print_table) -> None:
    """Print the per-device table for mesh ``sizes`` (see the module docstring)."""
    heads = [f"{c} tok: KV MiB/seq -> batch" for c in contexts]
    print_table(["attention", "weights MiB/dev", "reserve MiB"] + heads + ["cache layout"],
                mesh_rows(rows, sizes, device_bytes, contexts, reserve, dtype),
                title=f"Per device on mesh data={sizes['data']},model={sizes['model']} "
                      f"({sizes['data'] * sizes['model']} devices of {device_bytes} B each; batch = whole mesh)")
