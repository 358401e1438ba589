"""Latency as a distribution: one simulation per profile sample, summarized as a median and an interval.

A profile taken with ``dantinox plan profile --repeats K`` holds K cost models (one per independent profile,
taken minutes apart). The planner simulates every candidate once per cost model; each latency metric then has
K values x_1..x_K and is reported as their median and one of two intervals:

  "t"      the two-sided Student-t interval of the mean at confidence c:
           mean +- t_{(1 + c) / 2, K - 1} x s / sqrt(K), s the sample standard deviation (ddof = 1)
           (the interval AIPerf reports over repeated runs; e.g. NIST/SEMATECH e-Handbook of Statistical
           Methods, section 7.2.2.1). It needs K >= 2.
  "range"  [min x_i, max x_i] (c is not used). It needs K >= 2.

With K identical samples both intervals have zero width. The t interval is clipped to the quantity's own range
(latencies and rates are >= 0, attainment fractions lie in [0, 1]): with K = 3 and a wide spread its low edge can
otherwise fall below zero, a value no run can have. The interval's pessimistic edge (the high end for a
latency) is what the SLO check uses by default. Every float is rounded to 9 significant digits (as metrics.py
does) so the same inputs serialize to the same bytes.
"""

from __future__ import annotations

import math

import numpy as np

from .metrics import round_figure

INTERVAL_METHODS = ("t", "range")


def check_interval_request(samples: int, method: str, confidence: float) -> None:
    """Raise ValueError naming ``method``, ``confidence`` or ``samples`` when an interval cannot be computed:
    an unknown method, a confidence outside (0, 1), or fewer than 2 samples."""
    if method not in INTERVAL_METHODS:
        raise ValueError(f"interval method={method!r} is not allowed: one of {INTERVAL_METHODS}")
    if not isinstance(confidence, (int, float)) or isinstance(confidence, bool) or not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} is not allowed: a number in (0, 1), e.g. 0.9")
    if samples < 2:
        raise ValueError(f"samples={samples}: an interval needs at least 2 profile samples "
                         "(dantinox plan profile --repeats K, K >= 2)")


def interval(values: list, method: str = "t", confidence: float = 0.9, bounds: tuple = (None, None)) -> dict:
    """{"median", "low", "high", "n"} of ``values`` (floats; None entries are dropped; all None -> every field
    None but n). With one value, or method None (a point estimate), low = high = median. ``bounds`` (low, high;
    None: unbounded) is the range the quantity can take; the interval is clipped to it. Raises ValueError for
    an unknown method."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "low": None, "high": None, "n": 0}
    a = np.asarray(xs)
    median = float(np.median(a))
    if len(xs) == 1 or method is None or float(a.max()) == float(a.min()):
        low = high = median
    elif method == "range":
        low, high = float(a.min()), float(a.max())
    elif method == "t":
        from scipy.stats import t as student_t   # here: scipy.stats costs ~0.6 s to import, every CLI start paid it

        half = float(student_t.ppf((1 + confidence) / 2, len(xs) - 1)) * float(a.std(ddof=1)) / math.sqrt(len(xs))
        low, high = float(a.mean()) - half, float(a.mean()) + half
        low = low if bounds[0] is None else max(low, float(bounds[0]))
        high = high if bounds[1] is None else min(high, float(bounds[1]))
    else:
        raise ValueError(f"interval method={method!r} is not allowed: one of {INTERVAL_METHODS}")
    return {"median": round_figure(median), "low": round_figure(low), "high": round_figure(high), "n": len(xs)}


NON_NEGATIVE = (0.0, None)   # seconds, tokens/s, requests/s
FRACTION = (0.0, 1.0)        # SLO attainment
LATENCY_KEYS = tuple(f"{m}_p{p}" for m in ("ttft", "tpot", "itl") for p in (50, 90, 99))


def latency_intervals(runs: list, method: str = "t", confidence: float = 0.9) -> dict:
    """{"ttft_p99": interval, ...} for every LATENCY_KEYS metric over ``runs`` (summarize dicts, one per profile
    sample), plus "output_tokens_per_s", "goodput_rps" and each SLO attainment fraction ("attainment_ttft",
    "attainment_tpot", "attainment_all")."""
    out = {}
    for key in LATENCY_KEYS:
        metric, pct = key.rsplit("_", 1)
        out[key] = interval([r[metric][pct] for r in runs], method, confidence, NON_NEGATIVE)
    for key in ("output_tokens_per_s", "goodput_rps"):
        out[key] = interval([r[key] for r in runs], method, confidence, NON_NEGATIVE)
    for key in ("ttft", "tpot", "all"):
        out[f"attainment_{key}"] = interval([r["slo_attainment"][key] for r in runs], method, confidence, FRACTION)
    return out


def median_metrics(runs: list) -> dict:
    """One metrics dict from several: every number the median over ``runs`` (integers whose median is a whole
    number stay integers; otherwise the median rounded to 9 significant digits), nested dicts merged key by key,
    other values from the first run. One run: that run unchanged."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_metrics([r[k] for r in runs]) for k in first}
    if isinstance(first, bool) or first is None or not isinstance(first, (int, float)):
        return first
    if any(r is None for r in runs):
        return first
    if all(r == first for r in runs):
        return first
    median = float(np.median(np.asarray(runs, float)))
    if all(isinstance(r, int) for r in runs) and median.is_integer():
        return int(median)
    return round_figure(median)


def pessimistic(intervals: dict, key: str, at: str = "edge"):
    """The value the SLO check compares for latency ``key``: the interval's high edge (at="edge") or its median
    (at="median"). Raises ValueError for another ``at``."""
    if at not in ("edge", "median"):
        raise ValueError(f"decide_at={at!r} is not allowed: edge or median")
    return intervals[key]["high" if at == "edge" else "median"]
