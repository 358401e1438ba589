"""The load sweep's landmarks: where latency turns up (the knee), where throughput stops keeping up with the
offered load (saturation), and the highest rate that still meets the SLO attainment target (goodput).

Input: the sweep's points in increasing rate, each {"rate_rps", "output_tokens_per_s", "ttft_p99_s",
"attainment_all"} (medians over the profile samples).

  knee         Kneedle (Satopaa, Albrecht, Irwin, Raghavan, "Finding a 'Kneedle' in a Haystack", ICDCS
               Workshops 2011, section III) on p99 TTFT against rate, a convex increasing curve: both axes
               scaled to [0, 1], the knee is the point where (scaled rate - scaled p99 TTFT) is largest;
               None when no point lies below the chord by more than 1e-9 (a straight or concave curve), or
               with fewer than 3 points. With a handful of swept rates it is only as fine as the sweep.
  saturation   the lowest swept rate whose output tokens/s per offered request/s falls below
               SATURATION_FRACTION of the lightest rate's: the engine no longer serves what arrives. None when
               every rate keeps up.
  goodput      DistServe's (Zhong et al., OSDI 2024, section 2): the highest swept rate at which the fraction of
               requests meeting every SLO is at least the target (0.9 by default); None when even the
               lightest rate misses it.
"""

from __future__ import annotations

SATURATION_FRACTION = 0.95


def knee(rates: list, latencies: list):
    """The Kneedle knee's rate (see the module docstring) or None. rates ascending, latencies in seconds."""
    pts = [(x, y) for x, y in zip(rates, latencies) if y is not None]
    if len(pts) < 3:
        return None
    x0, x1 = pts[0][0], pts[-1][0]
    ys = [y for _, y in pts]
    y0, y1 = min(ys), max(ys)
    if x1 <= x0 or y1 <= y0:
        return None
    diffs = [((x - x0) / (x1 - x0) - (y - y0) / (y1 - y0), x) for x, y in pts]
    best, rate = max(diffs, key=lambda d: (d[0], -d[1]))
    return rate if best > 1e-9 else None   # a straight line: every difference 0 up to rounding


def saturation(points: list, fraction: float = SATURATION_FRACTION):
    """The lowest rate whose tokens/s per request/s drops below ``fraction`` of the first point's, or None."""
    if not points or points[0]["rate_rps"] <= 0:
        return None
    base = points[0]["output_tokens_per_s"] / points[0]["rate_rps"]
    for p in points[1:]:
        if p["output_tokens_per_s"] / p["rate_rps"] < fraction * base:
            return p["rate_rps"]
    return None


def goodput_rate(points: list, target: float = 0.9):
    """The highest rate whose "attainment_all" >= target (DistServe's goodput), or None."""
    ok = [p["rate_rps"] for p in points if p.get("attainment_all") is not None and p["attainment_all"] >= target]
    return max(ok) if ok else None


def sweep_landmarks(points: list, target: float = 0.9) -> dict:
    """{"knee_rps", "saturation_rps", "goodput_rps", "attainment_target"} of the sweep's points."""
    return {"knee_rps": knee([p["rate_rps"] for p in points], [p["ttft_p99_s"] for p in points]),
            "saturation_rps": saturation(points), "goodput_rps": goodput_rate(points, target),
            "attainment_target": target}
