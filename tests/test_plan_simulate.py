"""The simulator drives the serving engine's own scheduling code: with equal step costs it admits, preempts and
finishes the same requests in the same order as the real engine; it is deterministic; routing by prefix
affinity raises prefix-cache hits."""

import numpy as np

from conftest import tiny_config
from dantinox.plan.candidate import Candidate
from dantinox.plan.cost_model import CostModel, constant
from dantinox.plan.replay import RealReplica
from dantinox.plan.router import Router
from dantinox.plan.simulate import SimReplica, run_trace, simulate
from dantinox.plan.trace import TraceRequest, prompt_token_ids
from dantinox.serving.engine import EngineConfig
from serving_util import SMALL_BUCKETS, lively_model


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
