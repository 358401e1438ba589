"""Per request and per step: the simulator against the real engine on the same trace (where does p99 TTFT go?).

  python benchmarks/plan_requests.py [--rate 21.6] [--requests 150] [--seed 0] [--run_dir R] [--max-context N]
                                     [--tail 0.05] [--out F.json]

Takes a one-sample profile (the planner's ``take_profile``), replays the mixed trace of ``plan_fidelity.py`` at
--rate on a warmed-up engine on the wall clock, recording every engine step (start, end, its calls
``PagedEngine.step_calls``, the chunks it ran), then simulates the same trace from that profile twice (with the
profile's step-time spread, and every step at its calibrated mean), recording every simulated step (start, its
calls' profiled seconds, idle before it, the wake-up and cold terms, the spread factor). Prints, for the requests
whose replayed TTFT is in the slowest --tail fraction: the replayed and simulated TTFT, and the steps between the
request's arrival and its first token on both sides (what each cost: measured wall time against the cost model's
price of the same calls, h + s x calls plus the wake-up after the idle time the real engine saw). Then the
decomposition over all requests: the TTFT gap (replay - simulated mean) split into the time the request waited
before its first step and the time of the steps up to its first token. Same process, minutes apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plan_spread import one_sample_setup  # noqa: E402

import dantinox.plan.simulate as simulate_mod  # noqa: E402
from dantinox.plan.candidate import Candidate  # noqa: E402
from dantinox.plan.cost_model import CostModel  # noqa: E402
from dantinox.plan.metrics import per_request  # noqa: E402
from dantinox.plan.profile import _run_workload, step_cost  # noqa: E402
from dantinox.plan.replay import replay_realtime  # noqa: E402


def _chunks(sched) -> list:
    return [(c.request.request_id, c.start, c.num_tokens) for c in sched.chunks]


def replay_steps(engine, requests, prompts) -> tuple[dict, list]:
    """Replay on the wall clock; returns (metrics with records, [step dicts: start, end, calls, chunks]) with
    times relative to the replay's start."""
    steps, schedule, step = [], engine.scheduler.schedule, engine.step
    last = {}

    def traced_schedule():
        sched = schedule()
        last["chunks"] = _chunks(sched)
        return sched

    def traced_step():
        t0 = time.perf_counter()
        out = step()
        t1 = time.perf_counter()
        steps.append({"start": t0, "end": t1, "calls": list(engine.step_calls), "chunks": last.pop("chunks", []),
                      "emitted": any(o.new_token_ids for o in out)})
        return out

    engine.scheduler.schedule, engine.step = traced_schedule, traced_step
    try:
        real = replay_realtime(engine, requests, prompts)
    finally:
        del engine.scheduler.schedule, engine.step
    # the replay's clock: a step's end is its tokens' time (to within the microseconds after step())
    offset = _offset(steps, real["records"])
    for s in steps:
        s["start"], s["end"] = s["start"] - offset, s["end"] - offset
    return real, steps


def _offset(steps: list, records: list) -> float:
    """perf_counter() at the replay's start: the end of the first step that gave a request its first token,
    minus that token's time."""
    firsts = {r.token_times[0]: r for r in records if r.token_times}
    t_first = min(firsts)
    # the first step that emitted anything ends at the earliest token time
    for s in steps:
        if s["emitted"]:
            return s["end"] - t_first
    raise RuntimeError("no step ran")


def simulate_steps(cfg, cost, requests, prompts) -> tuple[dict, list]:
    """simulate() with every step recorded: start, seconds, calls' seconds, idle, warming, draw, chunks."""
    steps, start_step, step_seconds = [], simulate_mod._start_step, CostModel.step_seconds
    ctx = {}

    def traced_start(rep, now, records):
        ctx["now"] = now
        return start_step(rep, now, records)

    def traced_seconds(self, multi_step, calls, idle=0.0, warming=0.0, draw=None):
        out = step_seconds(self, multi_step, calls, idle, warming, draw)
        steps.append({"start": ctx["now"], "end": ctx["now"] + out, "multi_step": multi_step, "calls_s": calls,
                      "idle": idle, "warming": warming, "wake_s": self.wake_cost(idle),
                      "cold": self.cold_fraction(warming),
                      "factor": 1.0 if draw is None else self.spread_factor(multi_step, draw)})
        return out

    orig_schedule = simulate_mod.Scheduler.schedule

    def traced_schedule(self):
        sched = orig_schedule(self)
        ctx["chunks"] = _chunks(sched)
        return sched

    simulate_mod._start_step, CostModel.step_seconds = traced_start, traced_seconds
    simulate_mod.Scheduler.schedule = traced_schedule
    try:
        n = [0]
        orig = simulate_mod.SimReplica.step

        def rstep(self, idle=0.0, warming=0.0):
            out = orig(self, idle, warming)
            steps[n[0]]["chunks"] = ctx.pop("chunks")
            n[0] += 1
            return out
        simulate_mod.SimReplica.step = rstep
        m = simulate_mod.simulate(cfg, Candidate(), cost, requests, prompts)
    finally:
        simulate_mod._start_step, CostModel.step_seconds = start_step, step_seconds
        simulate_mod.Scheduler.schedule, simulate_mod.SimReplica.step = orig_schedule, orig
    return m, steps


def priced(cost: CostModel, s: dict, idle: float) -> float:
    """The cost model's seconds for a real step's calls (mean spread, wake-up after ``idle`` seconds)."""
    multi = any(c[0] == "decode" for c in s["calls"])
    return cost.step_seconds(multi, step_cost(cost, s["calls"]), idle)


def request_steps(steps: list, rid: str, arrival: float, first: float) -> list:
    """Steps overlapping [arrival, first token]."""
    return [s for s in steps if s["end"] > arrival - 1e-9 and s["start"] < first - 1e-9]


def describe(s: dict, rid: str) -> str:
    mine = [c for c in s["chunks"] if c[0] == rid]
    kind = f"own {mine[0][1]}+{mine[0][2]}" if mine else f"other x{len(s['chunks'])}"
    return f"{s['start'] * 1e3:8.2f} +{(s['end'] - s['start']) * 1e3:6.2f} ({kind})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=None)
    p.add_argument("--rate", type=float, default=21.6)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--tail", type=float, default=0.05)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg, cost, engine, requests, prompts = one_sample_setup(args)
    real, rsteps = replay_steps(engine, requests, prompts)
    calib = [_run_workload(engine, tag, cost) for tag in ("after", "again")]   # the calibration, same engine
    for kind in ("forward", "decode"):
        pairs = [(p, w) for run in calib for k, p, w in run if k == kind]
        h, s = (cost.forward_overhead, cost.scale) if kind == "forward" else (cost.decode_overhead, cost.decode_scale)
        print(f"calibration workload after the replay, {kind}: {len(pairs)} steps, wall / priced "
              f"{sum(w for _, w in pairs) / sum(h + s * p for p, _ in pairs):.2f}")
    flat = dataclasses.replace(cost, forward_spread=(), decode_spread=(), spread_correlation=0.0)
    sim, ssteps = simulate_steps(cfg, cost, requests, prompts)
    mean, msteps = simulate_steps(cfg, flat, requests, prompts)
    report(cost, requests, prompts, real, rsteps, sim, ssteps, mean, msteps, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cost_model": cost.to_dict(), "replay_steps": rsteps, "sim_steps": ssteps,
                       "mean_steps": msteps,
                       "requests": [{"rid": f"r{q.index}", "arrival": q.arrival, "prompt": len(ids),
                                     "max_tokens": q.max_tokens} for q, ids in zip(requests, prompts)],
                       "ttft": {name: {f"r{r.index}": per_request(r)[0] for r in m["records"]}
                                for name, m in (("replay", real), ("sim", sim), ("mean", mean))}}, f)
    return 0


def report(cost, requests, prompts, real, rsteps, sim, ssteps, mean, msteps, args) -> None:
    ttft = {name: {f"r{r.index}": per_request(r)[0] for r in m["records"]}
            for name, m in (("replay", real), ("sim", sim), ("mean", mean))}
    print(f"p99 TTFT ms: replay {real['ttft']['p99'] * 1e3:.1f}, sim {sim['ttft']['p99'] * 1e3:.1f}, "
          f"sim at mean steps {mean['ttft']['p99'] * 1e3:.1f}; p50: {real['ttft']['p50'] * 1e3:.1f} / "
          f"{sim['ttft']['p50'] * 1e3:.1f} / {mean['ttft']['p50'] * 1e3:.1f}")
    print(f"steps: replay {len(rsteps)}, sim {len(ssteps)}; busy s: replay "
          f"{sum(s['end'] - s['start'] for s in rsteps):.3f}, sim {sum(s['end'] - s['start'] for s in ssteps):.3f},"
          f" mean {sum(s['end'] - s['start'] for s in msteps):.3f}")
    # real steps priced by the model, by kind and by idle before
    prev_end, rows = 0.0, []
    for s in rsteps:
        idle = max(s["start"] - prev_end, 0.0)
        rows.append((s, idle, s["end"] - s["start"], priced(cost, s, idle if idle > 1e-3 else 0.0)))
        prev_end = s["end"]
    for label, sel in (("after idle > 1 ms", lambda r: r[1] > 1e-3), ("busy", lambda r: r[1] <= 1e-3)):
        for kind in ("forward", "decode"):
            sub = [r for r in rows if sel(r) and any(c[0] == "decode" for c in r[0]["calls"]) ==
                   (kind == "decode")]
            if sub:
                w, pr = sum(r[2] for r in sub), sum(r[3] for r in sub)
                print(f"real steps {label:18s} {kind:8s}: {len(sub):4d}, wall {w * 1e3:8.1f} ms, priced "
                      f"{pr * 1e3:8.1f} ms, ratio {w / pr:.2f}")
    by_previous(rows)
    ids = {f"r{q.index}": (q, len(p)) for q, p in zip(requests, prompts)}
    order = sorted(ttft["replay"], key=lambda r: -(ttft["replay"][r] or 0))
    tail = order[:max(1, int(round(args.tail * len(order))))]
    print(f"\nslowest {len(tail)} requests by replayed TTFT:")
    for rid in tail:
        q, n = ids[rid]
        print(f"{rid}: arrival {q.arrival * 1e3:.1f} ms, prompt {n}, max_tokens {q.max_tokens}; TTFT ms replay "
              f"{ttft['replay'][rid] * 1e3:.1f}, sim {ttft['sim'][rid] * 1e3:.1f}, mean {ttft['mean'][rid] * 1e3:.1f}")
        first = q.arrival + ttft["replay"][rid]
        for s in request_steps(rsteps, rid, q.arrival, first):
            r = next(r for r in rows if r[0] is s)
            print(f"   real {describe(s, rid)} idle {r[1] * 1e3:6.2f} priced {r[3] * 1e3:6.2f} calls {s['calls']}")
        first = q.arrival + ttft["mean"][rid]
        for s in request_steps(msteps, rid, q.arrival, first):
            print(f"   sim  {describe(s, rid)} idle {s['idle'] * 1e3:6.2f} calls_s {s['calls_s'] * 1e3:6.2f} "
                  f"wake {s['wake_s'] * 1e3:5.2f} cold {s['cold']:.2f}")
    decompose(ids, ttft, rsteps, msteps)


def by_previous(rows: list) -> None:
    """Real steps without idle before them: wall / priced by their kind and the kind of the step before."""
    groups: dict = {}
    for (s, _, _, _), (s2, idle, wall, price) in zip(rows, rows[1:]):
        if idle > 1e-3:
            continue
        key = tuple("decode" if any(c[0] == "decode" for c in x["calls"]) else "forward" for x in (s2, s))
        g = groups.setdefault(key, [0, 0.0, 0.0])
        g[0], g[1], g[2] = g[0] + 1, g[1] + wall, g[2] + price
    for (kind, prev), (n, wall, price) in sorted(groups.items()):
        print(f"real busy {kind:7s} steps after a {prev:7s} step: {n:4d}, wall / priced {wall / price:.2f}")


def decompose(ids, ttft, rsteps, msteps) -> None:
    """Mean TTFT over all requests and over the slowest 5 %: wait before the request's first own step, and
    the rest (its own steps and what ran between them)."""
    def split(steps, rid, arrival, t):
        own = [s for s in steps if any(c[0] == rid for c in s["chunks"])]
        start = own[0]["start"] if own else arrival + t
        return max(start - arrival, 0.0), arrival + t - start, len(own)
    print("\ndecomposition, ms (mean over requests): wait before first own step | first own step to first token")
    order = sorted(ttft["replay"], key=lambda r: -(ttft["replay"][r] or 0))
    for label, rids in (("all", order), ("slowest 5 %", order[:max(1, len(order) // 20)])):
        real = np.array([split(rsteps, r, ids[r][0].arrival, ttft["replay"][r])[:2] for r in rids])
        sim = np.array([split(msteps, r, ids[r][0].arrival, ttft["mean"][r])[:2] for r in rids])
        print(f"{label:12s} replay {real[:, 0].mean() * 1e3:6.2f} | {real[:, 1].mean() * 1e3:6.2f}   sim(mean) "
              f"{sim[:, 0].mean() * 1e3:6.2f} | {sim[:, 1].mean() * 1e3:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
