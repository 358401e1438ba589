"""Where the simulator's step costs miss: replay a trace on the real engine (wall clock, in process) and compare
each real step's wall time with what the cost model charges for the same device calls.

  python benchmarks/plan_step_fidelity.py [--rate 21.6] [--requests 150] [--seed 0] [--profile P]

For every engine step of the replay the script takes the calls the step made (``PagedEngine.step_calls``) and
prices them as the simulator does: h + s x (their profiled cost) per step kind, plus the wake-up cost and the
cold fraction after idle. Printed: model and wall totals per step kind (forward / multi-step decode), split into
steps right after an idle period and steps of a busy period, then the median wall / model ratio per forward
bucket (B rows, T tokens). A ratio above 1 is time the simulator does not see. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plan_fidelity import make_trace  # noqa: E402

from dantinox.plan.candidate import Candidate  # noqa: E402
from dantinox.plan.cost_model import CostModel  # noqa: E402
from dantinox.plan.inputs import load_model  # noqa: E402
from dantinox.plan.profile import step_cost, take_profile  # noqa: E402
from dantinox.plan.simulate import options_for  # noqa: E402

IDLE = 1e-3   # seconds without a step that count as an idle period


def modelled(cost: CostModel, calls: list, idle: float, warming: float) -> tuple[str, float]:
    """(step kind, seconds the simulator charges for a real step's calls)."""
    multi_step = any(c[0] == "decode" for c in calls)
    return ("decode" if multi_step else "forward"), cost.step_seconds(multi_step, step_cost(cost, calls), idle,
                                                                      warming)


def replay_steps(engine, cost: CostModel, requests: list, prompts: list) -> list:
    """Replay on the wall clock; [(kind, idle seconds before, modelled seconds, wall seconds, first call)]."""
    rows, t0, i, last_end, busy_start, warm_idle = [], time.perf_counter(), 0, 0.0, 0.0, 0.0
    while i < len(requests) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(requests) and requests[i].arrival <= now:
            engine.add_request(prompts[i], options_for(requests[i]), request_id=f"r{requests[i].index}")
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(requests[i].arrival - now, 0.0))
            continue
        start = time.perf_counter() - t0
        idle = start - last_end if start - last_end > IDLE else 0.0
        if idle:
            busy_start, warm_idle = start, idle
        engine.step()
        last_end = time.perf_counter() - t0
        if engine.step_calls:
            warming = warm_idle if start - busy_start < cost.cold_window else 0.0
            kind, model_s = modelled(cost, engine.step_calls, idle, warming)
            rows.append((kind, idle, model_s, last_end - start, engine.step_calls[0]))
    return rows


def report(rows: list) -> None:
    print("| step kind | when | steps | modelled ms | wall ms | wall / modelled (sum) | median |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("forward", "decode"):
        for label, after_idle in (("after idle", True), ("busy", False)):
            sel = [r for r in rows if r[0] == kind and bool(r[1]) == after_idle]
            if sel:
                m, w = np.array([r[2] for r in sel]), np.array([r[3] for r in sel])
                print(f"| {kind} | {label} | {len(sel)} | {m.sum() * 1e3:.1f} | {w.sum() * 1e3:.1f} | "
                      f"{w.sum() / m.sum():.3f} | {np.median(w / m):.3f} |")
    buckets = defaultdict(list)
    for kind, idle, m, w, call in rows:
        if kind == "forward" and not idle:
            buckets[(call[1], call[2])].append(w / m)
    print("\n| forward bucket (B, T), busy | steps | median wall / modelled |\n|---|---|---|")
    for key in sorted(buckets):
        print(f"| {key} | {len(buckets[key])} | {np.median(buckets[key]):.3f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=None)
    p.add_argument("--profile", default=None, help="profile.json (default: profile now)")
    p.add_argument("--rate", type=float, default=21.6, help="requests per second of the trace")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate-first", action="store_true", help="simulate the trace before the replay")
    args = p.parse_args(argv)
    from dantinox.serving.engine import PagedEngine

    run_dir, model, cfg, tok = load_model(args.run_dir)
    prof = json.load(open(args.profile)) if args.profile else take_profile(run_dir, model, cfg)
    cost = CostModel.from_dict(prof["cost_model"])
    engine = PagedEngine(model, Candidate().engine_config())
    engine.warmup()
    with tempfile.TemporaryDirectory() as d:
        requests, prompts = make_trace(cfg, tok, args.rate, args.requests, args.seed, d)
    if args.simulate_first:
        from dantinox.plan.simulate import simulate
        kept = simulate(cfg, Candidate(), cost, requests, prompts)  # noqa: F841  (kept alive, as plan_fidelity does)
    report(replay_steps(engine, cost, requests, prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
