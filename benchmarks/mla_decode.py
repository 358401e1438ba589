"""Decode speed of MLA (absorbed and naive) against GQA at the seeds' reference shape, and cache bytes.

Reference shape: dim 256, 12 blocks, 8 heads x 32, vocab 256, max_context 512, SwiGLU 1024, fp32; GQA
kv_heads 2; MLA kv_latent 128, rope 16, q_latent 128. Greedy decode of --steps tokens after a --prompt-token
prefill, the token loop inside one jitted ``lax.fori_loop`` with the cache donated (as a compiled generate
loop runs it).
Each kind is timed --repeats times, the kinds interleaved; the best is printed. Compare only runs made side
by side (the host drifts).

    python benchmarks/mla_decode.py [--batch 1] [--steps 50] [--kinds gqa mla mla-naive]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

import dantinox as dx

KINDS = {
    "gqa": lambda: dx.ModelConfig.from_preset("reference"),
    "mha": lambda: dx.ModelConfig.from_preset("reference-mha"),
    "mla": lambda: dx.ModelConfig.from_preset("reference-mla"),
    "mla-naive": lambda: dx.ModelConfig.from_preset("reference-mla", mla_absorb=False),
}


def decode_fn(graphdef, steps: int):
    """A jitted greedy loop: (state, cache, first token [B, 1], start slot) -> (tokens [B, steps], cache)."""

    def run(state, cache, token, start):
        model = nnx.merge(graphdef, state)

        def step(i, carry):
            cache, token, out = carry
            logits, cache, _ = model(token, use_cache=True, kv_caches=cache, cache_index=start + i)
            token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
            return cache, token, out.at[:, i].set(token[:, 0])

        out = jnp.zeros((token.shape[0], steps), jnp.int32)
        cache, _, out = jax.lax.fori_loop(0, steps, step, (cache, token, out))
        return out, cache

    return jax.jit(run, donate_argnums=(1,))


def prepare(kind: str, batch: int, prompt: int, steps: int):
    """Build and compile one kind; returns (config, a function that runs prefill + the decode loop and
    returns the loop's time in seconds)."""
    cfg = KINDS[kind]()
    graphdef, state = nnx.split(dx.build_model(cfg, seed=0))
    ids = jax.random.randint(jax.random.key(1), (batch, prompt), 0, cfg.vocab_size, jnp.int32)
    prefill = jax.jit(lambda s, c, x: nnx.merge(graphdef, s)(x, use_cache=True, kv_caches=c, cache_index=0))
    loop = decode_fn(graphdef, steps)

    def run_once() -> float:
        logits, cache, _aux = prefill(state, dx.init_cache(cfg, batch), ids)
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        jax.block_until_ready((token, cache))
        t0 = time.perf_counter()
        out, cache = loop(state, cache, token, jnp.int32(prompt))
        out.block_until_ready()
        return time.perf_counter() - t0

    run_once()                                        # compiles
    return cfg, run_once


def measure(kinds, batch: int, prompt: int, steps: int, repeats: int) -> list[dict]:
    """Best loop time per kind over `repeats` rounds, the kinds interleaved within each round."""
    runners = {k: prepare(k, batch, prompt, steps) for k in kinds}
    best = {k: runners[k][1]() for k in kinds}
    for _round in range(repeats - 1):
        for k in kinds:
            best[k] = min(best[k], runners[k][1]())
    return [dict(kind=k, ms_per_step=1e3 * best[k] / steps, tok_s=batch * steps / best[k],
                 cache_mib=dx.kv_cache_bytes(runners[k][0], 1, runners[k][0].max_context) / 2**20,
                 weights_mib=dx.param_bytes(runners[k][0]) / 2**20) for k in kinds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=["gqa", "mla", "mla-naive"], choices=sorted(KINDS))
    args = parser.parse_args()
    rows = measure(args.kinds, args.batch, args.prompt, args.steps, args.repeats)
    base = next((r for r in rows if r["kind"] == "gqa"), rows[0])
    print(f"batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps, best of {args.repeats}")
    print(f"{'kind':<10} {'ms/step':>8} {'tok/s':>8} {'vs ' + base['kind']:>7} {'cache MiB/seq':>14}"
          f" {'weights MiB':>12}")
    for r in rows:
        print(f"{r['kind']:<10} {r['ms_per_step']:8.3f} {r['tok_s']:8.1f} {r['tok_s'] / base['tok_s']:7.2f}"
              f" {r['cache_mib']:14.3f} {r['weights_mib']:12.1f}")


if __name__ == "__main__":
    main()
