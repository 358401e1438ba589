"""Print the per-device memory table of docs/how-to/multi-device.md (pure arithmetic: dantinox.budget.per_device).

    python benchmarks/mesh_memory_table.py [--device-memory 16GiB] [--devices 1 2 4 8]

For the reference shape (GQA, 12 blocks, dim 256) and SmolLM2-135M's shape (30 blocks, dim 576, 9 heads,
3 KV heads of 64, SwiGLU 1536, vocab 49152, tied embeddings, context 2048), on every (data, model) split of
each device count: float32 weights per device, one max_context sequence's float32 cache per device, and the
largest batch on the whole mesh at --device-memory per device with a 10% reserve.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dantinox as dx  # noqa: E402
from dantinox.budget.memory import parse_memory_size  # noqa: E402
from dantinox.budget.per_device import mesh_shapes_for, plan_mesh  # noqa: E402
from dantinox.parallel.mesh import MeshError  # noqa: E402

SHAPES = {
    "reference (GQA 8/2 heads, S=512)": dx.ModelConfig.from_preset("reference"),
    "SmolLM2-135M shape (9/3 heads, S=2048)": dx.ModelConfig(
        attention="gqa", kv_heads=3, dim=576, n_heads=9, head_size=64, num_blocks=30, vocab_size=49152,
        max_context=2048, mlp_hidden=1536, tie_embeddings=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-memory", default="16GiB")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    device_bytes = parse_memory_size(args.device_memory)
    mib = 2 ** 20
    print(f"| model | devices | mesh | weights MiB/device | KV MiB per sequence/device | max batch "
          f"(whole mesh, {args.device_memory}/device) | cache layout |")
    print("|---|---|---|---|---|---|---|")
    for name, cfg in SHAPES.items():
        for n in args.devices:
            for sizes in mesh_shapes_for(n):
                mesh = f"data={sizes['data']},model={sizes['model']}"
                try:
                    p = plan_mesh(cfg, sizes, device_bytes)
                except MeshError as err:
                    print(f"| {name} | {n} | {mesh} | - | - | - | cannot shard: {str(err).split(':')[0]} |")
                    continue
                print(f"| {name} | {n} | {mesh} | {p.weights_bytes / mib:.2f} | {p.kv_bytes_per_sequence / mib:.2f}"
                      f" | {p.max_batch} | {p.cache_layout} |")


if __name__ == "__main__":
    main()
