"""Simulator fidelity: the same trace simulated (profiled costs, virtual clock) and replayed on the real engine
(in process, wall clock), at three loads: light, near capacity and overloaded.

  python benchmarks/plan_fidelity.py [--run_dir R] [--profile P] [--requests 60] [--seed 0] [--reprofile]
                                     [--out F.json]

Capacity is found in simulation: the highest of rates 1, 1.5, 2.25, ... requests/s at which the simulated
output tokens/s keep up with the offered output tokens/s (>= 90 %) and p99 TTFT stays under 10 s; the loads
are 0.25x, 0.8x and 1.5x that rate. Each load gets its own mixed trace (chat behind a shared prefix,
documents, the rare Latin/Occitan slice when ../shared/data is present). Printed: p99 TTFT, p50 TPOT and
output tokens/s, simulated against replayed, with the relative error. The target is within 10 % at light and
near-capacity load. Each load is replayed --replays times (the simulation is compared with the median; the
range shows the replay's own spread). Run it on a quiet machine: on a shared host the replay absorbs other
processes' time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dantinox.plan.candidate import Candidate  # noqa: E402
from dantinox.plan.cost_model import CostModel  # noqa: E402
from dantinox.plan.inputs import load_model, load_trace  # noqa: E402
from dantinox.plan.replay import replay_realtime  # noqa: E402
from dantinox.plan.simulate import simulate  # noqa: E402
from dantinox.plan.trace import TraceSpec, default_classes, generate_trace, trace_text  # noqa: E402

# ../shared/data beside the repository, as the project lays it out
RARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                    "slices-rare-latin-occitan.txt")
METRICS = (("p99 TTFT ms", lambda m: m["ttft"]["p99"] * 1e3), ("p50 TPOT ms", lambda m: m["tpot"]["p50"] * 1e3),
           ("output tok/s", lambda m: m["output_tokens_per_s"]))


def make_trace(cfg, tok, rate, n, seed, directory):
    rare = RARE if os.path.exists(RARE) else None
    recs = generate_trace(TraceSpec(requests=n, rate=rate, classes=default_classes(rare), seed=seed,
                                    max_context=cfg.max_context))
    path = os.path.join(directory, f"trace_{rate:.3f}.jsonl")
    with open(path, "w") as f:
        f.write(trace_text(recs))
    return load_trace(path, cfg, tok)


def find_capacity(cfg, tok, cost, cand, n, seed, directory) -> float:
    rate, best = 1.0, 1.0
    for _ in range(12):
        reqs, prompts = make_trace(cfg, tok, rate, n, seed, directory)
        m = simulate(cfg, cand, cost, reqs, prompts)
        offered = sum(q.max_tokens for q in reqs) / max(reqs[-1].arrival, 1e-9)
        if m["output_tokens_per_s"] < 0.9 * offered or m["ttft"]["p99"] > 10:
            break
        best, rate = rate, rate * 1.5
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=None)
    p.add_argument("--profile", default=None, help="profile.json (default: profile now)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--replays", type=int, default=3,
                   help="replays per load; the simulation is compared with their median (the spread is printed)")
    p.add_argument("--reprofile", action="store_true",
                   help="profile again right before each load's replay (the host's speed drifts on a shared machine)")
    args = p.parse_args(argv)
    from dantinox.serving.engine import PagedEngine

    run_dir, model, cfg, tok = load_model(args.run_dir)
    if args.profile:
        prof = json.load(open(args.profile))
    else:
        from dantinox.plan.profile import take_profile
        prof = take_profile(run_dir, model, cfg)
    cost = CostModel.from_dict(prof["cost_model"])
    cand = Candidate()
    engine = PagedEngine(model, cand.engine_config())
    engine.warmup()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        cap = find_capacity(cfg, tok, cost, cand, args.requests, args.seed, d)
        for label, factor in (("light", 0.25), ("near capacity", 0.8), ("overloaded", 1.5)):
            reqs, prompts = make_trace(cfg, tok, cap * factor, args.requests, args.seed, d)
            if args.reprofile:
                from dantinox.plan.profile import take_profile
                cost = CostModel.from_dict(take_profile(run_dir, model, cfg)["cost_model"])
            sim = simulate(cfg, cand, cost, reqs, prompts)
            reals = []
            for _ in range(args.replays):
                reals.append(replay_realtime(engine, reqs, prompts))
                engine.allocator.pool.forget_all_hashes()   # every replay starts with a cold prefix cache
            rows.append({"load": label, "rate_rps": round(cap * factor, 3),
                         **{name: (f(sim), float(np.median([f(r) for r in reals])), [f(r) for r in reals])
                            for name, f in METRICS},
                         "preemptions": (sim["preemptions"], [r["preemptions"] for r in reals])})
    print(f"capacity (simulated): {cap:.2f} requests/s; {args.requests} requests per load; "
          f"replay: median of {args.replays} [their range]")
    print("| load | rate (req/s) | " + " | ".join(f"{n} sim / replay [range] (err)" for n, _ in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for r in rows:
        cells = [f"{r[n][0]:.1f} / {r[n][1]:.1f} [{min(r[n][2]):.1f}-{max(r[n][2]):.1f}] "
                 f"({(r[n][0] - r[n][1]) / r[n][1]:+.0%})" for n, _ in METRICS]
        print(f"| {r['load']} | {r['rate_rps']} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"capacity_rps": cap, "rows": rows, "cost_model": prof["cost_model"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
