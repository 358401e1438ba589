"""Decode attention with and without the compiled kernel (dantinox.kv.decode_kernel), in one process.

Two tables:
  1. one layer's attention for one new token per row (B rows, K KV heads, G queries per head, D head size),
     a 30-layer chain compiled once per path, at several filled-slot counts of a 512-slot window: the kernel
     reads only the filled slots, XLA's path all 512; milliseconds per 30 layers, median of 50 calls per round;
  2. with --run_dir: greedy decode tokens/s of that run (128-token prompt, 256 new tokens, the run's own
     context) at each --batch, kernel on and off in alternating rounds (the same tokens are checked).
Each path is selected by DANTINOX_ATTENTION_KERNEL and compiled afresh (jax.clear_caches) in its round.

    python benchmarks/bench_decode_attention.py [--run_dir R] [--batch 1 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dantinox

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dantinox as dx  # noqa: E402
from dantinox.kv import decode_kernel as attention_kernel  # noqa: E402
from dantinox.kv.attend import attend  # noqa: E402
from dantinox.kv.static import LayerKV  # noqa: E402

PATHS = ("kernel", "xla")


def use(path: str) -> None:
    os.environ[attention_kernel.ENV] = "" if path == "kernel" else "off"
    jax.clear_caches()


def layer_table(rounds: int, B: int = 1, K: int = 3, G: int = 3, D: int = 64, L: int = 512) -> None:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, K, G, 1, D)).astype(np.float32))
    new = jnp.asarray(rng.normal(size=(B, K, 1, D)).astype(np.float32))
    old = LayerKV(*(jnp.asarray(rng.normal(size=(B, K, L, D)).astype(np.float32)) for _ in range(2)))

    def chain(q, filled):
        for _ in range(30):
            q = attend(q, new, new, old, filled, None, None)
        return q

    print(f"attention of one new token, B={B} K={K} G={G} D={D}, {L}-slot window: ms per 30 layers (median)")
    print("| filled slots | kernel | XLA | XLA / kernel |\n|---|---|---|---|")
    for filled in (64, 128, 256, 384, 512):
        times = {p: [] for p in PATHS}
        for _ in range(rounds):
            for path in PATHS:
                use(path)
                fn, n = jax.jit(chain), jnp.full((B,), filled, jnp.int32)
                fn(q, n).block_until_ready()
                samples = []
                for _ in range(50):
                    start = time.perf_counter()
                    fn(q, n).block_until_ready()
                    samples.append(time.perf_counter() - start)
                times[path].append(1e3 * statistics.median(samples))
        k, x = statistics.median(times["kernel"]), statistics.median(times["xla"])
        print(f"| {filled} | {k:.3f} | {x:.3f} | {x / k:.2f}x |")


def decode_table(run_dir: str, batches: list[int], rounds: int) -> None:
    from dantinox.runs.run_dir import load_run

    model, cfg, tokenizer, _ = load_run(run_dir)
    ids = tokenizer.encode("The history of the city is long and complicated. " * 30)[:128]
    print(f"\n{run_dir}: greedy decode tokens/s, 128-token prompt, 256 new tokens, context {cfg.max_context}")
    print("| B | kernel | XLA | kernel / XLA | same tokens |\n|---|---|---|---|---|")
    for B in batches:
        batch = np.asarray([ids] * B, np.int32)
        rates, tokens = {p: [] for p in PATHS}, {}

        def timed(n, batch=batch):
            start = time.perf_counter()
            result = dx.generate_result(model, batch, n)
            return time.perf_counter() - start, result

        for _ in range(rounds):
            for path in PATHS:
                use(path)
                timed(1), timed(8)
                first = min(timed(1)[0] for _ in range(2))
                whole, result = timed(256)
                rates[path].append(B * 255 / (whole - first))
                tokens[path] = np.asarray(result.tokens)
        k, x = statistics.median(rates["kernel"]), statistics.median(rates["xla"])
        same = bool((tokens["kernel"] == tokens["xla"]).all())
        print(f"| {B} | {k:.1f} ({', '.join(f'{r:.1f}' for r in rates['kernel'])}) | {x:.1f} "
              f"({', '.join(f'{r:.1f}' for r in rates['xla'])}) | {k / x:.2f}x | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", help="a run directory for the decode table (e.g. an imported SmolLM2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-layer-table", action="store_true")
    args = parser.parse_args()
    if not attention_kernel.kernel_available():
        sys.exit("the decode attention kernel is not available (build the extension: pip install -e .)")
    if not args.no_layer_table:
        layer_table(args.rounds)
    if args.run_dir:
        decode_table(args.run_dir, args.batch, args.rounds)


if __name__ == "__main__":
    main()
