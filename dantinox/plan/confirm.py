"""Confirmation: replay the plan's best candidates on the real engine and keep the recommendation only if the
measured latencies meet the SLO.

``dantinox plan --confirm N --confirm-repeats R`` takes the N cheapest candidates that passed in simulation
(in the plan's ranking: cost per million output tokens, then name) and the baseline, replays the trace through
each R times (``confirm_replay.EngineReplayer``), and summarizes each candidate's R measurements as a median
and an interval (uncertainty.interval with the plan's own method and confidence; a point estimate when R = 1).
A candidate is **confirmed** when its measured
metrics meet every SLO at the measured interval's pessimistic edge (recommend.slo_failures with
decide_at="edge") and no request was rejected. The first confirmed candidate in ranking order becomes the
recommendation; when none is confirmed, the plan falls back as it does when nothing passes in simulation (the
last known-good plan, else the named baseline) and says so. The baseline is measured for reference and is
never itself the confirmation of the recommendation unless it is one of the N.

This module is host-side: ``measure`` is any callable Candidate -> metrics dict (metrics.summarize's form),
so the rule is tested with synthetic measurements and no device.
"""

from __future__ import annotations

from .candidate import Candidate
from .load_sweep import sweep_landmarks
from .pareto import pareto_summary
from .recommend import evaluate_candidate, fallback_choice, rate_sweep, slo_failures
from .uncertainty import latency_intervals, median_metrics

SUMMARY_KEYS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


def ranked_passing(rows: list) -> list[dict]:
    """Rows that passed in simulation (nothing dropped, a cost), cheapest first (cost per million output tokens,
    then name): the order candidates are confirmed in."""
    passing = [r for r in rows if not r["dropped"] and r["cost_per_million_usd"] is not None]
    return sorted(passing, key=lambda r: (r["cost_per_million_usd"], r["candidate"]["name"]))


def clamp_confirm(n: int, passing: int) -> tuple[int, str | None]:
    """(how many to confirm, a warning or None). ValueError naming --confirm for n < 1; n above the number of
    passing candidates is clamped with a warning."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"--confirm={n!r} is not allowed: an integer >= 1 (candidates to replay on the engine)")
    if n > passing:
        return passing, (f"--confirm {n}: only {passing} candidate(s) passed in simulation; confirming "
                         f"{passing}")
    return n, None


def measured_summary(runs: list, slo: dict, method: str | None, confidence: float) -> dict:
    """One candidate's R replays: {"repeats", "metrics" (median over the replays), "intervals" (their
    interval per latency metric), "failures" (slo_failures at the interval's high edge), "confirmed"}."""
    metrics = median_metrics(runs)
    intervals = latency_intervals(runs, method if len(runs) >= 2 else None, confidence)
    failures = slo_failures(metrics, slo, intervals, "edge")
    return {"repeats": len(runs), "metrics": metrics, "intervals": intervals, "failures": failures,
            "confirmed": not failures}


def _predicted(row: dict) -> dict:
    iv = row.get("intervals") or {}
    return {k: {"median": iv.get(k, {}).get("median"), "high": iv.get(k, {}).get("high")} for k in SUMMARY_KEYS}


def confirm_candidates(rows: list, recommendation: dict, slo: dict, n: int, repeats: int, measure,
                       method: str | None = "t", confidence: float = 0.9, baseline: str = "baseline") -> dict:
    """Replay the ``n`` best passing candidates (and the ``baseline`` row, when present and not among them)
    ``repeats`` times each through ``measure`` (Candidate -> metrics dict). Returns {"n", "repeats",
    "warning", "results": [{"name", "role" ("candidate" or "baseline"), "predicted", "measured"}],
    "confirmed": the first confirmed candidate's name or None, "simulated_recommendation"}.
    Raises ValueError naming --confirm / --confirm-repeats for a bad count."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"--confirm-repeats={repeats!r} is not allowed: an integer >= 1 (replays per candidate)")
    passing = ranked_passing(rows)
    count, warning = clamp_confirm(n, len(passing))
    chosen = [(r, "candidate") for r in passing[:count]]
    named = [r for r in rows if r["candidate"]["name"] == baseline and r["metrics"] is not None]
    if named and all(r["candidate"]["name"] != baseline for r, _ in chosen):
        chosen.append((named[0], "baseline"))
    results, confirmed = [], None
    for row, role in chosen:
        cand = Candidate.from_dict(row["candidate"])
        runs = [measure(cand) for _ in range(repeats)]
        summary = measured_summary(runs, slo, method, confidence)
        results.append({"name": cand.name, "role": role, "predicted": _predicted(row), "measured": summary})
        if role == "candidate" and summary["confirmed"] and confirmed is None:
            confirmed = cand.name
    return {"n": count, "repeats": repeats, "warning": warning, "results": results, "confirmed": confirmed,
            "simulated_recommendation": recommendation["name"]}


def confirmed_recommendation(rows: list, confirmation: dict, fallback: dict) -> dict:
    """The recommendation after confirmation: the confirmed candidate (``"confirmed": True``), or ``fallback``
    (recommend.choose's fallback dict for the same plan) marked ``"confirmed": False`` with the reason that
    no replayed candidate met the SLO on the engine."""
    name = confirmation["confirmed"]
    if name is not None:
        row = next(r for r in rows if r["candidate"]["name"] == name)
        moved = "" if name == confirmation["simulated_recommendation"] else (
            f"; {confirmation['simulated_recommendation']!r} was cheaper in simulation but missed the SLO on the "
            "engine")
        return {"name": name, "candidate": row["candidate"], "fallback": False, "confirmed": True,
                "reason": f"cheapest candidate confirmed on the real engine ({confirmation['repeats']} replays)"
                          f"{moved}"}
    tried = ", ".join(r["name"] for r in confirmation["results"] if r["role"] == "candidate") or "none"
    return dict(fallback, fallback=True, confirmed=False,
                reason=f"no replayed candidate ({tried}) met the SLO on the real engine: {fallback['reason']}")


def apply_confirmation(result: dict, confirmation: dict, inp) -> dict:
    """make_plan's ``result`` with the confirmation recorded and the recommendation replaced by
    confirmed_recommendation's; when the recommendation moves, its load sweep is recomputed, and a fallback not
    among the rows is evaluated (as make_plan does). inp: the plan's recommend.PlanInputs."""
    rows = result["candidates"]
    rec = confirmed_recommendation(rows, confirmation, fallback_choice(rows, inp.baseline, inp.last_good))
    out = dict(result, confirmation=confirmation, recommendation=rec)
    if rec["fallback"] and all(r["candidate"]["name"] != rec["name"] for r in rows):
        row = evaluate_candidate(inp, Candidate.from_dict(rec["candidate"]))
        row["notes"].append("the fallback, not among the swept candidates")
        out["candidates"] = rows + [row]
    if rec["name"] != result["recommendation"]["name"]:
        out["rate_sweep"] = rate_sweep(inp, Candidate.from_dict(rec["candidate"]))
        out["load_sweep"] = sweep_landmarks(out["rate_sweep"], inp.attainment_target)
        out["pareto"] = pareto_summary(out["candidates"], out["rate_sweep"], rec["candidate"]["replicas"])
    return out
