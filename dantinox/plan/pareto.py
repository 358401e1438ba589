"""The throughput trade-off as a Pareto front: output tokens/s per user against output tokens/s per replica.

A deployment can give each user fast tokens (small batches: short TPOT) or a replica many tokens (large
batches: high throughput), not both; the plot of one against the other is the form vLLM's benchmark sweeps and
NVIDIA's AIConfigurator report. Per candidate (simulated, median over the profile samples):
  per user    = 1 / median TPOT (tokens/s one request sees while it decodes);
  per replica = output tokens/s / replicas.
A candidate is on the front when no other candidate is at least as good on both and better on one; the front
is drawn over the candidates that passed (deployable ones), or over all of them when none passed. Along the
recommended deployment's load sweep the same two figures trace its curve as the arrival rate grows.
"""

from __future__ import annotations

from .metrics import round_figure


def candidate_points(rows: list) -> list[dict]:
    """[{"name", "per_user", "per_replica", "passed"}] for every row with simulated metrics and a TPOT (rows in
    the plan's order; figures in tokens/s rounded to 9 significant digits)."""
    out = []
    for r in rows:
        m = r.get("metrics")
        tpot = m and m["tpot"]["p50"]
        if not tpot:
            continue
        out.append({"name": r["candidate"]["name"], "per_user": round_figure(1.0 / tpot),
                    "per_replica": round_figure(m["output_tokens_per_s"] / r["candidate"]["replicas"]),
                    "passed": not r["dropped"]})
    return out


def pareto_front(points: list[dict]) -> list[str]:
    """Names of the points no other point dominates (>= on per_user and per_replica, > on one), sorted by
    per_replica then name. Equal points are all on the front."""
    def dominated(p):
        return any(q["per_user"] >= p["per_user"] and q["per_replica"] >= p["per_replica"]
                   and (q["per_user"] > p["per_user"] or q["per_replica"] > p["per_replica"]) for q in points)
    front = [p for p in points if not dominated(p)]
    return [p["name"] for p in sorted(front, key=lambda p: (p["per_replica"], p["name"]))]


def sweep_points(sweep: list, replicas: int) -> list[dict]:
    """[{"rate_rps", "per_user", "per_replica"}] along a load sweep (recommend.rate_sweep rows with a TPOT)."""
    return [{"rate_rps": s["rate_rps"], "per_user": round_figure(1.0 / s["tpot_p50_s"]),
             "per_replica": round_figure(s["output_tokens_per_s"] / replicas)}
            for s in sweep if s.get("tpot_p50_s")]


def pareto_summary(rows: list, sweep: list, replicas: int) -> dict:
    """{"points", "front", "sweep"}: what plan.json records and the Pareto plot draws; the front over the
    passing candidates (all of them when none passed)."""
    points = candidate_points(rows)
    passed = [p for p in points if p["passed"]] or points
    return {"points": points, "front": pareto_front(passed), "sweep": sweep_points(sweep, replicas)}
