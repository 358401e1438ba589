"""Sweep candidate deployments in simulation, drop the ones that cannot be deployed, recommend the cheapest.

For every candidate, in this order, every reason to drop it is collected (none short-circuits the others
except memory, which skips the simulation):
  1. memory: weights + KV pool + reserve > device memory (ledger.memory_ledger; per replica);
  2. quality: the candidate's model variant (kv dtype, weight quantization) failed its quality gate, or was
     not measured (quality_gate);
  3. SLO: simulated p99 TTFT or p99 TPOT above the SLO, or requests rejected (queue full, too long).
Survivors are ranked by cost per million output tokens = replicas x price per hour / (output tokens/s x 3600)
x 1e6, ties by name. With no survivor the plan recommends the fallback: the last known-good plan's
recommendation (--baseline plan.json) or the named baseline candidate, and says that no candidate passed.
A variant with no profile of its own is simulated with the float profile's costs and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .candidate import Candidate
from .ledger import memory_ledger
from .load_sweep import sweep_landmarks
from .pareto import pareto_summary
from .simulate import simulate
from .uncertainty import latency_intervals, median_metrics

RATE_FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class PlanInputs:
    """What a plan is computed from. costs: {(kv_dtype, quantize): CostModel or [CostModel, ...] (one per
    profile sample)}; gates: {(kv_dtype, quantize): GateResult}; slo: {"ttft_p99": s, "tpot_p99": s};
    device_bytes: bytes per replica; price_per_hour: USD per replica-hour; baseline: a candidate name;
    last_good: a plan dict (or None); interval: "t", "range" or None (point estimates; see uncertainty.py);
    confidence: the t interval's level; decide_at: "edge" (the interval's pessimistic edge) or "median";
    attainment_target: the SLO attainment the load sweep's goodput rate must keep; spec_acceptance: the
    speculative acceptance rate of trace requests that give none (speculating candidates only)."""

    cfg: object
    requests: list
    prompts: list
    costs: dict
    slo: dict
    device_bytes: int
    price_per_hour: float
    weights_bytes: int
    gates: dict = field(default_factory=dict)
    baseline: str = "baseline"
    last_good: dict | None = None
    reserve_fraction: float = 0.1
    interval: str | None = "t"
    confidence: float = 0.9
    decide_at: str = "edge"
    attainment_target: float = 0.9
    spec_acceptance: float | None = None


def cost_per_million(replicas: int, price_per_hour: float, tokens_per_s: float) -> float | None:
    """USD per million output tokens (None when nothing was generated)."""
    if tokens_per_s <= 0:
        return None
    return float(f"{replicas * price_per_hour / (tokens_per_s * 3600) * 1e6:.9g}")


def _cost_models(inp: PlanInputs, cand: Candidate) -> tuple[list, str | None]:
    """([CostModel, ...] of the candidate's variant, one per profile sample; a note when the float ones stand in)."""
    key = (cand.kv_dtype, cand.quantize)
    note = None
    if key not in inp.costs:
        key, note = ("float32", "none"), f"no profile for kv_dtype={key[0]}, quantize={key[1]}: float costs used"
    costs = inp.costs[key]
    return (list(costs) if isinstance(costs, (list, tuple)) else [costs]), note


def simulate_samples(inp: PlanInputs, cand: Candidate, costs: list, requests=None) -> tuple[list, list]:
    """(one metrics dict per cost model, the records of the median run by p99 TTFT) for ``cand``."""
    runs = [simulate(inp.cfg, cand, c, requests or inp.requests, inp.prompts, inp.slo,
                     spec_acceptance=inp.spec_acceptance) for c in costs]
    records = [r.pop("records") for r in runs]
    order = sorted(range(len(runs)), key=lambda i: (runs[i]["ttft"]["p99"] or 0.0, i))
    return runs, records[order[(len(order) - 1) // 2]]


def evaluate_candidate(inp: PlanInputs, cand: Candidate) -> dict:
    """One candidate's row: ledger, metrics (no per-request records), cost, reasons it is dropped, notes, and
    the sorted TTFTs (for the CDF plot)."""
    ledger = memory_ledger(inp.cfg, cand, inp.weights_bytes, inp.device_bytes, inp.reserve_fraction)
    row = {"candidate": cand.to_dict(), "ledger": ledger.to_dict(), "dropped": [], "notes": [],
           "metrics": None, "cost_per_million_usd": None, "ttfts": []}
    if ledger.estimated:
        row["notes"].append(f"KV bytes for kv_dtype={cand.kv_dtype} estimated")
    if not ledger.fits:
        row["dropped"].append(f"memory: weights {ledger.weights} B + KV {ledger.kv} B + reserve {ledger.reserve}"
                              f" B = {ledger.total} B > device {ledger.device} B")
        return row
    gate = inp.gates.get((cand.kv_dtype, cand.quantize))
    if gate is not None and gate.passed is False:
        row["dropped"].append("quality gate failed: " + "; ".join(gate.failed))
    elif gate is not None and gate.passed is None:
        row["dropped"].append(f"quality not measured: {gate.detail}")
    costs, note = _cost_models(inp, cand)
    if note:
        row["notes"].append(note)
    runs, records = simulate_samples(inp, cand, costs)
    row["ttfts"] = sorted(r.token_times[0] - r.arrival for r in records if r.token_times and not r.rejected)
    row["metrics"] = result = median_metrics(runs)
    row["samples"] = len(runs)
    row["intervals"] = latency_intervals(runs, inp.interval, inp.confidence)
    if cand.spec_tokens:
        row["notes"].append(_speculation_note(cand.spec_tokens, costs, result))
    row["cost_per_million_usd"] = cost_per_million(cand.replicas, inp.price_per_hour, result["output_tokens_per_s"])
    failures = slo_failures(result, inp.slo, row["intervals"], inp.decide_at)
    row["passes_only_at_median"] = bool(failures) and not row["dropped"] and not slo_failures(result, inp.slo)
    row["dropped"] += failures
    return row


def _speculation_note(k: int, costs: list, metrics: dict) -> str:
    """What a speculating candidate's row says: how its verify cost was had (profiled in some sample, or
    derived in all), the simulated tokens per verify call and the rows the switch-off rule stopped."""
    how = "profiled" if any(c.verify_measured(k) for c in costs) else "derived from the forward_step fit"
    calls = metrics.get("spec_verify_calls") or 0
    per_call = f"{1 + metrics.get('spec_accepted', 0) / calls:.2f}" if calls else "-"
    return (f"speculation k={k}: verify B x {k + 1} {how}; {per_call} tokens per verify call; "
            f"{metrics.get('spec_switched_off', 0)} requests switched off")


def slo_failures(metrics: dict, slo: dict, intervals: dict | None = None, decide_at: str = "median") -> list[str]:
    """Reasons a run misses its SLOs (p99 TTFT, p99 TPOT in seconds) or rejected requests; [] if none.
    With ``intervals`` (uncertainty.latency_intervals) and decide_at="edge", each p99 is taken at its
    interval's high edge; otherwise the metrics' own (median) p99."""
    out = []
    for key, metric in (("ttft_p99", "ttft"), ("tpot_p99", "tpot")):
        value, median = metrics[metric]["p99"], metrics[metric]["p99"]
        if intervals is not None and decide_at == "edge":
            value = intervals[key]["high"]
        if key in slo and value is not None and value > slo[key]:
            where = "" if value == median else f" (interval high edge; median {median * 1e3:.1f} ms)"
            out.append(f"SLO: p99 {metric.upper()} {value * 1e3:.1f} ms{where} > {slo[key] * 1e3:.1f} ms")
    if metrics["rejected"]:
        out.append(f"SLO: {metrics['rejected']} requests rejected")
    return out


def choose(rows: list, baseline: str, last_good: dict | None) -> dict:
    """The recommendation: {"name", "candidate", "fallback": bool, "reason"}."""
    passing = [r for r in rows if not r["dropped"] and r["cost_per_million_usd"] is not None]
    if passing:
        best = min(passing, key=lambda r: (r["cost_per_million_usd"], r["candidate"]["name"]))
        return {"name": best["candidate"]["name"], "candidate": best["candidate"], "fallback": False,
                "reason": f"cheapest of {len(passing)} passing candidates"}
    return fallback_choice(rows, baseline, last_good)


def fallback_choice(rows: list, baseline: str, last_good: dict | None) -> dict:
    """The fallback recommendation when no candidate passed (in simulation, or on the engine: confirm.py): the
    last known-good plan's deployment, else the named baseline candidate."""
    if last_good is not None:
        rec = last_good["recommendation"]
        return {"name": rec["name"], "candidate": rec["candidate"], "fallback": True,
                "reason": "no candidate passed: the last known-good plan's deployment"}
    named = [r for r in rows if r["candidate"]["name"] == baseline]
    cand = named[0]["candidate"] if named else Candidate(name=baseline).to_dict()
    return {"name": baseline, "candidate": cand, "fallback": True,
            "reason": f"no candidate passed: the named baseline {baseline!r}"}


def rate_sweep(inp: PlanInputs, cand: Candidate, factors=RATE_FACTORS) -> list[dict]:
    """The candidate at the trace's arrival rate times each factor, simulated once per profile sample: median
    output tokens/s, p99 TTFT (median and interval high edge) and the fraction of requests meeting every SLO."""
    import dataclasses

    costs, _ = _cost_models(inp, cand)
    span = max(inp.requests[-1].arrival, 1e-9)
    out = []
    for f in factors:
        scaled = [dataclasses.replace(q, arrival=q.arrival / f) for q in inp.requests]
        runs, _ = simulate_samples(inp, cand, costs, scaled)
        m, iv = median_metrics(runs), latency_intervals(runs, inp.interval, inp.confidence)
        out.append({"factor": f, "rate_rps": float(f"{len(scaled) / (span / f):.6g}"),
                    "output_tokens_per_s": m["output_tokens_per_s"], "ttft_p99_s": m["ttft"]["p99"],
                    "ttft_p99_high_s": iv["ttft_p99"]["high"], "tpot_p50_s": m["tpot"]["p50"],
                    "attainment_all": m["slo_attainment"]["all"]})
    return out


def make_plan(inp: PlanInputs, candidates: list) -> dict:
    """Evaluate every candidate and choose. Returns {"candidates": rows, "recommendation", "rate_sweep",
    "load_sweep" (the sweep's knee, saturation and goodput rate: load_sweep.sweep_landmarks), "pareto" (tokens/s
    per user against per replica: pareto.pareto_summary), "uncertainty"}."""
    names = [c.name for c in candidates]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"candidates: name {dup[0]!r} is used twice; names must be unique")
    candidates = [c.for_model(inp.cfg) for c in candidates]   # a block size of None: serve's default for the model
    rows = [evaluate_candidate(inp, c) for c in candidates]
    rec = choose(rows, inp.baseline, inp.last_good)
    if rec["fallback"] and rec["name"] not in names:  # show what the fallback does on this trace too
        row = evaluate_candidate(inp, Candidate.from_dict(rec["candidate"]))
        row["notes"].append("the fallback, not among the swept candidates")
        rows.append(row)
    sweep = rate_sweep(inp, Candidate.from_dict(rec["candidate"]))
    samples = {f"{k[0]},{k[1]}": len(v) if isinstance(v, (list, tuple)) else 1 for k, v in sorted(inp.costs.items())}
    return {"candidates": rows, "recommendation": rec, "rate_sweep": sweep,
            "load_sweep": sweep_landmarks(sweep, inp.attainment_target),
            "pareto": pareto_summary(rows, sweep, rec["candidate"]["replicas"]),
            "uncertainty": {"interval": inp.interval, "confidence": inp.confidence, "decide_at": inp.decide_at,
                            "samples": samples}}
