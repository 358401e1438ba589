"""Plans that state their uncertainty: one simulation per profile sample, medians with intervals, the SLO
check at the pessimistic edge, SLO attainment, and the load sweep's landmarks. Synthetic costs only (no
timing): the profile samples are one cost model scaled by known factors."""

import dataclasses
import json
import math

import pytest

from dantinox.cli import entrypoint as cli
from dantinox.plan.candidate import Candidate
from dantinox.plan.cost_model import CostModel
from dantinox.plan.load_sweep import goodput_rate, knee, saturation, sweep_landmarks
from dantinox.plan.metrics import RequestRecord, slo_attainment
from dantinox.plan.profile import PROFILE_FORMAT, model_identity, profile_cost_models, repeat_samples
from dantinox.plan.recommend import PlanInputs, make_plan
from dantinox.plan.report import plan_json_bytes, plan_markdown
from dantinox.plan.trace import TraceSpec, default_classes, generate_trace, prompt_token_ids, read_trace, trace_text
from dantinox.plan.uncertainty import interval, latency_intervals, median_metrics
from dantinox.runs.bundled import bundled_run_dir
from dantinox.runs.run_dir import load_run

COST = CostModel(forward=(1.4e-3, 4.5e-4, 1.9e-4), decode_call=6e-3, decode_iter=(8.6e-4, 1.8e-4, 1.4e-6))
MiB = 2 ** 20


def scaled(cost: CostModel, f: float) -> CostModel:
    """The cost model with every call f times as expensive (a slower host)."""
    return dataclasses.replace(cost, forward=tuple(f * x for x in cost.forward), decode_call=f * cost.decode_call,
                               decode_iter=tuple(f * x for x in cost.decode_iter))


# Intervals against written-out values ---------------------------------------------------------------------

def test_t_interval_matches_the_formula_and_range_is_min_max():
    # mean 2, s = 1, t_{0.95, 2} = 2.919986 (t table): half width 2.919986 / sqrt(3) = 1.685854
    iv = interval([1.0, 2.0, 3.0], "t", 0.9)
    assert iv["median"] == 2.0 and iv["n"] == 3
    assert math.isclose(iv["low"], 2 - 2.919986 / math.sqrt(3), rel_tol=1e-6)
    assert math.isclose(iv["high"], 2 + 2.919986 / math.sqrt(3), rel_tol=1e-6)
    assert interval([3.0, 1.0, 2.0], "range") == {"median": 2.0, "low": 1.0, "high": 3.0, "n": 3}
    assert interval([0.5, 0.5, 0.5], "t") == {"median": 0.5, "low": 0.5, "high": 0.5, "n": 3}
    assert interval([0.5], "t") == {"median": 0.5, "low": 0.5, "high": 0.5, "n": 1}
    wide = interval([0.0, 2.0, 4.0], "t", 0.9)                        # twice the spread: twice the width
    assert math.isclose(wide["high"] - wide["low"], 2 * (iv["high"] - iv["low"]), rel_tol=1e-6)
    with pytest.raises(ValueError, match="interval method='sd' is not allowed"):
        interval([1.0, 2.0], "sd")


def test_t_interval_is_clipped_to_the_range_the_quantity_can_take():
    # mean 17, s = 20.22: half width 2.919986 * 20.22 / sqrt(3) = 34.09 > 17, so the raw low edge is -17.09
    raw = interval([1.0, 10.0, 40.0], "t", 0.9)
    assert raw["low"] < 0
    clipped = interval([1.0, 10.0, 40.0], "t", 0.9, bounds=(0.0, None))
    assert clipped["low"] == 0.0 and clipped["high"] == raw["high"] and clipped["median"] == 10.0
    fraction = interval([0.9, 1.0, 1.0], "t", 0.9, bounds=(0.0, 1.0))
    assert fraction["high"] == 1.0 and 0 < fraction["low"] < 0.9
    runs = [{"ttft": {"p50": v, "p90": v, "p99": v}, "tpot": {"p50": v, "p90": v, "p99": v},
             "itl": {"p50": v, "p90": v, "p99": v}, "output_tokens_per_s": v, "goodput_rps": v,
             "slo_attainment": {"ttft": a, "tpot": a, "all": a}} for v, a in ((1.0, 0.9), (10.0, 1.0), (40.0, 1.0))]
    out = latency_intervals(runs, "t", 0.9)
    assert all(out[k]["low"] == 0.0 for k in ("ttft_p99", "tpot_p50", "output_tokens_per_s", "goodput_rps"))
    assert out["attainment_all"]["high"] == 1.0


def test_median_metrics_keeps_agreeing_integers_and_takes_medians():
    runs = [{"a": 3, "b": {"p99": 0.1}, "s": "x"}, {"a": 3, "b": {"p99": 0.3}, "s": "x"},
            {"a": 3, "b": {"p99": 0.2}, "s": "x"}]
    assert median_metrics(runs) == {"a": 3, "b": {"p99": 0.2}, "s": "x"}
    assert median_metrics([{"hits": 148}, {"hits": 150}, {"hits": 149}]) == {"hits": 149}
    assert median_metrics([{"hits": 148}, {"hits": 149}]) == {"hits": 148.5}


def test_slo_attainment_counts_each_request_against_the_bounds():
    recs = [RequestRecord(0, 0.0, "a", token_times=[0.1, 0.2, 0.3]),    # TTFT 0.1, TPOT 0.1: both met
            RequestRecord(1, 0.0, "a", token_times=[0.5, 0.6]),         # TTFT 0.5: TTFT missed
            RequestRecord(2, 0.0, "a", token_times=[0.1, 0.5, 0.9]),    # TPOT 0.4: TPOT missed
            RequestRecord(3, 0.0, "a", rejected="QueueFullError")]      # neither
    assert slo_attainment(recs, {"ttft_p99": 0.2, "tpot_p99": 0.2}) == {"ttft": 0.5, "tpot": 0.5, "all": 0.25}


def test_load_sweep_knee_saturation_and_goodput_rate():
    rates = [1.0, 2.0, 3.0, 4.0, 5.0]
    ttft = [0.010, 0.011, 0.013, 0.040, 0.200]                      # flat, then up sharply
    # scaled: x = 0, .25, .5, .75, 1; y = (ttft - .01) / .19 = 0, .005, .016, .158, 1; x - y is largest (.592) at 4
    assert knee(rates, ttft) == 4.0
    assert knee(rates, [0.1, 0.2, 0.3, 0.4, 0.5]) is None           # a straight line has no knee
    points = [{"rate_rps": r, "output_tokens_per_s": 10 * min(r, 3.5), "ttft_p99_s": t, "attainment_all": a}
              for r, t, a in zip(rates, ttft, (1.0, 1.0, 0.95, 0.6, 0.1))]
    assert saturation(points) == 4.0                                 # 35 tok/s at 4 req/s: 8.75 < 0.95 x 10
    assert goodput_rate(points, 0.9) == 3.0 and goodput_rate(points, 0.99) == 2.0
    assert sweep_landmarks(points)["knee_rps"] == 4.0


# Plans over several samples ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    run = bundled_run_dir()
    _, cfg, tok, _ = load_run(run)
    d = tmp_path_factory.mktemp("u")
    path = d / "t.jsonl"
    path.write_text(trace_text(generate_trace(TraceSpec(requests=40, rate=20, classes=default_classes(), seed=2))))
    reqs = read_trace(str(path), cfg.max_context)
    return cfg, reqs, [prompt_token_ids(q, tok, cfg.vocab_size) for q in reqs]


def _plan(small, factors, **kw):
    cfg, reqs, prompts = small
    fields = dict(cfg=cfg, requests=reqs, prompts=prompts, costs={("float32", "none"): [scaled(COST, f)
                                                                                      for f in factors]},
                  slo={"ttft_p99": 10.0, "tpot_p99": 10.0}, device_bytes=64 * MiB, price_per_hour=2.0,
                  weights_bytes=0)
    fields.update(kw)
    return make_plan(PlanInputs(**fields), [Candidate("baseline")])


def test_identical_samples_give_zero_width_and_the_single_sample_numbers(small):
    one, three = _plan(small, [1.0]), _plan(small, [1.0, 1.0, 1.0])
    row1, row3 = one["candidates"][0], three["candidates"][0]
    assert row3["samples"] == 3 and row3["metrics"] == row1["metrics"]
    for key, iv in row3["intervals"].items():
        assert iv["low"] == iv["high"] == iv["median"], key


def test_intervals_widen_with_the_profiles_spread_and_hold_the_median(small):
    def width(factors):
        iv = _plan(small, factors)["candidates"][0]["intervals"]["ttft_p99"]
        assert iv["low"] <= iv["median"] <= iv["high"]
        return iv["high"] - iv["low"]
    narrow, wide = width([0.9, 1.0, 1.1]), width([0.6, 1.0, 1.4])
    assert 0 < narrow < wide


def test_decision_at_the_pessimistic_edge_and_passes_only_at_the_median(small):
    iv = _plan(small, [0.6, 1.0, 1.4])["candidates"][0]["intervals"]["ttft_p99"]
    slo = {"ttft_p99": (iv["median"] + iv["high"]) / 2, "tpot_p99": 10.0}   # between the median and the edge
    plan = _plan(small, [0.6, 1.0, 1.4], slo=slo)
    row = plan["candidates"][0]
    assert row["passes_only_at_median"] and len(row["dropped"]) == 1
    assert row["dropped"][0].startswith(f"SLO: p99 TTFT {iv['high'] * 1e3:.1f} ms (interval high edge; median")
    assert plan["recommendation"]["fallback"]
    assert "Pass only at the median (dropped at the interval's pessimistic edge): baseline." in _md(plan)
    at_median = _plan(small, [0.6, 1.0, 1.4], slo=slo, decide_at="median")
    assert not at_median["candidates"][0]["dropped"] and not at_median["recommendation"]["fallback"]
    ranged = _plan(small, [0.6, 1.0, 1.4], slo=slo, interval="range")["candidates"][0]["intervals"]["ttft_p99"]
    assert ranged["low"] < ranged["median"] < ranged["high"]         # the slowest sample's own p99


def _md(plan):
    plan = dict(plan, identity={"weights_sha256": "ab" * 32, "dantinox_version": "x"}, gates=[],
                inputs={"slo": {"ttft_p99": 1.0}, "device_bytes": 1, "trace_requests": 1, "trace_sha256": "ab",
                        "price_per_hour": 1})
    return plan_markdown(plan)


def test_several_samples_plan_is_byte_identical_and_has_attainment_and_landmarks(small):
    a, b = _plan(small, [0.8, 1.0, 1.3]), _plan(small, [0.8, 1.0, 1.3])
    for plan in (a, b):
        for row in plan["candidates"]:
            row.pop("ttfts")
    assert plan_json_bytes(a) == plan_json_bytes(b)
    m = a["candidates"][0]["metrics"]
    assert set(m["slo_attainment"]) == {"ttft", "tpot", "all"} and m["slo_attainment"]["all"] == 1.0
    assert set(a["load_sweep"]) == {"knee_rps", "saturation_rps", "goodput_rps", "attainment_target"}
    assert all("attainment_all" in p and "ttft_p99_high_s" in p for p in a["rate_sweep"])
    assert a["uncertainty"] == {"interval": "t", "confidence": 0.9, "decide_at": "edge",
                                "samples": {"float32,none": 3}}
    text = _md(a)
    assert "t-based 90% interval" in text and "Knee (Kneedle on p99 TTFT)" in text


# Profiles: repeats, formats; CLI bad input ----------------------------------------------------------------

def test_repeat_samples_sleeps_the_cooldown_between_samples_only():
    slept, calls = [], []
    out = repeat_samples(lambda: calls.append(len(calls)) or len(calls), 3, 7.5, sleep=slept.append)
    assert out == [1, 2, 3] and slept == [7.5, 7.5]
    with pytest.raises(ValueError, match="samples=0 is not allowed"):
        repeat_samples(lambda: None, 0)


def _profile(path, samples):
    run = bundled_run_dir()
    _, cfg, _, _ = load_run(run)
    prof = {"format": PROFILE_FORMAT, "identity": model_identity(run, cfg), "kv_dtype": "float32",
            "quantize": "none", "cost_model": samples[0].to_dict(), "bottleneck": [], "rates": {},
            "samples": [{"cost_model": s.to_dict()} for s in samples]}
    path.write_text(json.dumps(prof))
    return str(path)


def test_profile_formats_give_one_cost_model_per_sample(tmp_path):
    three = json.loads(open(_profile(tmp_path / "p.json", [scaled(COST, f) for f in (1, 2, 3)])).read())
    assert [c.decode_call for c in profile_cost_models(three)] == [COST.decode_call * f for f in (1, 2, 3)]
    old = {"format": 2, "cost_model": COST.to_dict()}                 # a profile from before --repeats
    assert profile_cost_models(old) == [COST]


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ucli")
    trace = d / "t.jsonl"
    assert cli.main(["plan", "trace", "--out", str(trace), "--requests", "20", "--rate", "6", "--seed", "1"]) == 0
    (d / "c.yaml").write_text("- {name: baseline}\n")
    return d, str(trace)


def _args(d, trace, profile, out, *extra):
    return ["plan", "--trace", trace, "--profile", profile, "--slo", "ttft_p99=500,tpot_p99=100", "--device-memory",
            "64MiB", "--candidates", str(d / "c.yaml"), "--out", str(d / out), *extra]


def test_cli_plan_over_three_samples_reports_intervals(cli_dir):
    d, trace = cli_dir
    prof = _profile(d / "three.json", [scaled(COST, f) for f in (0.9, 1.0, 1.2)])
    assert cli.main(_args(d, trace, prof, "a")) == 0
    assert cli.main(_args(d, trace, prof, "b")) == 0
    assert (d / "a" / "plan.json").read_bytes() == (d / "b" / "plan.json").read_bytes()
    row = json.loads((d / "a" / "plan.json").read_text())["candidates"][0]
    assert row["samples"] == 3 and row["intervals"]["ttft_p99"]["high"] > row["intervals"]["ttft_p99"]["low"]


@pytest.mark.parametrize("extra, expected", [
    (("--interval", "t"), "--interval: a profile has 1 sample: an interval needs at least 2"),
    (("--confidence", "0.9"), "--confidence: a profile has 1 sample: an interval needs at least 2"),
])
def test_an_interval_asked_of_a_one_sample_profile_is_one_line(cli_dir, capsys, extra, expected):
    d, trace = cli_dir
    prof = _profile(d / "one.json", [COST])
    code = cli.main(_args(d, trace, prof, "bad", *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert cli.main(_args(d, trace, prof, "ok" + extra[0])) == 0       # without asking: point estimates


def test_a_confidence_outside_0_1_is_named(cli_dir, capsys):
    d, trace = cli_dir
    prof = _profile(d / "two.json", [COST, scaled(COST, 1.1)])
    code = cli.main(_args(d, trace, prof, "bad2", "--confidence", "1.5"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--confidence=1.5 is not allowed: a number in (0, 1)" in err[0], err


@pytest.mark.parametrize("extra, expected", [
    (("--repeats", "0"), "--repeats=0 is not allowed: an integer >= 1"),
    (("--cooldown", "-1"), "--cooldown='-1' is not allowed"),
])
def test_bad_profile_repeats_or_cooldown_is_one_line(tmp_path, capsys, extra, expected):
    code = cli.main(["plan", "profile", "--out", str(tmp_path / "p.json"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "p.json").exists()
