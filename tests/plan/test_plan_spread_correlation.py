"""Correlated step-time draws (dantinox/plan/spread_draws.py), on synthetic costs (no timing): correlation 0 is
the independent stream of before; a positive correlation keeps each draw's distribution (the stored quantiles,
mean 1) and raises p99 TTFT at equal throughput; the fit recovers an AR(1) coefficient; the field round-trips,
bad values are named, and plans stay byte-identical."""

import dataclasses
import random
from statistics import NormalDist

import numpy as np
import pytest
from conftest import tiny_config

from dantinox.plan.candidate import Candidate
from dantinox.plan.cost_model import CostModel
from dantinox.plan.profile import fit_cost_model, spread_correlation
from dantinox.plan.recommend import PlanInputs, make_plan
from dantinox.plan.report import plan_json_bytes
from dantinox.plan.simulate import simulate
from dantinox.plan.spread_draws import SpreadDraws
from dantinox.plan.trace import TraceRequest, prompt_token_ids

WIDE = tuple(float(x) for x in np.linspace(0.1, 1.9, 21))   # the mean of a draw: 1
BASE = CostModel(forward=(2e-3, 2e-4, 1e-5), decode_call=1e-3, decode_iter=(3e-4, 1e-4, 1e-7),
                 forward_spread=WIDE, decode_spread=WIDE)


def _lag1(u: np.ndarray) -> float:
    z = np.array([NormalDist().inv_cdf(min(max(x, 1e-12), 1 - 1e-12)) for x in u])
    return float(np.corrcoef(z[:-1], z[1:])[0, 1])


def test_zero_correlation_is_the_independent_stream_of_before():
    ours, plain = SpreadDraws(0.0, 5), random.Random(5)
    assert [ours.random() for _ in range(1000)] == [plain.random() for _ in range(1000)]
    assert CostModel.from_dict(dataclasses.replace(BASE).to_dict()).spread_correlation == 0.0
    assert "spread_correlation" not in BASE.to_dict()          # a profile without it keeps its bytes
    u = np.array(_draws(0.0, 20000))
    assert abs(_lag1(u)) < 0.03


def _draws(rho: float, n: int, seed: int = 0) -> list:
    s = SpreadDraws(rho, seed)
    return [s.random() for _ in range(n)]


@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_correlated_draws_keep_the_marginal_quantiles_and_the_mean(rho):
    """Each u is uniform (so each factor has the stored quantiles as its distribution, mean 1); consecutive
    normal scores correlate at rho. Tolerances are for the AR(1)'s effective sample size n (1 - rho) / (1 + rho)."""
    n = 60000
    u = np.array(_draws(rho, n))
    assert 0.0 <= u.min() and u.max() < 1.0
    n_eff = n * (1 - rho) / (1 + rho)
    grid = np.linspace(0.05, 0.95, 19)
    assert np.max(np.abs(np.quantile(u, grid) - grid)) < 2.0 / np.sqrt(n_eff)   # a KS-like bound
    assert _lag1(u) == pytest.approx(rho, abs=0.03)
    factors = np.array([BASE.spread_factor(False, x) for x in u])
    assert factors.mean() == pytest.approx(1.0, abs=4 * factors.std() / np.sqrt(n_eff))
    stored = np.array(WIDE)[1:-1]                               # the quantiles at 5 %, 10 %, .., 95 %
    assert np.max(np.abs(np.quantile(factors, np.linspace(0.05, 0.95, 19)) - stored)) < 0.05
    assert _draws(rho, 50, seed=3) == _draws(rho, 50, seed=3) != _draws(rho, 50, seed=4)


def _busy_trace(n=400, seed=3):
    cfg = tiny_config(max_context=48)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.008, n))   # busy, not saturated
    reqs = [TraceRequest(index=i, arrival=float(t), max_tokens=6, prompt_tokens=8) for i, t in enumerate(arrivals)]
    return cfg, reqs, [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]


def test_correlated_steps_raise_p99_ttft_at_equal_throughput_and_zero_changes_nothing():
    cfg, reqs, prompts = _busy_trace()
    cand = Candidate(block_size=4, max_running=4, max_batched_tokens=16)
    runs = {}
    for rho in (0.0, 0.9):
        runs[rho] = simulate(cfg, cand, dataclasses.replace(BASE, spread_correlation=rho), reqs, prompts)
        runs[rho].pop("records")
    before = simulate(cfg, cand, BASE, reqs, prompts)           # no field: the independent draws
    before.pop("records")
    assert runs[0.0] == before
    assert runs[0.9]["ttft"]["p99"] > 1.5 * runs[0.0]["ttft"]["p99"]
    assert runs[0.9]["output_tokens_per_s"] == pytest.approx(runs[0.0]["output_tokens_per_s"], rel=0.05)
    again = simulate(cfg, cand, dataclasses.replace(BASE, spread_correlation=0.9), reqs, prompts)
    again.pop("records")
    assert again == runs[0.9]


def _ar1_runs(rho: float, steps: int, runs: int, seed: int = 0) -> list:
    """Calibration-like runs [(kind, predicted, wall)]: alternating kinds, wall / fitted = exp(0.3 z), z AR(1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(runs):
        z, run = rng.normal(), []
        for t in range(steps):
            z = rho * z + np.sqrt(1 - rho ** 2) * rng.normal() if t else z
            kind = "decode" if t % 3 else "forward"
            predicted = 1e-3 * (1 + t % 5)
            run.append((kind, predicted, (2e-4 + 1.5 * predicted) * float(np.exp(0.3 * z))))
        out.append(run)
    return out


@pytest.mark.parametrize("rho", [0.0, 0.6])
def test_the_fit_recovers_the_lag1_correlation(rho):
    fits = {"forward": (2e-4, 1.5), "decode": (2e-4, 1.5)}
    est = spread_correlation(_ar1_runs(rho, 400, 2), fits)
    assert est == pytest.approx(rho, abs=0.1)
    assert 0.0 <= est <= 0.95
    assert spread_correlation([[("forward", 1e-3, 1e-3)] * 2], fits) == 0.0          # fewer than 3 pairs
    # pairs never straddle runs: two constant runs at different levels have no within-run variation
    flat = [[("decode", 1e-3, 1e-3)] * 10, [("decode", 1e-3, 2e-3)] * 10]
    assert spread_correlation(flat, fits) == 0.0


def test_round_trip_and_bad_values_are_named():
    cost = dataclasses.replace(BASE, spread_correlation=0.7)
    assert cost.to_dict()["spread_correlation"] == 0.7
    assert CostModel.from_dict(cost.to_dict()) == cost
    points = {"forward": {"1,1": 1e-3, "1,8": 2e-3, "2,8": 3e-3}, "decode": {"1,64,4": 4e-3, "1,64,8": 7e-3},
              "swap_out": 1e-4, "swap_in": 1e-4, "copy": 1e-5,
              "calibration": {"scale": 1.1, "forward_spread": list(WIDE), "spread_correlation": 0.4}}
    assert fit_cost_model(points).spread_correlation == 0.4
    for bad in (-0.1, 1.0, 1.5, "x", True, None):
        with pytest.raises(ValueError, match="field 'spread_correlation'"):
            CostModel.from_dict(dict(cost.to_dict(), spread_correlation=bad))
    with pytest.raises(ValueError, match="spread_correlation"):
        CostModel(spread_correlation=1.0)


def test_plan_with_correlated_profiles_is_byte_identical():
    cfg, reqs, prompts = _busy_trace(n=60)
    costs = [dataclasses.replace(BASE, spread_correlation=0.8), dataclasses.replace(BASE, spread_correlation=0.3)]

    def plan():
        inp = PlanInputs(cfg, reqs, prompts, {("float32", "none"): costs}, {"ttft_p99": 1.0, "tpot_p99": 1.0},
                         2 ** 30, 1.0, 10 ** 6)
        result = make_plan(inp, [Candidate("baseline", block_size=4, max_running=4, max_batched_tokens=16)])
        for r in result["candidates"]:
            r.pop("ttfts")
        return plan_json_bytes(result)

    assert plan() == plan()
