"""Serving at a fixed KV memory: float32 against int8 KV cache, in one process (issue 10, point 7).

The same model (benchmarks/serve_common.py "small": GQA, 4 blocks, 2 KV heads x 32, max_context 128) is served
by the in-process PagedEngine with the pool sized from the same --kv-memory for each cache dtype
(``dantinox.with_kv_dtype`` shares the parameters). The trace fills memory: --requests requests all arrive at
once (a burst), prompts and max_tokens from --prompt-range / --new-range, so float32 is bound by its blocks
while the int8 pool, about 3.5x the blocks, admits more sequences. Compilation is done by a warm-up before
timing; the runs alternate between the dtypes --repeats times.

Reported per dtype (medians over repeats): blocks in the pool, admitted concurrency (the largest number of
running sequences in any step), output tokens/s (generated tokens over the wall time from the burst to the
last completion), TTFT p50 / p99 (burst to a request's first token), preemptions; and the int8 / float32
ratios. int8 may pick other greedy tokens than float32: both runs generate each request's max_tokens (no
EOS), so the work is the same.

Run:  python benchmarks/serve_kv_dtype.py [--kv-memory 2MiB] [--requests 48] [--repeats 2]
          [--max-running 64] [--block-size 16] [--prompt-range 32 64] [--new-range 32 48]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from serve_common import mixed_trace, pct, small_model

import dantinox as dx
from dantinox.budget.memory import parse_memory_size
from dantinox.serving import EngineConfig, PagedEngine, SamplingOptions

DTYPES = ("float32", "int8")


def serve_burst(engine: PagedEngine, trace) -> dict:
    """Add every request at once, step until done. Returns the figures of one run."""
    start = time.perf_counter()
    first, tokens, peak = {}, 0, 0
    for req in trace:
        engine.add_request(req.prompt, SamplingOptions(max_new_tokens=req.max_tokens))
    while engine.has_unfinished():
        outputs = engine.step()
        peak = max(peak, engine.stats()["running"])
        now = time.perf_counter() - start
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                tokens += len(out.new_token_ids)
    wall = time.perf_counter() - start
    ttft = list(first.values())
    return dict(concurrency=peak, tok_s=tokens / wall, ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99),
                preemptions=engine.stats()["preemptions"], tokens=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-memory", default="2MiB")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=256)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--new-range", type=int, nargs=2, default=(32, 48))
    args = parser.parse_args()
    memory = parse_memory_size(args.kv_memory)
    trace = mixed_trace(args.requests, 1e9, seed=0, prompt_range=tuple(args.prompt_range),
                        new_range=tuple(args.new_range))
    base = small_model()
    config = EngineConfig(block_size=args.block_size, max_running=args.max_running, kv_memory_bytes=memory,
                          max_batched_tokens=args.max_batched_tokens, preemption="recompute")
    engines = {}
    for d in DTYPES:
        engines[d] = PagedEngine(dx.with_kv_dtype(base, d), config)
        engines[d].warmup()
    runs = {d: [] for d in DTYPES}
    for _ in range(args.repeats):
        for d in DTYPES:
            runs[d].append(serve_burst(engines[d], trace))
    print(f"# dantinox {dx.__version__}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"kv-memory {args.kv_memory} ({memory} B), {args.requests} requests in one burst, prompts "
          f"{args.prompt_range}, max_tokens {args.new_range}, block size {args.block_size}, repeats "
          f"{args.repeats} (medians)")
    print("| KV dtype | blocks | admitted concurrency | output tok/s | TTFT p50 s | TTFT p99 s | preemptions |")
    print("|---|---|---|---|---|---|---|")
    med = {d: {k: statistics.median(r[k] for r in runs[d]) for k in runs[d][0]} for d in DTYPES}
    for d in DTYPES:
        m = med[d]
        print(f"| {d} | {engines[d].allocator.num_blocks} | {m['concurrency']:.0f} | {m['tok_s']:.0f} | "
              f"{m['ttft_p50']:.2f} | {m['ttft_p99']:.2f} | {m['preemptions']:.0f} |")
    a, b = med["int8"], med["float32"]
    blocks = engines["int8"].allocator.num_blocks / engines["float32"].allocator.num_blocks
    print(f"\nint8 / float32: blocks {blocks:.2f}x, "
          f"concurrency {a['concurrency'] / b['concurrency']:.2f}x, output tok/s {a['tok_s'] / b['tok_s']:.2f}x, "
          f"TTFT p99 {a['ttft_p99'] / b['ttft_p99']:.2f}x")


if __name__ == "__main__":
    main()
