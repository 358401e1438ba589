"""One profile, one replay, three simulations: does the step-time spread close the simulator's p99 TTFT gap?

  python benchmarks/plan_spread.py [--rate 21.6] [--requests 150] [--seed 0] [--run_dir R] [--max-context N]

Takes a one-sample profile of the model's engine (the planner's ``take_profile``), replays a trace of the given
rate on a warmed-up engine on the wall clock (``replay_realtime``), then simulates the same trace from that
profile three times: with the profile's step-time spread (``CostModel.forward_spread`` / ``decode_spread``) drawn
with the fitted step-to-step correlation (``spread_correlation``), with the spread drawn independently, and
without it (every step at its calibrated mean). Prints p50 / p90 / p99 TTFT, p50 TPOT and output tokens/s of
the three, and the steps each ran. Same process, minutes apart: the comparison is not blurred by a profile
taken at another time. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plan_fidelity import make_trace  # noqa: E402

from dantinox.plan.candidate import Candidate  # noqa: E402
from dantinox.plan.cost_model import CostModel  # noqa: E402
from dantinox.plan.inputs import load_model  # noqa: E402
from dantinox.plan.profile import take_profile  # noqa: E402
from dantinox.plan.replay import replay_realtime  # noqa: E402
from dantinox.plan.simulate import simulate  # noqa: E402
from dantinox.serving.engine import PagedEngine  # noqa: E402


def row(name: str, m: dict) -> str:
    return (f"| {name} | {m['ttft']['p50'] * 1e3:.1f} | {m['ttft']['p90'] * 1e3:.1f} | {m['ttft']['p99'] * 1e3:.1f} "
            f"| {m['tpot']['p50'] * 1e3:.3f} | {m['output_tokens_per_s']:.1f} |")


def one_sample_setup(args):
    """(cfg, cost model, warmed-up PagedEngine, trace requests, prompts) for --run_dir / --max-context: a
    one-sample profile (the planner's take_profile), the default candidate's engine, and the mixed trace of
    plan_fidelity.py at --rate with --requests and --seed. plan_requests.py starts the same way."""
    run_dir, model, cfg, tok = load_model(args.run_dir, args.max_context)
    cost = CostModel.from_dict(take_profile(run_dir, model, cfg)["cost_model"])
    engine = PagedEngine(model, Candidate().engine_config())
    engine.warmup()
    with tempfile.TemporaryDirectory() as d:
        requests, prompts = make_trace(cfg, tok, args.rate, args.requests, args.seed, d)
    return cfg, cost, engine, requests, prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=None)
    p.add_argument("--rate", type=float, default=21.6, help="requests per second of the trace")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context", type=int, default=None, help="serve with an N-token context (plan --max-context)")
    args = p.parse_args(argv)
    cfg, cost, engine, requests, prompts = one_sample_setup(args)
    real = replay_realtime(engine, requests, prompts)
    independent = dataclasses.replace(cost, spread_correlation=0.0)
    flat = dataclasses.replace(cost, forward_spread=(), decode_spread=(), spread_correlation=0.0)
    sims = {name: simulate(cfg, Candidate(), c, requests, prompts)
            for name, c in (("correlated", cost), ("independent", independent), ("mean", flat))}
    print(f"spread quantiles 0/25/50/75/100 %: forward {[round(x, 2) for x in cost.forward_spread[::5]]}, "
          f"decode {[round(x, 2) for x in cost.decode_spread[::5]]}; lag-1 correlation {cost.spread_correlation:.2f}")
    print("| run | p50 TTFT ms | p90 TTFT ms | p99 TTFT ms | p50 TPOT ms | output tok/s |\n|---|---|---|---|---|---|")
    for name, m in (("replay", real), ("simulated, spread, correlated", sims["correlated"]),
                    ("simulated, spread, independent", sims["independent"]), ("simulated, mean steps", sims["mean"])):
        print(row(name, m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
