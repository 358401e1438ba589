"""plan --confirm: the N best candidates replayed on the engine, the first that meets the SLO at the measured
interval's high edge recommended, the next one tried when it does not, the fallback when none does; the release
gate and plan.md take it into account; bad counts are one-line errors. The rule is tested with synthetic
measurements (no timing); one test replays a real (tiny) engine."""

import json
import os

import pytest
from paths import REPO

from dantinox.cli import entrypoint as cli
from dantinox.config import ModelConfig
from dantinox.plan.candidate import Candidate
from dantinox.plan.confirm import (apply_confirmation, clamp_confirm, confirm_candidates, confirmed_recommendation,
                                   measured_summary, ranked_passing)
from dantinox.plan.confirm_replay import EngineReplayer, merged_counters
from dantinox.plan.cost_model import CostModel
from dantinox.plan.inputs import load_trace
from dantinox.plan.metrics import RequestRecord, summarize
from dantinox.plan.recommend import fallback_choice
from dantinox.plan.release_gate import check_release
from dantinox.plan.report import plan_markdown
from dantinox.plan.trace import TraceSpec, default_classes, generate_trace, trace_text
from dantinox.runs.bundled import bundled_run_dir
from dantinox.runs.tokenizer import TextTokenizer

SLO = {"ttft_p99": 0.100, "tpot_p99": 0.050}


def metrics(ttft: float, tpot: float, n: int = 8) -> dict:
    """A summarize() dict of n requests, each with this TTFT and TPOT (4 tokens each)."""
    recs = [RequestRecord(i, float(i), "chat", token_times=[i + ttft + k * tpot for k in range(4)]) for i in range(n)]
    return summarize(recs, SLO, {"preemptions": 0, "prefix_cache_hits": 0})


def row(name: str, cost: float | None, dropped=(), ttft=0.05, tpot=0.02) -> dict:
    m = metrics(ttft, tpot)
    iv = {k: {"median": m[k.split("_")[0]][k.split("_")[1]], "high": m[k.split("_")[0]][k.split("_")[1]]}
          for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}
    return {"candidate": Candidate(name=name).to_dict(), "dropped": list(dropped), "cost_per_million_usd": cost,
            "metrics": m, "intervals": iv, "notes": [],
            "ledger": {"weights": 1, "kv": 1, "kv_blocks": 1, "reserve": 1, "total": 3, "device": 4, "fits": True}}


ROWS = [row("baseline", 3.0), row("cheap", 1.0), row("middle", 2.0), row("dropped", 0.5, ["SLO: ..."])]
SIM_REC = {"name": "cheap", "candidate": ROWS[1]["candidate"], "fallback": False, "reason": "cheapest"}


def measuring(table: dict, log: list | None = None):
    """measure(cand): the next metrics dict of table[cand.name] (a list consumed in order)."""
    queues = {k: list(v) for k, v in table.items()}

    def measure(cand):
        if log is not None:
            log.append(cand.name)
        return queues[cand.name].pop(0)
    return measure


def test_ranked_passing_is_cheapest_first_without_dropped():
    assert [r["candidate"]["name"] for r in ranked_passing(ROWS)] == ["cheap", "middle", "baseline"]


def test_confirmation_falls_through_to_the_next_candidate():
    log = []
    table = {"cheap": [metrics(0.30, 0.02)] * 2, "middle": [metrics(0.05, 0.02)] * 2,
             "baseline": [metrics(0.06, 0.02)] * 2}
    conf = confirm_candidates(ROWS, SIM_REC, SLO, 2, 2, measuring(table, log))
    assert log == ["cheap", "cheap", "middle", "middle", "baseline", "baseline"]   # the baseline for reference
    assert conf["confirmed"] == "middle" and conf["n"] == 2 and conf["warning"] is None
    cheap = conf["results"][0]["measured"]
    assert not cheap["confirmed"] and "TTFT 300.0 ms" in cheap["failures"][0]
    rec = confirmed_recommendation(ROWS, conf, fallback_choice(ROWS, "baseline", None))
    assert rec["name"] == "middle" and rec["confirmed"] and not rec["fallback"]
    assert "'cheap' was cheaper in simulation but missed the SLO on the engine" in rec["reason"]


def test_none_confirmed_falls_back_to_baseline_or_last_good():
    bad = [metrics(0.5, 0.02)]
    conf = confirm_candidates(ROWS, SIM_REC, SLO, 2, 1, measuring({"cheap": bad, "middle": bad, "baseline": bad}))
    assert conf["confirmed"] is None
    rec = confirmed_recommendation(ROWS, conf, fallback_choice(ROWS, "baseline", None))
    assert rec["fallback"] and rec["name"] == "baseline" and rec["confirmed"] is False
    assert "no replayed candidate (cheap, middle) met the SLO" in rec["reason"]
    good = {"recommendation": {"name": "old", "candidate": Candidate(name="old").to_dict()}}
    rec = confirmed_recommendation(ROWS, conf, fallback_choice(ROWS, "baseline", good))
    assert rec["name"] == "old" and "last known-good" in rec["reason"]


def test_baseline_among_the_best_is_measured_once_as_a_candidate():
    rows = [row("baseline", 1.0), row("other", 2.0)]
    log = []
    conf = confirm_candidates(rows, SIM_REC, SLO, 2, 1, measuring({"baseline": [metrics(0.05, 0.02)],
                                                                    "other": [metrics(0.05, 0.02)]}, log))
    assert log == ["baseline", "other"] and [r["role"] for r in conf["results"]] == ["candidate", "candidate"]
    assert conf["confirmed"] == "baseline"


def test_decided_at_the_measured_interval_high_edge():
    """Median passes, but three replays spread around the SLO: the t interval's high edge is above it."""
    runs = [metrics(0.06, 0.02), metrics(0.09, 0.02), metrics(0.12, 0.02)]
    summary = measured_summary(runs, SLO, "t", 0.9)
    iv = summary["intervals"]["ttft_p99"]
    assert summary["metrics"]["ttft"]["p99"] == pytest.approx(0.09)
    assert iv["low"] < 0.09 < iv["high"] and iv["high"] > SLO["ttft_p99"]
    assert not summary["confirmed"] and "interval high edge" in summary["failures"][0]
    same = measured_summary([metrics(0.09, 0.02)] * 3, SLO, "t", 0.9)
    assert same["confirmed"] and same["intervals"]["ttft_p99"]["low"] == same["intervals"]["ttft_p99"]["high"]


def test_clamp_and_bad_counts():
    assert clamp_confirm(2, 5) == (2, None)
    n, warning = clamp_confirm(5, 2)
    assert n == 2 and "only 2 candidate(s) passed" in warning
    with pytest.raises(ValueError, match="--confirm=0 is not allowed"):
        clamp_confirm(0, 3)
    with pytest.raises(ValueError, match="--confirm-repeats=0 is not allowed"):
        confirm_candidates(ROWS, SIM_REC, SLO, 1, 0, measuring({}))


def _plan(rec: dict, conf: dict) -> dict:
    ident = {"weights_sha256": "ab" * 32, "dantinox_version": "x"}
    return {"recommendation": rec, "candidates": ROWS, "confirmation": conf, "identity": ident, "gates": [],
            "inputs": {"slo": SLO, "trace_sha256": "t", "trace_requests": 8, "device_bytes": 2 ** 30,
                       "price_per_hour": 1.0}, "rate_sweep": [], "load_sweep": None}


def test_release_gate_and_plan_md_take_confirmation_into_account():
    table = {"cheap": [metrics(0.30, 0.02)], "middle": [metrics(0.05, 0.02)], "baseline": [metrics(0.06, 0.02)]}
    conf = confirm_candidates(ROWS, SIM_REC, SLO, 2, 1, measuring(table))
    rec = confirmed_recommendation(ROWS, conf, fallback_choice(ROWS, "baseline", None))
    good = _plan(SIM_REC, None)
    assert check_release(_plan(rec, conf), good) == []
    md = plan_markdown(_plan(rec, conf))
    assert "## Confirmation on the real engine" in md and "Recommended and confirmed on the real engine" in md
    assert "| cheap | candidate | 50.0 [50.0] | 300.0 / 300.0 | " in md
    bad = dict(SIM_REC, fallback=False)           # a plan that kept an unconfirmed recommendation
    assert any("not confirmed on the real engine" in f for f in check_release(_plan(bad, conf), good))
    none = confirm_candidates(ROWS, SIM_REC, SLO, 1, 1, measuring({"cheap": [metrics(0.3, 0.02)],
                                                                   "baseline": [metrics(0.3, 0.02)]}))
    fb = confirmed_recommendation(ROWS, none, fallback_choice(ROWS, "baseline", None))
    assert "No candidate passed on the real engine" in plan_markdown(_plan(fb, none))


def test_merged_counters_of_replica_shares():
    a = {"preemptions": 1, "prefix_cache_hits": 2, "prefix_cache_queries": 4, "kv_blocks": 10, "peak_kv_blocks": 3,
         "queue_max": 2, "queue_mean": 1.0}
    b = dict(a, peak_kv_blocks=7, queue_max=1, queue_mean=0.0)
    m = merged_counters([a, b])
    assert m == {"preemptions": 2, "prefix_cache_hits": 4, "prefix_cache_queries": 8, "kv_blocks": 20,
                 "peak_kv_blocks": 7, "queue_max": 2, "queue_mean": 0.5}


@pytest.mark.parametrize("argv, message", [
    (["--confirm", "-1"], "--confirm=-1 is not allowed"),
    (["--confirm", "1", "--confirm-repeats", "0"], "--confirm-repeats=0 is not allowed"),
    (["--confirm", "1", "--mesh", "data=1,model=1"], "--confirm with --mesh data=1,model=1 is not supported"),
])
def test_bad_confirm_flags_one_line(tmp_path, capsys, argv, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival": 0.0, "prompt_tokens": 4, "max_tokens": 2}) + "\n")
    code = cli.main(["plan", "--trace", str(trace), "--out", str(tmp_path / "p")] + argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_apply_confirmation_moves_the_recommendation_and_its_sweep(monkeypatch):
    calls = []
    monkeypatch.setattr("dantinox.plan.confirm.rate_sweep", lambda inp, cand: calls.append(cand.name) or [])
    monkeypatch.setattr("dantinox.plan.confirm.sweep_landmarks", lambda sweep, target: {"moved": True})

    class Inp:
        baseline, last_good, attainment_target = "baseline", None, 0.9

    table = {"cheap": [metrics(0.30, 0.02)], "middle": [metrics(0.05, 0.02)], "baseline": [metrics(0.06, 0.02)]}
    conf = confirm_candidates(ROWS, SIM_REC, SLO, 2, 1, measuring(table))
    out = apply_confirmation({"candidates": ROWS, "recommendation": SIM_REC, "rate_sweep": ["old"]}, conf, Inp())
    assert out["recommendation"]["name"] == "middle" and out["confirmation"] is conf
    assert calls == ["middle"] and out["load_sweep"] == {"moved": True}


def _bundled_trace(tmp_path, n: int):
    run = bundled_run_dir()
    cfg = ModelConfig.from_dict(json.load(open(os.path.join(run, "config.json"))))
    tok = TextTokenizer.load(os.path.join(run, "tokenizer.json"))
    path = tmp_path / "t.jsonl"
    path.write_text(trace_text(generate_trace(TraceSpec(requests=n, rate=8, classes=default_classes(None), seed=1))))
    return cfg, path, load_trace(str(path), cfg, tok)


def test_replica_shares_follow_the_simulated_router(tmp_path):
    cfg, _, (requests, prompts) = _bundled_trace(tmp_path, 12)
    cost = CostModel(forward=(1.4e-3, 4.5e-4, 1.9e-4), decode_call=6e-3, decode_iter=(8.6e-4, 1.8e-4, 1.4e-6))
    rep = EngineReplayer(None, cfg, requests, prompts, SLO, cost)
    assert rep.shares(Candidate()) == [list(range(12))]
    shares = rep.shares(Candidate(name="2x", replicas=2, routing="round_robin"))
    assert shares == [list(range(0, 12, 2)), list(range(1, 12, 2))]
    least = rep.shares(Candidate(name="2x", replicas=2, routing="least_tokens"))
    assert sorted(least[0] + least[1]) == list(range(12))


@pytest.mark.slow
def test_plan_confirm_on_the_bundled_engine(tmp_path, capsys):
    """The whole command with a given profile: the replays finish every request and the plan records them."""
    _, trace, _ = _bundled_trace(tmp_path, 16)
    profile = f"{REPO}/docs/planning-example/profile.json"
    out = tmp_path / "plan"
    code = cli.main(["plan", "--trace", str(trace), "--profile", profile, "--slo", "ttft_p99=5000,tpot_p99=1000",
                     "--device-memory", "64MiB", "--confirm", "1", "--confirm-repeats", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    plan = json.load(open(out / "plan.json"))
    conf = plan["confirmation"]
    assert conf["repeats"] == 2 and conf["results"][0]["role"] == "candidate"
    measured = conf["results"][0]["measured"]
    assert measured["metrics"]["finished"] == 16 and measured["metrics"]["rejected"] == 0
    assert plan["recommendation"]["confirmed"] is True
    assert "## Confirmation on the real engine" in (out / "plan.md").read_text()
