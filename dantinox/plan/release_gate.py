"""The release gate: may a new plan's deployment replace the last known-good one?

``dantinox plan gate --candidate plan.json --last-good plan.json`` checks the candidate plan:
  1. it recommends a deployment that passed its own sweep (not a fallback);
  2. that deployment's simulated p99 TTFT / TPOT meet the candidate plan's SLOs and the last-good plan's
     (the stricter of each), and no request was rejected; taken at the interval's pessimistic edge when the
     plan decided there (its "uncertainty" says so), else at the median;
  3. every quality gate of its model variant passed (a variant not measured fails);
  4. it records what it was measured on (weights sha256, dantinox version);
  5. on the same trace (equal trace sha256), its p99 TTFT is at most REGRESSION x the last-good's;
  6. when the plan was confirmed on the real engine (``plan --confirm``), the recommendation is the confirmed
     candidate and its measured p99 TTFT / TPOT, at the measured interval's high edge, meet the stricter SLOs.
Exit 0: release. Exit 1: every failed check, and the fallback: the last-good plan's deployment with the
model digest and version it was measured on.
"""

from __future__ import annotations

from .inputs import load_json
from .recommend import slo_failures

REGRESSION = 1.10


def _recommended_row(plan: dict) -> dict | None:
    name = plan["recommendation"]["name"]
    return next((r for r in plan.get("candidates", []) if r["candidate"]["name"] == name), None)


def _stricter(a: dict, b: dict) -> dict:
    return {k: min(v for v in (a.get(k), b.get(k)) if v is not None) for k in set(a) | set(b)}


def check_release(cand: dict, good: dict) -> list[str]:
    """The failed checks of ``cand`` against ``good`` (plan dicts); [] means release."""
    failed = []
    rec, row = cand["recommendation"], _recommended_row(cand)
    if rec.get("fallback"):
        failed.append(f"the candidate plan found no passing deployment (it falls back to {rec['name']!r})")
    if row is None or row.get("metrics") is None:
        return failed + [f"the candidate plan has no simulated metrics for {rec['name']!r}"]
    slo = _stricter(cand["inputs"]["slo"], good["inputs"]["slo"])
    at = (cand.get("uncertainty") or {}).get("decide_at", "median")
    failed += [f"{rec['name']}: {reason}" for reason in slo_failures(row["metrics"], slo, row.get("intervals"), at)]
    variant = [row["candidate"]["kv_dtype"], row["candidate"]["quantize"]]
    for g in cand.get("gates", []):
        if g["variant"] == variant and g["passed"] is not True:
            what = "failed: " + "; ".join(g["failed"]) if g["passed"] is False else "not measured: " + g["detail"]
            failed.append(f"quality gate for kv {variant[0]}, weights {variant[1]} {what}")
    failed += _confirmation_failures(cand, slo)
    ident = cand.get("identity", {})
    if not ident.get("weights_sha256") or not ident.get("dantinox_version"):
        failed.append("the candidate plan does not record the model digest and dantinox version")
    good_row = _recommended_row(good)
    same_trace = cand["inputs"].get("trace_sha256") == good["inputs"].get("trace_sha256")
    if good_row and good_row.get("metrics") and same_trace:
        new, old = row["metrics"]["ttft"]["p99"], good_row["metrics"]["ttft"]["p99"]
        if new is not None and old is not None and new > REGRESSION * old:
            failed.append(f"p99 TTFT regressed on the same trace: {new * 1e3:.1f} ms > {REGRESSION:.2f} x "
                          f"{old * 1e3:.1f} ms (last good)")
    return failed


def _confirmation_failures(cand: dict, slo: dict) -> list[str]:
    """Check 6: [] when the plan was not confirmed on the engine, or was and its recommendation holds there."""
    conf = cand.get("confirmation")
    if not conf:
        return []
    rec = cand["recommendation"]
    if not rec.get("confirmed"):
        return [f"{rec['name']}: not confirmed on the real engine (no replayed candidate met the SLO)"]
    result = next((r for r in conf["results"] if r["name"] == rec["name"]), None)
    if result is None:
        return [f"{rec['name']}: the plan's confirmation has no measurement of it"]
    m = result["measured"]
    return [f"{rec['name']} measured on the engine: {reason}"
            for reason in slo_failures(m["metrics"], slo, m["intervals"], "edge")]


def release_gate(candidate_path: str, last_good_path: str) -> tuple[bool, list[str]]:
    """(release?, lines to print). Raises ValueError naming the flag for an unreadable plan."""
    cand, good = load_json("--candidate", candidate_path), load_json("--last-good", last_good_path)
    for flag, plan in (("--candidate", cand), ("--last-good", good)):
        if "recommendation" not in plan or "inputs" not in plan:
            raise ValueError(f"{flag}: not a plan.json written by dantinox plan (no recommendation or inputs)")
    failed = check_release(cand, good)
    if not failed:
        how = "confirmed on the real engine" if cand["recommendation"].get("confirmed") else \
            "simulated only, not confirmed on the engine"
        return True, [f"release: {cand['recommendation']['name']} ({how}; weights sha256 "
                      f"{cand['identity']['weights_sha256'][:12]}, dantinox {cand['identity']['dantinox_version']})"]
    ident = good.get("identity", {})
    lines = [f"FAILED: {f}" for f in failed]
    lines.append(f"fallback: keep {good['recommendation']['name']} from the last known-good plan (weights sha256 "
                 f"{str(ident.get('weights_sha256'))[:12]}, dantinox {ident.get('dantinox_version')})")
    return False, lines
