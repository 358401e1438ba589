"""The Pareto front of output tokens/s per user (1 / median TPOT) against per replica: dominance by hand-made
points, the candidates' figures from their metrics, and the plan's pareto.png."""

from dantinox.plan.candidate import Candidate
from dantinox.plan.pareto import candidate_points, pareto_front, pareto_summary, sweep_points


def _point(name, per_user, per_replica, passed=True):
    return {"name": name, "per_user": per_user, "per_replica": per_replica, "passed": passed}


def test_front_keeps_exactly_the_undominated_points():
    pts = [_point("fast-user", 200.0, 50.0), _point("balanced", 120.0, 120.0), _point("throughput", 40.0, 300.0),
           _point("worse", 100.0, 100.0),           # dominated by balanced on both
           _point("tie-user", 200.0, 40.0),         # dominated by fast-user (equal per user, lower per replica)
           _point("twin", 120.0, 120.0)]            # equal to balanced: both stay
    assert pareto_front(pts) == ["fast-user", "balanced", "twin", "throughput"]
    assert pareto_front([]) == []


def _row(name, tpot_p50, tokens_per_s, replicas=1, dropped=()):
    return {"candidate": Candidate(name=name, replicas=replicas).to_dict(), "dropped": list(dropped),
            "metrics": {"tpot": {"p50": tpot_p50}, "output_tokens_per_s": tokens_per_s}}


def test_candidate_figures_per_user_and_per_replica():
    rows = [_row("one", 0.004, 180.0), _row("two", 0.002, 180.0, replicas=2), _row("slow", 0.01, 90.0, dropped=["x"]),
            {"candidate": Candidate(name="unsimulated").to_dict(), "dropped": ["memory"], "metrics": None}]
    pts = candidate_points(rows)
    assert pts == [_point("one", 250.0, 180.0), _point("two", 500.0, 90.0), _point("slow", 100.0, 90.0, False)]
    summary = pareto_summary(rows, [{"rate_rps": 4.0, "tpot_p50_s": 0.005, "output_tokens_per_s": 100.0},
                                    {"rate_rps": 8.0, "tpot_p50_s": None, "output_tokens_per_s": 0.0}], 2)
    assert summary["front"] == ["two", "one"]
    fast_but_dropped = rows + [_row("dropped-fast", 0.001, 400.0, dropped=["quality"])]
    assert pareto_summary(fast_but_dropped, [], 1)["front"] == ["two", "one"]     # deployable ones only
    assert pareto_summary([_row("a", 0.01, 9.0, dropped=["x"])], [], 1)["front"] == ["a"]
    assert summary["sweep"] == [{"rate_rps": 4.0, "per_user": 200.0, "per_replica": 50.0}]
    assert sweep_points([], 1) == []
