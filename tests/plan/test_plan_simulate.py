"""The simulator drives the serving engine's own scheduling code: with equal step costs it admits, preempts and
finishes the same requests in the same order as the real engine; it is deterministic; routing by prefix
affinity raises prefix-cache hits."""

import dataclasses

import numpy as np
import pytest
from conftest import tiny_config
from serving_util import SMALL_BUCKETS, lively_model

from dantinox.plan.candidate import Candidate
from dantinox.plan.cost_model import CostModel, constant
from dantinox.plan.replay import RealReplica
from dantinox.plan.router import Router
from dantinox.plan.simulate import SimReplica, run_trace, simulate
from dantinox.plan.trace import TraceRequest, prompt_token_ids
from dantinox.serving.engine import EngineConfig


def _trace(n=9, seed=0):
    rng = np.random.default_rng(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += float(rng.choice([0.0, 0.5, 1.0, 2.5]))
        reqs.append(TraceRequest(index=i, arrival=t, max_tokens=int(rng.integers(3, 12)),
                                 prompt_tokens=int(rng.integers(3, 20)), prefix="sys" if i % 2 else None,
                                 prefix_tokens=3 if i % 2 else 0))
    return reqs


def _events(req):
    """A request's scheduling history without token values (the simulator's tokens are all 0)."""
    return [e for e in req.events if e[0] != "token"]


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_simulator_and_engine_same_order_with_equal_step_costs():
    cfg = tiny_config(max_context=48)
    model = lively_model(cfg)
    config = EngineConfig(block_size=4, num_blocks=14, max_running=4, max_batched_tokens=16,
                          decode_buckets=(1, 4), max_decode_steps=3, **SMALL_BUCKETS)
    reqs = _trace()
    prompts = [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]
    from dantinox.serving.engine import PagedEngine

    real = RealReplica(PagedEngine(model, config), step_seconds=1.0)
    sim = SimReplica(cfg, config, constant(1.0))
    out_real = run_trace([real], Router("round_robin"), reqs, prompts)
    out_sim = run_trace([sim], Router("round_robin"), reqs, prompts)
    assert out_real["preemptions"] > 0, "the trace must exercise preemption"
    assert sim.finished_order == real.finished_order
    finished = {r.request_id: r for r in real.engine.finished}
    for rid in real.finished_order:
        sim_req = next(r for r in sim.requests if r.request_id == rid)
        assert _events(sim_req) == _events(finished[rid]), rid
    for a, b in zip(out_real["records"], out_sim["records"]):
        assert a.token_times == b.token_times
    assert out_real["prefix_cache_hits"] == out_sim["prefix_cache_hits"]


def test_simulation_is_deterministic_and_uses_profiled_costs():
    cfg = tiny_config(max_context=48)
    reqs = _trace(20, seed=1)
    prompts = [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]
    cost = CostModel(forward=(1e-3, 2e-4, 1e-5), decode_call=5e-4, decode_iter=(1e-4, 1e-5, 1e-7))
    cand = Candidate(block_size=4, max_running=4, max_batched_tokens=16)
    a = simulate(cfg, cand, cost, reqs, prompts)
    b = simulate(cfg, cand, cost, reqs, prompts)
    a.pop("records"), b.pop("records")
    assert a == b
    slower = simulate(cfg, cand, CostModel(forward=(2e-3, 4e-4, 2e-5), decode_call=1e-3,
                                           decode_iter=(2e-4, 2e-5, 2e-7)), reqs, prompts)
    assert slower["ttft"]["p50"] > a["ttft"]["p50"]


def test_prefix_affinity_raises_prefix_cache_hits():
    cfg = tiny_config(max_context=64)
    reqs = [TraceRequest(index=i, arrival=0.5 * i, max_tokens=4, prompt_tokens=24, prefix=f"sys{(i // 2) % 2}",
                         prefix_tokens=16) for i in range(16)]
    prompts = [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]
    cost = constant(0.02)
    hits = {}
    for routing in ("round_robin", "prefix_affinity"):
        cand = Candidate(block_size=4, max_running=4, max_batched_tokens=16, replicas=2, routing=routing)
        hits[routing] = simulate(cfg, cand, cost, reqs, prompts)["prefix_cache_hits"]
    assert hits["prefix_affinity"] > hits["round_robin"]


def test_a_step_after_idle_pays_the_measured_wake_up_and_the_steps_just_after_it_run_slower():
    """wake = (idle seconds, extra seconds of the first step, slower fraction within cold_window): a request
    reaching an idle replica pays them; one arriving while it is busy pays nothing."""
    cfg = tiny_config(max_context=48)
    cost = CostModel(forward=(0.01, 0.0, 0.0), wake=((0.05, 0.004, 0.5),), cold_window=0.015)
    cand = Candidate(block_size=4, max_running=4, max_batched_tokens=16, max_decode_steps=1)
    reqs = [TraceRequest(index=0, arrival=1.0, max_tokens=4, prompt_tokens=8),
            TraceRequest(index=1, arrival=1.025, max_tokens=1, prompt_tokens=8)]
    prompts = [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]
    first, second = simulate(cfg, cand, cost, reqs, prompts)["records"]
    alone = simulate(cfg, cand, cost, reqs[:1], prompts[:1])["records"][0]
    # idle since the start: 4 ms more and 1.5x its 10 ms call; then 10 ms steps (the window has passed)
    np.testing.assert_allclose(alone.token_times, [1.019, 1.029, 1.039, 1.049])
    # the second request joins the busy replica's step at 1.029 (a decode call and a prefill call: 20 ms), no
    # wake-up and no slow-down
    np.testing.assert_allclose(first.token_times, [1.019, 1.029, 1.049, 1.059])
    np.testing.assert_allclose(second.token_times, [1.049])
    assert cost.wake_cost(0.025) == 0.002 and cost.cold_fraction(1.0) == 0.5        # linear, then flat


def test_decode_cost_interpolates_the_measured_points_of_a_batch_size():
    """Measured (B, S, n) points are used per batch size, linear in n then in S; other batch sizes use the
    fitted form."""
    points = {"2,64,4": 4.0, "2,64,8": 6.0, "2,256,4": 8.0, "2,256,8": 12.0}
    cost = CostModel(decode_call=1.0, decode_iter=(0.5, 0.1, 0.0), decode_points=points)
    assert cost.decode_cost(2, 64, 8) == 6.0 and cost.decode_cost(2, 256, 4) == 8.0
    assert cost.decode_cost(2, 64, 6) == 5.0                        # halfway in n
    assert cost.decode_cost(2, 160, 6) == (5.0 + 10.0) / 2          # and halfway in S
    assert cost.decode_cost(4, 64, 8) == 1.0 + 8 * (0.5 + 0.4)      # not measured: c0 + n (d0 + d1 B)
    assert CostModel.from_dict(cost.to_dict()) == cost


def test_a_short_decode_call_never_costs_zero_and_a_bad_cost_field_is_named():
    """Below the smallest measured iteration count the cost runs from the line's intercept (clipped at 0) to
    the measured point, so n = 1 costs more than 0 even when the line through n = 4 and 8 crosses 0; a field
    of the wrong type is refused naming the field."""
    import pytest
    cost = CostModel(decode_points={"4,64,4": 1.0, "4,64,8": 3.0})      # the line crosses 0 at n = 2
    assert 0 < cost.decode_cost(4, 64, 1) < cost.decode_cost(4, 64, 4) == 1.0
    assert cost.decode_cost(4, 64, 1) == 0.25                           # from (0, 0) to (4, 1.0)
    good = cost.to_dict()
    for field, bad in (("decode_points", "garbage"), ("cold_window", "x"), ("forward", "abc"), ("wake", [[1, "a"]])):
        with pytest.raises(ValueError, match=f"field '{field}'"):
            CostModel.from_dict(dict(good, **{field: bad}))
    with pytest.raises(ValueError, match="field 'copy' is missing"):
        CostModel.from_dict({k: v for k, v in good.items() if k != "copy"})


# Step-time spread ---------------------------------------------------------------------------------------------

def test_spread_quantiles_keep_the_mean_and_the_shape_of_the_calibration_steps():
    """spread_quantiles: 21 ascending quantiles of real / fitted step time, scaled so a draw's mean is 1."""
    from dantinox.plan.profile import spread_quantiles
    rng = np.random.default_rng(0)
    ratios = rng.lognormal(0.1, 0.4, 400)                     # a right-skewed spread, mean about 1.2
    pairs = [(1e-3, 2e-4 + 2.0 * 1e-3 * r) for r in ratios]   # h = 2e-4, s = 2: fitted 2.2 ms
    q = spread_quantiles(pairs, 2e-4, 2.0)
    assert len(q) == 21 and all(b >= a for a, b in zip(q, q[1:]))
    assert np.mean((np.array(q[1:]) + np.array(q[:-1])) / 2) == pytest.approx(1.0)
    walls = np.array([w for _, w in pairs]) / 2.2e-3
    np.testing.assert_allclose(q[10], np.median(walls) / np.mean(walls), rtol=0.05)   # the median, rescaled
    assert spread_quantiles(pairs[:1], 2e-4, 2.0) == []


def test_spread_factor_interpolates_the_quantiles_and_round_trips():
    cost = CostModel(forward=(1e-3, 0.0, 0.0), forward_spread=(0.5, 1.0, 1.5), decode_spread=(0.8, 1.2))
    assert cost.spread_factor(False, 0.0) == 0.5 and cost.spread_factor(False, 0.25) == 0.75
    assert cost.spread_factor(False, 1.0) == 1.5 and cost.spread_factor(True, 0.5) == pytest.approx(1.0)
    assert cost.step_seconds(False, 1e-3, draw=0.25) == pytest.approx(0.75e-3)
    assert cost.step_seconds(False, 1e-3) == 1e-3                            # no draw: factor 1
    assert CostModel(forward=(1e-3, 0.0, 0.0)).spread_factor(True, 0.9) == 1.0   # no spread stored
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert "forward_spread" not in CostModel().to_dict()       # a profile without a spread keeps its bytes
    for bad in ([1.0], [1.2, 0.8], [0.0, 1.0], "x"):
        with pytest.raises(ValueError, match="field 'forward_spread'"):
            CostModel.from_dict(dict(cost.to_dict(), forward_spread=bad))


def test_a_wider_step_spread_raises_p99_ttft_keeps_throughput_and_stays_deterministic():
    """Queueing delay grows with the variance of service times (Kingman): with the same mean step cost a
    spread raises the tail of TTFT; an all-ones spread changes nothing; the same inputs give the same result."""
    cfg = tiny_config(max_context=48)
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.008, 120))   # busy, not saturated (p99 TTFT 17 ms without spread)
    reqs = [TraceRequest(index=i, arrival=float(t), max_tokens=6, prompt_tokens=8) for i, t in enumerate(arrivals)]
    prompts = [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]
    cand = Candidate(block_size=4, max_running=4, max_batched_tokens=16)
    base = CostModel(forward=(2e-3, 2e-4, 1e-5), decode_call=1e-3, decode_iter=(3e-4, 1e-4, 1e-7))
    wide = np.linspace(0.1, 1.9, 21)                  # mean of a draw: 1
    runs = {}
    for name, spread in (("none", ()), ("ones", (1.0,) * 21), ("wide", tuple(wide))):
        cost = dataclasses.replace(base, forward_spread=spread, decode_spread=spread)
        runs[name] = simulate(cfg, cand, cost, reqs, prompts)
        runs[name].pop("records")
    assert runs["ones"] == runs["none"]
    again = simulate(cfg, cand, dataclasses.replace(base, forward_spread=tuple(wide), decode_spread=tuple(wide)),
                     reqs, prompts)
    again.pop("records")
    assert again == runs["wide"]
    assert runs["wide"]["ttft"]["p99"] > 1.2 * runs["none"]["ttft"]["p99"]
    assert runs["wide"]["output_tokens_per_s"] == pytest.approx(runs["none"]["output_tokens_per_s"], rel=0.05)
