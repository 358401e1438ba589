"""Decode on (data, model) meshes of forced CPU devices: per-step time, the collective share, equality, memory.

    python benchmarks/bench_mesh.py [--shapes 1x1 1x2 2x1 2x2 1x4] [--preset reference] [--batch 8]
                                    [--steps 32] [--rounds 3] [--devices 8]

Every mesh runs in this one process over a subset of ``--devices`` forced host devices
(XLA_FLAGS=--xla_force_host_platform_device_count, set here before JAX starts), in alternating rounds, so
the shapes share the machine's conditions. Per mesh shape:
  ms/step      median over rounds of (time of a decode call running --steps steps) / steps, after a warm-up
  vs 1x1       that time over the 1x1 (one device) time
  traced ms    per step, of the one decode call run under jax.profiler (tracing slows it down)
  coll ms      per device and step: the time inside collective ops (all-reduce, all-gather, reduce-scatter,
               all-to-all, collective-permute; waits for the other devices included) in that trace
  coll share   the same collective time over the wall time of the traced call (profiling slows a call, so
               the share is taken within the traced call): the part of a step a device spends in collectives
  tokens ==    the greedy tokens equal the one-device tokens
  KV MiB/dev   cache bytes on device 0 (from addressable_shards)
On a CPU host the "devices" are threads over the same cores, so a mesh cannot be faster than one device;
the table shows what the collectives cost, not a speed-up.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x1", "1x2", "2x1", "2x2", "1x4"])
    p.add_argument("--preset", default="reference")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--devices", type=int, default=8)
    return p.parse_args()


ARGS = _parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={ARGS.devices}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dantinox as dx  # noqa: E402
from dantinox.generation.decode import decode, prefill  # noqa: E402
from dantinox.generation.sampling import make_sampling_params  # noqa: E402
from dantinox.parallel.mesh import make_mesh, mesh_scope  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
PROMPT = 16


class Case:
    """One mesh shape: its sharded parameters and a decode state after prefill."""

    def __init__(self, cfg, shape: tuple[int, int]):
        self.shape = shape
        n = shape[0] * shape[1]
        self.mesh = None if n == 1 else make_mesh(*shape, devices=jax.devices()[:n])
        self.graphdef, self.params = nnx.split(dx.build_model(cfg, 0, mesh=self.mesh))
        B = ARGS.batch
        self.ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, PROMPT)).astype(np.int32)
        self.lengths = np.full((B,), PROMPT, np.int32)
        self.key, self.sampling = jax.random.key(0), make_sampling_params(B, 0.0, 0, 1.0, cfg.vocab_size)

    def run(self, steps: int):
        """Prefill, then one decode call of ``steps`` steps; returns (seconds of the decode call, state)."""
        with mesh_scope(self.mesh):
            state = prefill(self.graphdef, self.params, self.ids, self.lengths, self.key, self.sampling,
                            jnp.int32(-1), jnp.int32(0))
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            state = decode(self.graphdef, self.params, state, jnp.int32(1 + steps), self.key, self.sampling,
                           jnp.int32(-1), jnp.int32(0))
            jax.block_until_ready(state)
        return time.perf_counter() - t0, state


def collective_us(case: Case, steps: int) -> tuple[float, float]:
    """(microseconds inside collective ops summed over threads, wall microseconds of the traced decode call)
    from a jax.profiler trace of one decode call. Nested or repeated events of one thread are merged (the
    union of their intervals), so nothing is counted twice."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        seconds, _ = case.run(steps)
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["name"].split(".")[0] in COLLECTIVES:
            spans[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    total = 0.0
    for intervals in spans.values():
        end = float("-inf")
        for start, stop in sorted(intervals):
            if stop > end:
                total += stop - max(start, end)
                end = stop
    return total, seconds * 1e6


def main() -> None:
    cfg = dx.ModelConfig.from_preset(ARGS.preset)
    shapes = [tuple(int(x) for x in s.split("x")) for s in ARGS.shapes]
    cases = {s: Case(cfg, s) for s in shapes}
    tokens, times = {}, {s: [] for s in shapes}
    for s, case in cases.items():  # warm-up (compiles) and the tokens
        tokens[s] = np.asarray(case.run(ARGS.steps)[1].out)
    for _ in range(ARGS.rounds):
        for s, case in cases.items():
            times[s].append(case.run(ARGS.steps)[0] / ARGS.steps)
    base = statistics.median(times[shapes[0]])
    print(f"{ARGS.preset}: attention={cfg.attention} kv_heads={cfg.kv_heads} blocks={cfg.num_blocks} "
          f"dim={cfg.dim}; batch {ARGS.batch}, prompt {PROMPT}, {ARGS.steps} decode steps per call, "
          f"median of {ARGS.rounds} alternating rounds; {os.cpu_count()} CPU cores, shared host")
    print("| mesh (data x model) | ms/step | vs first | traced ms/step | coll ms/step/device | coll share | "
          "tokens == | KV MiB/device |")
    print("|---|---|---|---|---|---|---|---|")
    for s, case in cases.items():
        ms = statistics.median(times[s]) * 1e3
        n = s[0] * s[1]
        coll_us, traced_us = collective_us(case, ARGS.steps)
        traced = traced_us / 1e3 / ARGS.steps
        share = coll_us / n / traced_us
        _, state = case.run(1)
        kv = sum(a.addressable_shards[0].data.nbytes for a in jax.tree_util.tree_leaves(state.cache)) / 2**20
        same = bool(np.array_equal(tokens[s], tokens[shapes[0]]))
        collective_ms = coll_us / 1e3 / n / ARGS.steps
        print(f"| {s[0]}x{s[1]} | {ms:.2f} | {ms / (base * 1e3):.2f}x | {traced:.2f} | {collective_ms:.2f} | "
              f"{share:.0%} | {same} | {kv:.2f} |")


if __name__ == "__main__":
    main()
