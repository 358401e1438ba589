"""Serving metrics of one run (simulated or replayed), from per-request token times.

TTFT: first token time - arrival (seconds). TPOT: (last token - first token) / (output tokens - 1), per
request with >= 2 tokens. ITL: every gap between consecutive tokens of a request (a multi-step decode call
delivers several tokens at once, so gaps of 0 are real). Output tokens/s: all output tokens / (last token
time - first arrival). Goodput: requests meeting every SLO per second over the same span (DistServe's unit,
Zhong et al., OSDI 2024, section 2; DistServe then quotes the highest rate whose attainment meets a target, which
the load sweep gives: load_sweep.py). SLO attainment: the fraction of all requests (rejected ones count as
missing) whose own TTFT, own TPOT, and both, are within the SLO bounds. Percentiles are
numpy's linear interpolation. Every float is rounded to 9 significant digits so equal runs serialize to equal
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's life: arrival (s), token_times (s, one per output token), slice, replica, rejected."""

    index: int
    arrival: float
    slice: str
    replica: int = 0
    token_times: list = field(default_factory=list)
    rejected: str | None = None
    preemptions: int = 0


def round_figure(x: float) -> float:
    """x rounded to 9 significant digits, so the same inputs serialize to the same bytes."""
    return float(f"{float(x):.9g}")


def _pcts(values: list) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    a = np.asarray(values, float)
    return {f"p{p}": round_figure(np.percentile(a, p)) for p in PERCENTILES}


def per_request(rec: RequestRecord) -> tuple:
    """(ttft or None, tpot or None, [itl gaps]) of one record."""
    t = rec.token_times
    if not t:
        return None, None, []
    tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
    return t[0] - rec.arrival, tpot, [b - a for a, b in zip(t, t[1:])]


def meets_slo(rec: RequestRecord, slo: dict) -> bool:
    """True when the request finished and its TTFT and TPOT are within slo {"ttft_p99": s, "tpot_p99": s}
    (a request's own values against the SLO bounds)."""
    ttft, tpot, _ = per_request(rec)
    if ttft is None or rec.rejected:
        return False
    return ttft <= slo.get("ttft_p99", float("inf")) and (tpot is None or tpot <= slo.get("tpot_p99", float("inf")))


def slo_attainment(records: list[RequestRecord], slo: dict) -> dict:
    """{"ttft", "tpot", "all"}: the fraction of ``records`` (0.0 with none) whose own TTFT / TPOT / both meet
    ``slo`` {"ttft_p99": s, "tpot_p99": s} (a missing bound is met; a request with one token meets TPOT;
    a rejected or unfinished request meets neither)."""
    inf = float("inf")
    counts = {"ttft": 0, "tpot": 0, "all": 0}
    for rec in records:
        ttft, tpot, _ = per_request(rec)
        if ttft is None or rec.rejected:
            continue
        a = ttft <= slo.get("ttft_p99", inf)
        b = tpot is None or tpot <= slo.get("tpot_p99", inf)
        counts["ttft"] += a
        counts["tpot"] += b
        counts["all"] += a and b
    return {k: round_figure(v / len(records)) if records else 0.0 for k, v in counts.items()}


def summarize(records: list[RequestRecord], slo: dict | None = None, counters: dict | None = None) -> dict:
    """The metrics dict of a run (see the module docstring); ``counters`` (preemptions, prefix hits, peak
    blocks, queue lengths) are merged in as given."""
    slo = slo or {}
    done = [r for r in records if r.token_times and not r.rejected]
    ttfts, tpots, itls = [], [], []
    for r in done:
        a, b, c = per_request(r)
        ttfts.append(a)
        if b is not None:
            tpots.append(b)
        itls += c
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.token_times[-1] for r in done), default=start)
    span = max(end - start, 1e-9)
    out_tokens = sum(len(r.token_times) for r in done)
    slices = {}
    for name in sorted({r.slice for r in records}):
        mine = [per_request(r)[0] for r in done if r.slice == name]
        slices[name] = {"requests": sum(r.slice == name for r in records), "ttft": _pcts(mine)}
    out = {"requests": len(records), "finished": len(done), "rejected": sum(bool(r.rejected) for r in records),
           "ttft": _pcts(ttfts), "tpot": _pcts(tpots), "itl": _pcts(itls), "output_tokens": out_tokens,
           "duration_s": round_figure(span), "output_tokens_per_s": round_figure(out_tokens / span),
           "goodput_rps": round_figure(sum(meets_slo(r, slo) for r in records) / span), "slices": slices,
           "slo_attainment": slo_attainment(records, slo)}
    for key, value in (counters or {}).items():
        out[key] = round_figure(value) if isinstance(value, float) else value
    return out
