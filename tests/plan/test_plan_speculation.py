"""Speculative decoding in simulation (dantinox/plan/speculation.py), on synthetic costs (no timing): the drawn
accepted counts follow Leviathan et al.'s geometric model, speculation pays at batch 1 with a high acceptance
and loses at a large batch once the verify call's compute grows, and the plan stays byte-identical."""

import json

import numpy as np
import pytest
from conftest import tiny_config

from dantinox.cli import entrypoint as cli
from dantinox.plan.candidate import Candidate, speculative_candidates
from dantinox.plan.cost_model import CostModel
from dantinox.plan.recommend import PlanInputs, make_plan
from dantinox.plan.report import plan_json_bytes
from dantinox.plan.simulate import simulate
from dantinox.plan.speculation import Speculation, accepted_count, expected_tokens_per_step
from dantinox.plan.trace import TraceRequest, prompt_token_ids

# forward_step(B, T) = 1 ms + 0.2 ms x B x T: a verify call (T = k + 1) costs more the more rows it carries
COMPUTE_BOUND = CostModel(forward=(1e-3, 0.0, 2e-4))


def _trace(rows: int, together: bool, max_tokens: int = 40, accept=None):
    """``rows`` requests of 8 prompt tokens: all at time 0 (together) or one every 10 s (one running at a time)."""
    return [TraceRequest(index=i, arrival=0.0 if together else 10.0 * i, max_tokens=max_tokens, prompt_tokens=8,
                         spec_acceptance=accept) for i in range(rows)]


def _run(cand, reqs, cost=COMPUTE_BOUND, acceptance=0.9, seed=0):
    cfg = tiny_config(max_context=128)
    prompts = [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]
    return simulate(cfg, cand, cost, reqs, prompts, spec_acceptance=acceptance, spec_seed=seed)


@pytest.mark.parametrize("a, k", [(0.3, 1), (0.6, 4), (0.9, 4), (0.8, 8)])
def test_expected_tokens_per_step_matches_the_formula(a, k):
    spec = Speculation(k, {"r0": a}, {"r0": 0}, seed=7)
    draws = np.array([spec.draw("r0") for _ in range(20000)])
    expected = (1 - a ** (k + 1)) / (1 - a)
    assert expected_tokens_per_step(a, k) == pytest.approx(expected)
    assert abs(draws.mean() - expected) < 4 * draws.std() / np.sqrt(draws.size)
    for i in range(1, k + 1):        # P(accepted >= i) = a^i (the geometric model), independently counted
        p = np.mean(draws - 1 >= i)
        assert abs(p - a ** i) < 4 * np.sqrt(a ** i * (1 - a ** i) / draws.size) + 1e-12


def test_accepted_count_edges():
    assert accepted_count(0.5, 0.0, 4) == 0 and accepted_count(1e-9, 1.0, 4) == 4
    assert accepted_count(1.0, 0.7, 4) == 0 and accepted_count(1e-300, 0.7, 4) == 4
    assert expected_tokens_per_step(1.0, 3) == 4.0 and expected_tokens_per_step(0.0, 3) == 1.0


def test_simulated_tokens_per_verify_follow_the_formula():
    """Through the simulator, one row at a time, verify cost equal to a plain step (nothing switches off)."""
    flat = CostModel(forward=(1e-3, 0.0, 0.0))
    out = _run(Candidate("spec", spec_tokens=4, max_decode_steps=1), _trace(8, False, 120), flat, 0.6)
    per_call = 1 + out["spec_accepted"] / out["spec_verify_calls"]
    assert out["spec_switched_off"] == 0
    assert per_call == pytest.approx(expected_tokens_per_step(0.6, 4), rel=0.1)
    assert out["output_tokens"] == 8 * 120


def test_speculation_pays_at_batch_1_and_loses_at_batch_16():
    plain, spec = Candidate("plain", max_decode_steps=1), Candidate("spec-4", spec_tokens=4, max_decode_steps=1)
    one_p, one_s = _run(plain, _trace(4, False)), _run(spec, _trace(4, False))
    assert one_s["tpot"]["p50"] < 0.6 * one_p["tpot"]["p50"]      # B = 1, a = 0.9: about 4 tokens per 2 ms
    assert one_s["spec_switched_off"] == 0
    many_p, many_s = _run(plain, _trace(16, True)), _run(spec, _trace(16, True))
    assert many_s["tpot"]["p50"] > many_p["tpot"]["p50"]          # B = 16: a verify costs 17 ms, 4 plain steps
    assert many_s["spec_switched_off"] > 0                          # the engine's rule stops the losing rows
    assert many_s["output_tokens"] == many_p["output_tokens"] == 16 * 40


def test_acceptance_per_trace_line_and_the_missing_rate_is_named():
    reqs = _trace(2, False, accept=1.0)
    out = _run(Candidate("spec", spec_tokens=2, max_decode_steps=1), reqs, CostModel(forward=(1e-3, 0, 0)), None)
    assert out["spec_accepted"] == 2 * out["spec_verify_calls"]      # a = 1: every proposal accepted
    with pytest.raises(ValueError, match="trace line 1 has no spec_acceptance"):
        _run(Candidate("spec", spec_tokens=2), _trace(1, False), acceptance=None)
    with pytest.raises(ValueError, match=r"spec_tokens=17 is not allowed: an integer in \[0, 16\]"):
        Candidate("bad", spec_tokens=17)


def test_plan_with_speculation_is_byte_identical_and_says_how_verify_was_costed():
    cfg = tiny_config(max_context=128)
    reqs = [TraceRequest(index=i, arrival=0.05 * i, max_tokens=24, prompt_tokens=8 + i % 5) for i in range(12)]
    prompts = [prompt_token_ids(q, None, cfg.vocab_size) for q in reqs]
    profiled = CostModel(forward=(1e-3, 0.0, 2e-4), verify_points={"1,3": 1.1e-3})

    def plan():
        inp = PlanInputs(cfg, reqs, prompts, {("float32", "none"): [COMPUTE_BOUND, profiled]},
                         {"ttft_p99": 1.0, "tpot_p99": 1.0}, 2 ** 30, 1.0, 10 ** 6, spec_acceptance=0.7)
        cands = [Candidate("baseline", max_decode_steps=1)] + speculative_candidates((2, 4))
        return make_plan(inp, cands)

    a, b = plan(), plan()
    for result in (a, b):
        for r in result["candidates"]:
            r.pop("ttfts")
    assert plan_json_bytes(a) == plan_json_bytes(b)
    notes = {r["candidate"]["name"]: r["notes"] for r in a["candidates"]}
    assert "verify B x 3 profiled" in notes["spec-2"][0]
    assert "verify B x 5 derived from the forward_step fit" in notes["spec-4"][0]
    assert Candidate.from_dict(a["candidates"][1]["candidate"]).serve_flags()["spec_tokens"] == 2


def test_bad_spec_acceptance_is_one_line_exit_2(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival": 0, "max_tokens": 4, "prompt_tokens": 4}) + "\n")
    assert cli.main(["plan", "--trace", str(trace), "--spec-acceptance", "1.5", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("--spec-acceptance=1.5 is not allowed: an acceptance rate, a number "
                                             "in [0, 1]")
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"arrival": 0, "max_tokens": 4, "prompt_tokens": 4, "spec_acceptance": -1}) + "\n")
    assert cli.main(["plan", "--trace", str(bad), "--out", str(tmp_path / "p")]) == 2
    assert "line 1: field 'spec_acceptance' = -1 is not allowed: a number in [0, 1]" in capsys.readouterr().err


@pytest.mark.slow   # compiles forward_step at B x (k + 1) for each decode bucket of a tiny engine
def test_profile_times_the_verify_call_at_every_decode_bucket():
    from serving_util import lively_model

    from dantinox.plan.profile import fit_cost_model, time_engine, time_verify
    from dantinox.serving.engine import EngineConfig, PagedEngine

    cfg = tiny_config(max_context=64)
    engine = PagedEngine(lively_model(cfg), EngineConfig(block_size=16, max_running=4, max_batched_tokens=16,
                                                          max_decode_steps=4))
    points = time_engine(engine, 1)
    points["verify"] = time_verify(engine, 3, 1)
    assert set(points["verify"]) == {f"{B},4" for B in engine.decode_buckets}
    cost = fit_cost_model(points)
    assert cost.verify_measured(3) and not cost.verify_measured(2)
    for key, seconds in points["verify"].items():     # measured: used as measured; another k: the forward fit
        assert seconds > 0 and cost.verify_cost(int(key.split(",")[0]), 3) == seconds
    assert cost.verify_cost(1, 2) == cost.forward_cost(1, 3)
    assert CostModel.from_dict(cost.to_dict()).verify_points == points["verify"]
