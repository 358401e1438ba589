"""Prefill and decode speed of dantinox on the seeds' reference shape, in the peers' terms.

Shape (the one ../shared/peers measures): dim 256, 12 blocks, 8 query heads x 32, vocab 256, SwiGLU hidden
1024, tied embeddings, max_context 512, float32, random weights; 64-token prompt, 256 greedy new tokens.

Figures (medians over --repeats runs, all in this process):
  prefill_ms    wall time of a 1-token generation (prefill + first token), as the peers define it
  decode tok/s  B * 255 / (time of a 256-token generation - prefill time)
  cache off     the same 256-token generation with use_cache=False (full recompute per token), batch 1
  compile_s     seconds of XLA compilation in the first call (from jax.monitoring events)
  KV bytes/seq  bytes of the allocated cache for one sequence (from the arrays)
  on/off ratio  cache-on over cache-off tokens/s at 128, 320 and 512 total tokens (64-token prompt)

Run:  python benchmarks/bench_decode.py [--attention mha gqa mqa mla mla-naive] [--batch 1 8] [--repeats 3] [--ratios]
      python benchmarks/bench_decode.py --windows-ab [--attention ...]   decode with the attention windows of
      dantinox.generation.decode.decode_windows (128, 256, 384, 512) against one window of 512, alternating in one
      process (how the per-kind default was chosen)
      python benchmarks/bench_decode.py --quantize fp32 bf16 int8 [--batch 1 8 32]   decode tokens/s with float32,
      bf16 and int8 weights (dantinox.quant.weights), runs alternating in one process; ratios against fp32
      python benchmarks/bench_decode.py --kv-dtype float32 bfloat16 int8 [--batch 1 8 32]   the KV cache
      dtypes A/B: the same parameters with each cache dtype, runs alternating in one process; decode tok/s,
      the ratio to the first dtype, KV bytes per sequence (max_context slots, int8 scales included) and the
      largest batch whose cache fits 64 MiB. One dtype alone sets the cache dtype of the main table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax.numpy as jnp
import numpy as np

import dantinox as dx
from dantinox.kv.static import cache_nbytes

PROMPT, NEW = 64, 256
VARIANTS = {
    "mha": dict(attention="mha", kv_heads=None),
    "gqa": dict(attention="gqa", kv_heads=2),
    "mqa": dict(attention="mqa", kv_heads=None),
    # MLA with the latent sizes ../shared/peers measures (kv and q latent 128, rope 16); see dantinox.model.mla
    "mla": dict(attention="mla", kv_heads=None, kv_latent_dim=128, rope_head_dim=16, q_latent_dim=128),
    "mla-naive": dict(attention="mla", kv_heads=None, kv_latent_dim=128, rope_head_dim=16, q_latent_dim=128,
                      mla_absorb=False),
}


KV_BUDGET = 64 * 2**20   # bytes: the fixed KV budget of the --kv-dtype table


def reference_config(variant: str, kv_dtype: str = "float32") -> dx.ModelConfig:
    """The reference shape with the attention settings of ``variant`` (a key of VARIANTS) and a cache dtype."""
    return dx.ModelConfig.from_preset("reference", cache_dtype=kv_dtype, **VARIANTS[variant])


def timed(fn, repeats: int) -> float:
    """Median wall seconds of fn() over `repeats` runs (after the caller's warm-up)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(variant: str, batches: list[int], repeats: int, ratios: bool, kv_dtype: str = "float32") -> dict:
    """All figures for one attention variant; returns a dict of named numbers."""
    cfg = reference_config(variant, kv_dtype)
    model = dx.build_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    row = {"variant": variant, "kv_bytes": cache_nbytes(dx.init_cache(cfg, 1))}
    for b in batches:
        prompts = rng.integers(0, cfg.vocab_size, (b, PROMPT)).tolist()
        with dx.CompileCounter() as counted:
            dx.generate(model, prompts, NEW)
        row[f"compile_s_b{b}"] = counted.seconds
        t_prefill = timed(lambda p=prompts: dx.generate(model, p, 1), repeats)
        t_full = timed(lambda p=prompts: dx.generate(model, p, NEW), repeats)
        row[f"prefill_ms_b{b}"] = 1000 * t_prefill
        row[f"decode_b{b}"] = b * (NEW - 1) / (t_full - t_prefill)
    prompt = rng.integers(0, cfg.vocab_size, (1, PROMPT)).tolist()
    totals = (128, 320, 512) if ratios else (PROMPT + NEW,)
    for total in totals:
        new = total - PROMPT
        dx.generate(model, prompt, new, use_cache=False)
        off = timed(lambda n=new: dx.generate(model, prompt, n, use_cache=False), max(1, repeats // 2))
        on = timed(lambda n=new: dx.generate(model, prompt, n), repeats)
        row[f"off_tok_s_{total}"] = new / off
        row[f"on_off_ratio_{total}"] = off / on
    return row


def windows_ab(variant: str, batches: list[int], repeats: int) -> list[str]:
    """Decode tokens/s with windows (128, 256, 384, 512) and with one window (512), runs alternating; the
    greedy tokens must agree. Returns table rows."""
    gen = sys.modules["dantinox.generation.decode"]
    model = dx.build_model(reference_config(variant), seed=0)
    graphdef, params = gen.split_model(model)
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        req = gen._prepare(model, rng.integers(0, 256, (b, PROMPT)).tolist(), NEW, 0.0, 0, 1.0, 0, None)

        def run(windows, req=req):
            state = gen.prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id,
                                req.fill)
            state = gen.decode(graphdef, params, state, jnp.int32(NEW), req.key, req.sampling, req.eos_id,
                               req.fill, windows=windows)
            return np.asarray(state.out)

        options = {"windows": (128, 256, 384, 512), "one": (512,)}
        outs = {name: run(w) for name, w in options.items()}  # compiles both
        assert (outs["windows"] == outs["one"]).all(), "windowed decode changed the greedy tokens"
        times = {name: [] for name in options}
        for _ in range(repeats):
            for name, w in options.items():
                start = time.perf_counter()
                run(w)
                times[name].append(time.perf_counter() - start)
        rate = {name: b * NEW / statistics.median(t) for name, t in times.items()}
        rows.append(f"| {variant} | {b} | {rate['windows']:.0f} | {rate['one']:.0f} | "
                    f"{rate['windows'] / rate['one']:.2f} |")
    return rows


def quantize_ab(variant: str, batches: list[int], repeats: int, settings: list[str]) -> list[str]:
    """Decode-only tokens/s for each weight setting (dantinox.quant.weights), runs alternating in one process.

    Each round prefills every setting's batch, then times one compiled decode of NEW - 1 steps per setting
    (wall and process CPU seconds; the host is shared, so CPU time drifts less). Returns table rows: median
    tokens/s, the median over rounds of the per-round ratio against the first setting (wall, then CPU), and
    the ratio of the fastest runs (best of ``repeats``, the least disturbed by other processes).
    """
    from dantinox.quant.weights import quantize_weights

    gen = sys.modules["dantinox.generation.decode"]
    cfg = reference_config(variant)
    models = {q: quantize_weights(dx.build_model(cfg, seed=0), None if q == "fp32" else q) for q in settings}
    splits = {q: gen.split_model(m) for q, m in models.items()}
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        req = gen._prepare(models[settings[0]], rng.integers(0, cfg.vocab_size, (b, PROMPT)).tolist(), NEW,
                           0.0, 0, 1.0, 0, None)

        def run(q, req=req):
            graphdef, params = splits[q]
            state = gen.prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill)
            state.out.block_until_ready()
            wall, cpu = time.perf_counter(), time.process_time()
            state = gen.decode(graphdef, params, state, jnp.int32(NEW), req.key, req.sampling, req.eos_id, req.fill)
            state.out.block_until_ready()
            return time.perf_counter() - wall, time.process_time() - cpu

        for q in settings:
            run(q)  # compile
        times = {q: [] for q in settings}
        for _ in range(repeats):
            for q in settings:
                times[q].append(run(q))
        cells = []
        for q in settings:
            rate = b * (NEW - 1) / statistics.median(t[0] for t in times[q])
            wall = statistics.median(a[0] / c[0] for a, c in zip(times[settings[0]], times[q]))
            cpu = statistics.median(a[1] / c[1] for a, c in zip(times[settings[0]], times[q]))
            best = min(t[0] for t in times[settings[0]]) / min(t[0] for t in times[q])
            cells.append(f"{rate:.0f} ({wall:.2f}x wall, {cpu:.2f}x cpu, {best:.2f}x best)")
        rows.append(f"| {variant} | {b} | " + " | ".join(cells) + " |")
    return rows


def kv_dtype_ab(variant: str, batches: list[int], repeats: int, dtypes: list[str]) -> list[str]:
    """Decode tokens/s of the same parameters with each cache dtype, timed runs alternating between the
    dtypes; greedy tokens are not compared (int8 may pick other tokens). Returns markdown table rows."""
    base = dx.build_model(reference_config(variant), seed=0)
    models = {d: dx.with_kv_dtype(base, d) for d in dtypes}
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        prompts = rng.integers(0, 256, (b, PROMPT)).tolist()
        for m in models.values():  # compile prefill and decode for this batch
            dx.generate(m, prompts, NEW)
            dx.generate(m, prompts, 1)
        full, pre = {d: [] for d in dtypes}, {d: [] for d in dtypes}
        for _ in range(repeats):
            for d, m in models.items():
                full[d].append(timed(lambda m=m, p=prompts: dx.generate(m, p, NEW), 1))
                pre[d].append(timed(lambda m=m, p=prompts: dx.generate(m, p, 1), 1))
        rate = {d: b * (NEW - 1) / (statistics.median(full[d]) - statistics.median(pre[d])) for d in dtypes}
        for d, m in models.items():
            per_seq = dx.kv_cache_bytes(m.cfg, 1, m.cfg.max_context)
            rows.append(f"| {variant} | {b} | {d} | {rate[d]:.0f} | {rate[d] / rate[dtypes[0]]:.2f} | "
                        f"{per_seq:,} | {KV_BUDGET // per_seq} |")
    return rows


def print_table(rows: list[dict], batches: list[int], ratios: bool) -> None:
    head = ["attention", "KV bytes/seq"]
    for b in batches:
        head += [f"prefill ms B={b}", f"decode tok/s B={b}", f"compile s B={b}"]
    head += ["cache off tok/s B=1"]
    totals = (128, 320, 512) if ratios else (PROMPT + NEW,)
    head += [f"on/off @{t}" for t in totals]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["variant"], f"{r['kv_bytes']:,}"]
        for b in batches:
            cells += [f"{r[f'prefill_ms_b{b}']:.1f}", f"{r[f'decode_b{b}']:.0f}", f"{r[f'compile_s_b{b}']:.2f}"]
        cells += [f"{r[f'off_tok_s_{PROMPT + NEW}']:.1f}"]
        cells += [f"{r[f'on_off_ratio_{t}']:.1f}x" for t in totals]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", nargs="+", default=["mha", "gqa", "mqa"], choices=sorted(VARIANTS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratios", action="store_true", help="cache on/off ratio at 128, 320, 512 tokens")
    parser.add_argument("--windows-ab", action="store_true", help="attention windows against one window")
    parser.add_argument("--quantize", nargs="+", default=None, choices=("fp32", "bf16", "int8"),
                        help="weight settings to compare (alternating runs, ratios against the first)")
    parser.add_argument("--kv-dtype", nargs="+", default=["float32"], type=dx.parse_kv_dtype,
                        help="cache dtypes; two or more: the A/B table of decode speed and bytes per dtype")
    args = parser.parse_args()
    print(f"# dantinox {dx.__version__}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if args.windows_ab:
        print("| attention | batch | windows tok/s (prefill incl.) | one window tok/s | ratio |\n|---|---|---|---|---|")
        for variant in args.attention:
            print("\n".join(windows_ab(variant, args.batch, max(args.repeats, 5))), flush=True)
        return
    if args.quantize:
        print("| attention | batch | " + " | ".join(f"{q} weights tok/s" for q in args.quantize) + " |\n|---|---|"
              + "---|" * len(args.quantize))
        for variant in args.attention:
            print("\n".join(quantize_ab(variant, args.batch, args.repeats, args.quantize)), flush=True)
        return
    if len(args.kv_dtype) > 1:
        print(f"| attention | batch | KV dtype | decode tok/s | vs {args.kv_dtype[0]} | KV bytes/seq "
              f"(max_context) | max batch in {KV_BUDGET // 2**20} MiB |\n|---|---|---|---|---|---|---|")
        for variant in args.attention:
            print("\n".join(kv_dtype_ab(variant, args.batch, args.repeats, args.kv_dtype)), flush=True)
        return
    rows = [measure(v, args.batch, args.repeats, args.ratios, args.kv_dtype[0]) for v in args.attention]
    print_table(rows, args.batch, args.ratios)


if __name__ == "__main__":
    main()
