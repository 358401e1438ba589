"""Simulator fidelity: the same trace simulated once per profile sample (the plan's median and interval) and
replayed on the real engine (in process, wall clock), at light load, near capacity and overloaded.

  python benchmarks/plan_fidelity.py [--run_dir R] [--profile P | --repeats 3 [--cooldown 10] [--call-repeats 15]]
                                     [--interval t|range] [--confidence 0.9] [--requests 60] [--replays 3]
                                     [--seed 0] [--loads light,near,over] [--reprofile] [--max-context N]
                                     [--out F.json]
  python benchmarks/plan_fidelity.py --summarize F1.json F2.json ...     # one verdict over several sittings

The profile is the planner's (``dantinox.plan.profile.take_profile``, --repeats K samples --cooldown seconds
apart, as ``dantinox plan profile --repeats K``), taken once at the start and used for every load, as a plan
would; with --reprofile a fresh K-sample profile is taken right before each load's replays instead. Each
trace is simulated once per sample with the planner's simulator and summarized with the planner's own median
and interval (``uncertainty.median_metrics`` / ``latency_intervals``, --interval / --confidence as in
``dantinox plan``). Capacity is found in simulation (the median over the samples): the highest of rates 1,
1.5, 2.25, ... requests/s at which the simulated output tokens/s keep up with the offered output tokens/s
(>= 90 %) and p99 TTFT stays under 10 s; the loads are 0.25x, 0.8x and 1.5x that rate, each with its own mixed
trace (chat behind a shared prefix, documents, the rare Latin/Occitan slice when ../shared/data is present),
each replayed --replays times, every replay with a cold prefix cache.

--max-context N serves the model with an N-token context (``dantinox plan --max-context``): the profile, the
traces, the simulation and the replay engine all use N. For a model with a long context (SmolLM2: 8,192 tokens)
give the trace's longest request plus output rounded up (512 for the default mixed trace): at 8,192 tokens the
profile's engine holds a pool for 16 sequences of 8,192 tokens and times decode calls over 8,192-slot tables,
and its K = 3 profile did not finish in 25 minutes (benchmarks/results/2026-12-03-plan-smollm2.md).

Printed per cell (load x metric: p99 TTFT, p50 TPOT, output tokens/s): the predicted median [interval], the
replays' median [their range], inside (the replay median in the interval), the gap of the medians against its
tolerance (the larger of the replay's own spread and 10 %; 5 % for tokens/s), and a verdict against issue 22's
acceptance (``dantinox.plan.fidelity``: light and near-capacity cells only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dantinox.plan.candidate import Candidate  # noqa: E402
from dantinox.plan.fidelity import fidelity_cell, fidelity_verdict  # noqa: E402
from dantinox.plan.inputs import load_model, load_trace  # noqa: E402
from dantinox.plan.profile import check_profile, model_identity, profile_cost_models, take_profile  # noqa: E402
from dantinox.plan.replay import replay_realtime  # noqa: E402
from dantinox.plan.simulate import simulate  # noqa: E402
from dantinox.plan.trace import TraceSpec, default_classes, generate_trace, trace_text  # noqa: E402
from dantinox.plan.uncertainty import check_interval_request, latency_intervals, median_metrics  # noqa: E402

# ../shared/data beside the repository, as the project lays it out
RARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                    "slices-rare-latin-occitan.txt")
# (metric key of uncertainty.latency_intervals, its label, scale to the printed unit, value in a replay's dict)
METRICS = (("ttft_p99", "p99 TTFT ms", 1e3, lambda m: m["ttft"]["p99"]),
           ("tpot_p50", "p50 TPOT ms", 1e3, lambda m: m["tpot"]["p50"]),
           ("output_tokens_per_s", "output tok/s", 1.0, lambda m: m["output_tokens_per_s"]))
LOADS = {"light": ("light", 0.25), "near": ("near capacity", 0.8), "over": ("overloaded", 1.5)}


def make_trace(cfg, tok, rate, n, seed, directory):
    rare = RARE if os.path.exists(RARE) else None
    recs = generate_trace(TraceSpec(requests=n, rate=rate, classes=default_classes(rare), seed=seed,
                                    max_context=cfg.max_context))
    path = os.path.join(directory, f"trace_{rate:.3f}.jsonl")
    with open(path, "w") as f:
        f.write(trace_text(recs))
    return load_trace(path, cfg, tok)


def profile_now(run_dir, model, cfg, args) -> dict:
    """A K-sample profile with the planner's own profiling code (as ``dantinox plan profile --repeats K``)."""
    t0 = time.time()
    prof = take_profile(run_dir, model, cfg, repeats=args.call_repeats, samples=args.repeats,
                        cooldown_s=args.cooldown, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"profiled: {args.repeats} samples {args.cooldown:g} s apart in {time.time() - t0:.0f} s",
          file=sys.stderr)
    return prof


def predict(cfg, cand, costs, reqs, prompts, method, confidence) -> tuple[dict, dict]:
    """(median metrics, intervals) over one simulation per cost model, as the plan computes them."""
    runs = [simulate(cfg, cand, c, reqs, prompts) for c in costs]
    for r in runs:
        r.pop("records")
    return median_metrics(runs), latency_intervals(runs, method, confidence)


def find_capacity(cfg, tok, costs, cand, n, seed, directory) -> float:
    rate, best = 1.0, 1.0
    for _ in range(12):
        reqs, prompts = make_trace(cfg, tok, rate, n, seed, directory)
        m, _ = predict(cfg, cand, costs, reqs, prompts, "range", 0.9)
        offered = sum(q.max_tokens for q in reqs) / max(reqs[-1].arrival, 1e-9)
        if m["output_tokens_per_s"] < 0.9 * offered or m["ttft"]["p99"] > 10:
            break
        best, rate = rate, rate * 1.5
    return best


def replays(engine, reqs, prompts, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        r = replay_realtime(engine, reqs, prompts)
        r.pop("records")
        out.append(r)
        engine.allocator.pool.forget_all_hashes()   # every replay starts with a cold prefix cache
    return out


def load_cells(label: str, intervals: dict, reals: list) -> list[dict]:
    """The three cells of one load, in the printed units (ms, tokens/s)."""
    cells = []
    for key, _, scale, value in METRICS:
        iv = {k: None if intervals[key][k] is None else intervals[key][k] * scale for k in ("median", "low", "high")}
        cells.append(fidelity_cell(label, key, iv, [value(r) * scale for r in reals]))
    return cells


def _f(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def cell_text(c: dict) -> str:
    """"pred [low-high] / replay [min-max], inside, gap (tolerance)" of one cell."""
    p, r = c["predicted"], c["replay"]
    gap = "-" if c["gap"] is None else f"{c['gap']:+.0%}"
    return (f"{_f(p['median'])} [{_f(p['low'])}-{_f(p['high'])}] / {_f(r['median'])} [{_f(r['low'])}-"
            f"{_f(r['high'])}], {'yes' if c['inside'] else 'no'}, {gap} ({c['tolerance']:.0%})")


def verdict_line(cells: list) -> str:
    v = fidelity_verdict(cells)
    med = "-" if v["median_abs_gap"] is None else f"{v['median_abs_gap']:.0%}"
    return (f"verdict (light + near capacity): inside {v['inside']}/{v['latency_cells']} latency cells "
            f"(need 80 %: {'ok' if v['inside_ok'] else 'no'}); gap within tolerance {v['gaps_within']}/"
            f"{v['latency_cells']} (median |gap| {med}); output tok/s within 5 % {v['throughput_within']}/"
            f"{v['throughput_cells']}: {'PASS' if v['passed'] else 'FAIL'}")


def print_table(rows: list) -> None:
    """rows: [{"sitting", "load", "rate_rps", "cells"}]; one markdown line per load, then the verdict."""
    print("| sitting | load | rate (req/s) | " + " | ".join(
        f"{label}: predicted [interval] / replay [range], inside, gap (tolerance)" for _, label, _, _ in METRICS)
          + " |")
    print("|---|---|---|" + "---|" * len(METRICS))
    for r in rows:
        print(f"| {r['sitting']} | {r['load']} | {r['rate_rps']} | " + " | ".join(map(cell_text, r["cells"])) + " |")
    print(verdict_line([c for r in rows for c in r["cells"]]))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=None)
    p.add_argument("--profile", default=None, help="profile.json with >= 2 samples (default: profile now)")
    p.add_argument("--repeats", type=int, default=3, help="profile samples K (as plan profile --repeats)")
    p.add_argument("--cooldown", type=float, default=10.0, help="seconds between two profile samples")
    p.add_argument("--call-repeats", type=int, default=15, help="runs per timed call (their median)")
    p.add_argument("--interval", default="t", choices=("t", "range"))
    p.add_argument("--confidence", type=float, default=0.9)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loads", default="light,near,over", help="comma-separated: light, near, over")
    p.add_argument("--replays", type=int, default=3, help="replays per load (their median and range)")
    p.add_argument("--reprofile", action="store_true",
                   help="a fresh K-sample profile right before each load (default: one at the start)")
    p.add_argument("--max-context", type=int, default=None,
                   help="serve the model with an N-token context (default: its own), as dantinox plan --max-context")
    p.add_argument("--out", default=None)
    p.add_argument("--summarize", nargs="+", default=None, help="--out files: print their cells and one verdict")
    args = p.parse_args(argv)
    bad = [x for x in args.loads.split(",") if x not in LOADS]
    if bad or args.replays < 1:
        p.error(f"--loads {args.loads!r}: each of {sorted(LOADS)}" if bad else f"--replays={args.replays}: >= 1")
    return args


def summarize_files(paths: list) -> int:
    rows = []
    for path in paths:
        rows += json.load(open(path))["rows"]
    print_table(rows)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        return summarize_files(args.summarize)
    from dantinox.serving.engine import PagedEngine

    run_dir, model, cfg, tok = load_model(args.run_dir, args.max_context)
    if args.profile:
        prof = json.load(open(args.profile))
        check_profile(prof, model_identity(run_dir, cfg), f"--profile {args.profile}")
    else:
        prof = profile_now(run_dir, model, cfg, args)
    costs = profile_cost_models(prof)
    check_interval_request(len(costs), args.interval, args.confidence)
    cand = Candidate()
    engine = PagedEngine(model, cand.engine_config())
    engine.warmup()
    sitting = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows, profiles = [], [prof]
    with tempfile.TemporaryDirectory() as d:
        cap = find_capacity(cfg, tok, costs, cand, args.requests, args.seed, d)
        for name in args.loads.split(","):
            label, factor = LOADS[name]
            reqs, prompts = make_trace(cfg, tok, cap * factor, args.requests, args.seed, d)
            if args.reprofile:
                profiles.append(profile_now(run_dir, model, cfg, args))
                costs = profile_cost_models(profiles[-1])
            _, intervals = predict(cfg, cand, costs, reqs, prompts, args.interval, args.confidence)
            reals = replays(engine, reqs, prompts, args.replays)
            rows.append({"sitting": sitting, "load": label, "rate_rps": round(cap * factor, 3),
                         "load_average": list(os.getloadavg()), "cells": load_cells(label, intervals, reals),
                         "preemptions": [r["preemptions"] for r in reals]})
    print(f"capacity (simulated, median over {len(costs)} samples): {cap:.2f} requests/s; {args.requests} "
          f"requests per load; predicted: median [{args.interval} interval"
          f"{f' at {args.confidence:g}' if args.interval == 't' else ''}] over {len(costs)} simulations; "
          f"replay: median of {args.replays} [their range]")
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"capacity_rps": cap, "args": vars(args), "rows": rows,
                       "cost_models": [[s["cost_model"] for s in p.get("samples", [p])] for p in profiles]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
