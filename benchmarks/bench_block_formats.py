"""One matrix-vector product x [1, M] . W^T through the compiled block kernel, per block format, against XLA's
float32 dot over the same W [N, M]: median of interleaved rounds in one process (so a loaded host slows every
format alike). Blocks come from ``gguf.quants.quantize`` where it has a quantizer, else random bytes with small
finite float16 scales (the speed does not depend on the values).

    python benchmarks/bench_block_formats.py [--rows 8192] [--cols 1024] [--rounds 15]
"""

import argparse
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf.quants import quantize

from dantinox.quant.block_formats import BLOCK_FORMATS, FORMATS, row_bytes
from dantinox.quant.block_kernel import kernel_isa, kernel_matmul


def blocks(fmt: str, rows: int, cols: int, rng) -> np.ndarray:
    try:
        return quantize((rng.standard_normal((rows, cols)) * 0.5).astype(np.float32), gguf.GGMLQuantizationType[fmt])
    except (NotImplementedError, gguf.quants.QuantError):
        spec = FORMATS[fmt]
        data = rng.integers(0, 256, (rows, row_bytes(fmt, cols)), dtype=np.uint8)
        view = data.reshape(-1, spec.block_bytes)
        for offset in spec.scale_offsets:
            view[:, offset:offset + 2] = np.full(len(view), 0.001, np.float16).view(np.uint8).reshape(-1, 2)
        return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=1024, help="a multiple of 256")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, args.cols)).astype(np.float32)
    calls = {f: (jax.jit(lambda x, d, f=f: kernel_matmul(x, d, f)), jnp.asarray(blocks(f, args.rows, args.cols, rng)))
             for f in BLOCK_FORMATS}
    calls["float32"] = (jax.jit(lambda x, w: x @ w.T),
                        jnp.asarray(rng.standard_normal((args.rows, args.cols)).astype(np.float32)))
    for fn, d in calls.values():
        fn(x, d).block_until_ready()
    times = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, (fn, d) in calls.items():
            start = time.perf_counter()
            fn(x, d).block_until_ready()
            times[k].append(time.perf_counter() - start)
    base = np.median(times["float32"])
    print(f"kernel {kernel_isa()}, W {args.rows} x {args.cols}, median of {args.rounds} interleaved rounds")
    for k, v in times.items():
        per_weight = FORMATS[k].bytes_per_weight if k in FORMATS else 4.0
        print(f"{k:8s} {per_weight:6.3f} B/weight {np.median(v) * 1e3:8.3f} ms {np.median(v) / base:6.2f}x float32")


if __name__ == "__main__":
    main()
