"""Continuous batching (PagedEngine) against static batching on the same mixed trace, in one process.

Both replay the trace of benchmarks/serve_common.py in real time (a request cannot start before its arrival)
on the same model, greedy, after a warm-up that compiles everything (compilation is not timed):
  continuous  requests join the running batch as soon as they arrive and leave when done (chunked prefill,
              one decode token per running request per step, paged KV cache).
  static      requests are served in arrival order in fixed batches of --batch: a batch starts when its
              last request has arrived and the previous batch is done; prompts are padded to the batch's
              longest and every row decodes the batch's largest max_tokens (dantinox.stream_tokens, one
              token per device call, so the first token is visible right after prefill).
Reported per mode: output tokens/s (useful tokens only: each request's own max_tokens, over the wall time
from the first arrival to the last completion), TTFT p50 / p99 (arrival to first token) and TPOT p50.
The greedy tokens of both modes are checked equal, request by request.

Run:  python benchmarks/serve_vs_static.py [--requests 64] [--rate 40] [--batch 16] [--max-batched-tokens 64]
          [--repeats 1] [--prompt-range 4 64] [--new-range 8 48] [--new-dist uniform|lognormal]
"""

from __future__ import annotations

import argparse
import time

from serve_common import add_trace_arguments, mixed_trace, pct, small_model

import dantinox as dx
from dantinox.generation.prompts import bucket_length
from dantinox.serving import EngineConfig, PagedEngine, SamplingOptions


def run_continuous(model, trace, config: EngineConfig) -> dict:
    engine = PagedEngine(model, config)
    engine.warmup()
    start = time.perf_counter()
    ids, first, last, tokens = {}, {}, {}, {}
    pending = list(enumerate(trace))
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival_s <= now:
            i, req = pending.pop(0)
            ids[engine.add_request(req.prompt, SamplingOptions(max_new_tokens=req.max_tokens))] = i
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1].arrival_s - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            i = ids[out.request_id]
            if out.new_token_ids:
                first.setdefault(i, t)
                last[i] = t
                tokens.setdefault(i, []).extend(out.new_token_ids)
    return _summary(trace, first, last, tokens, time.perf_counter() - start, engine.stats()["preemptions"])


def run_static(model, trace, batch: int) -> dict:
    _warm_static(model, trace, batch)
    start = time.perf_counter()
    first, last, tokens = {}, {}, {}
    for b in range(0, len(trace), batch):
        group = list(range(b, min(b + batch, len(trace))))
        wait = trace[group[-1]].arrival_s - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        longest = max(trace[i].max_tokens for i in group)
        produced = 0
        for chunk in dx.stream_tokens(model, [trace[i].prompt for i in group], longest, chunk_size=1):
            t = time.perf_counter() - start
            for row, i in enumerate(group):
                keep = chunk[row, :max(0, trace[i].max_tokens - produced)].tolist()
                if keep:
                    first.setdefault(i, t)
                    last[i] = t
                    tokens.setdefault(i, []).extend(keep)
            produced += chunk.shape[1]
    return _summary(trace, first, last, tokens, time.perf_counter() - start, 0)


def _warm_static(model, trace, batch: int) -> None:
    """Compile prefill for every prompt bucket and the decode loop at the static batch sizes used."""
    S = model.cfg.max_context
    sizes = {min(batch, len(trace) - b) for b in range(0, len(trace), batch)}
    buckets = {bucket_length(len(r.prompt), S) for r in trace}
    for size in sizes:
        for length in sorted(buckets):
            list(dx.stream_tokens(model, [[1] * min(length, S - 2)] * size, 2, chunk_size=1))


def _summary(trace, first, last, tokens, wall: float, preemptions: int) -> dict:
    useful = sum(min(len(tokens.get(i, [])), r.max_tokens) for i, r in enumerate(trace))
    ttft = [first[i] - r.arrival_s for i, r in enumerate(trace) if i in first]
    tpot = [(last[i] - first[i]) / (len(tokens[i]) - 1) for i in first if len(tokens[i]) > 1]
    return dict(tokens_per_s=useful / wall, ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99),
                tpot_p50=pct(tpot, 50), wall_s=wall, tokens=tokens, preemptions=preemptions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=40.0, help="mean arrivals per second")
    parser.add_argument("--batch", type=int, default=16, help="static batch size (the engine runs up to 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batched-tokens", type=int, default=64, help="the engine's prefill budget per step")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each mode, alternating; the run with the median tokens/s is printed")
    add_trace_arguments(parser)
    args = parser.parse_args()
    model = small_model()
    trace = mixed_trace(args.requests, args.rate, args.seed, prompt_range=args.prompt_range,
                        new_range=args.new_range, new_dist=args.new_dist)
    budget = args.max_batched_tokens
    config = EngineConfig(block_size=16, max_running=16, max_batched_tokens=budget, decode_buckets=(1, 4, 8, 16),
                          prefill_buckets=tuple(b for b in (1, 2, 4, 8, 16) if b == 1 or 16 * b <= budget),
                          chunk_buckets=tuple(c for c in (16, 32, 64, 128) if c < 2 * min(budget, 128))[-4:])
    runs = {"continuous": [], "static": []}
    for _ in range(args.repeats):  # alternate, so both modes see the same drift of the host
        runs["continuous"].append(run_continuous(model, trace, config))
        runs["static"].append(run_static(model, trace, args.batch))
    results = {mode: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for mode, rs in runs.items()}
    same = sum(results["continuous"]["tokens"].get(i) == results["static"]["tokens"].get(i)
               for i in range(len(trace)))
    (p0, p1), (n0, n1) = args.prompt_range, args.new_range
    print(f"trace: {len(trace)} requests, prompts {p0}-{p1} tokens, {n0}-{n1} new tokens ({args.new_dist}; "
          f"mean {sum(r.max_tokens for r in trace) / len(trace):.1f}), "
          f"{args.rate:g} req/s; static batch {args.batch}; engine: 16 running, {budget} prefill tokens per step; "
          f"model dim 128 x 4 blocks, GQA 4/2 heads, CPU; median of {args.repeats} alternating runs")
    print(f"{'mode':<11} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'TPOT p50 ms':>12} "
          f"{'wall s':>7} {'preempt':>8}")
    for mode, r in results.items():
        print(f"{mode:<11} {r['tokens_per_s']:>10.1f} {1e3 * r['ttft_p50']:>12.1f} "
              f"{1e3 * r['ttft_p99']:>12.1f} {1e3 * r['tpot_p50']:>12.2f} {r['wall_s']:>7.2f} "
              f"{r['preemptions']:>8}")
    c, s = results["continuous"], results["static"]
    print(f"continuous / static: {c['tokens_per_s'] / s['tokens_per_s']:.2f}x output tokens/s, p99 TTFT "
          f"{1e3 * c['ttft_p99']:.0f} ms vs {1e3 * s['ttft_p99']:.0f} ms; identical greedy outputs: "
          f"{same}/{len(trace)}")


if __name__ == "__main__":
    main()
