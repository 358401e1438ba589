"""Simulated against replayed, cell by cell: does the plan's predicted interval hold the real engine's numbers?

A fidelity sitting (``benchmarks/plan_fidelity.py``) simulates a trace once per profile sample (the plan's
median and interval, ``uncertainty.latency_intervals``) and replays it R times on the real engine. Each
(load, metric) pair is a cell:

  inside     the replays' median lies in the predicted interval [low, high]
  gap        (predicted median - replay median) / replay median
  spread     the replay's own repeat-run spread: max |r_i - replay median| / replay median over the R replays
  tolerance  for a latency, max(spread, 10 %); for output tokens/s, 5 %
  gap_ok     |gap| <= tolerance

The verdict (issue 22's acceptance) is taken over the cells at the judged loads (light and near capacity):
at least 80 % of the latency cells (p99 TTFT, p50 TPOT) inside, every latency cell's gap within its
tolerance, and every output tokens/s cell within 5 %. The median |gap| over the latency cells is reported too.
Cells from several sittings (or models) are judged together by passing them all. The idea of quoting a
simulator's gap against the real system's repeat-run spread is SGLang's; the interval is the plan's own.
"""

from __future__ import annotations

import numpy as np

LATENCY_METRICS = ("ttft_p99", "tpot_p50")
THROUGHPUT_METRIC = "output_tokens_per_s"
JUDGED_LOADS = ("light", "near capacity")
INSIDE_FRACTION = 0.8
GAP_FLOOR = 0.10
THROUGHPUT_TOLERANCE = 0.05


def replay_spread(values: list) -> float:
    """max |v - median| / median over ``values`` (floats, at least one; 0.0 when the median is 0)."""
    med = float(np.median(values))
    return 0.0 if med == 0 else float(max(abs(v - med) for v in values) / abs(med))


def fidelity_cell(load: str, metric: str, predicted: dict, replays: list) -> dict:
    """One cell: ``predicted`` an interval dict {"median", "low", "high"} (any unit; None edges count as not
    inside), ``replays`` the R replays' values of the same metric in the same unit (R >= 1). Returns
    {"load", "metric", "predicted", "replay": {"median", "low", "high", "values"}, "inside", "gap", "spread",
    "tolerance", "gap_ok"}. Raises ValueError naming ``replays`` when it is empty."""
    if not replays:
        raise ValueError(f"replays={replays!r}: at least one replay value is required")
    med = float(np.median(replays))
    low, high, pred = predicted.get("low"), predicted.get("high"), predicted.get("median")
    inside = low is not None and high is not None and low <= med <= high
    gap = None if pred is None or med == 0 else (pred - med) / med
    spread = replay_spread(replays)
    tolerance = THROUGHPUT_TOLERANCE if metric == THROUGHPUT_METRIC else max(spread, GAP_FLOOR)
    return {"load": load, "metric": metric, "predicted": {"median": pred, "low": low, "high": high},
            "replay": {"median": med, "low": float(min(replays)), "high": float(max(replays)),
                       "values": [float(v) for v in replays]},
            "inside": bool(inside), "gap": gap, "spread": spread, "tolerance": tolerance,
            "gap_ok": gap is not None and abs(gap) <= tolerance}


def fidelity_verdict(cells: list, loads: tuple = JUDGED_LOADS) -> dict:
    """The acceptance over ``cells`` (fidelity_cell dicts) at ``loads``: {"latency_cells", "inside",
    "inside_ok", "gaps_within", "gaps_ok", "median_abs_gap", "throughput_cells", "throughput_within",
    "throughput_ok", "passed"}. No judged latency cell: not passed."""
    judged = [c for c in cells if c["load"] in loads]
    lat = [c for c in judged if c["metric"] in LATENCY_METRICS]
    thr = [c for c in judged if c["metric"] == THROUGHPUT_METRIC]
    inside = sum(c["inside"] for c in lat)
    gaps = sum(c["gap_ok"] for c in lat)
    thr_ok = sum(c["gap_ok"] for c in thr)
    abs_gaps = [abs(c["gap"]) for c in lat if c["gap"] is not None]
    verdict = {"latency_cells": len(lat), "inside": inside, "inside_ok": bool(lat) and inside >= INSIDE_FRACTION
               * len(lat), "gaps_within": gaps, "gaps_ok": bool(lat) and gaps == len(lat),
               "median_abs_gap": float(np.median(abs_gaps)) if abs_gaps else None,
               "throughput_cells": len(thr), "throughput_within": thr_ok, "throughput_ok": thr_ok == len(thr)}
    verdict["passed"] = verdict["inside_ok"] and verdict["gaps_ok"] and verdict["throughput_ok"]
    return verdict
