"""The profile times the engine's calls and fits the cost model the simulator uses; it records what it was
measured on. The fit is tested on synthetic timings with a known answer; the tests that take a real profile
(every engine call timed) are in the slow tier and assert its structure, never one measured time against
another."""

import numpy as np
import pytest
from conftest import spiky_model, tiny_config

from dantinox.plan.cost_model import CostModel
from dantinox.plan.profile import (
    WAKE_GAPS,
    _fit_overhead,
    bottleneck_rows,
    check_profile,
    fit_cost_model,
    model_identity,
    take_profile,
)
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer

# Synthetic timings with a known answer: forward_step(B, T) = a0 + a1 B + a2 B T; decode_steps(B, S, n) =
# c + n (d0 + d1 B + d2 B S); a real step costs h + s x its calls' modelled cost. The numbers are chosen so the
# two measured n (and the two measured S) of one batch size are within a factor 2 of each other.
TRUE_FORWARD = (2e-3, 5e-4, 1e-5)
TRUE_DECODE_CALL, TRUE_DECODE_ITER = 1e-3, (2e-4, 3e-5, 1e-8)
TRUE_CALIBRATION = {"forward": (4e-4, 1.25), "decode": (6e-4, 1.1)}
DECODE_BUCKETS, PREFILL_BUCKETS, CHUNKS, TABLE_S, STEPS = (1, 2, 4, 8, 16), (1, 2, 4), (8, 16, 32, 64), (64, 1024), 8


def synthetic_points() -> dict:
    """What time_engine, measure_wake and calibrate_steps return, fabricated from the TRUE_* costs."""
    a0, a1, a2 = TRUE_FORWARD
    d0, d1, d2 = TRUE_DECODE_ITER
    shapes = [(B, 1) for B in DECODE_BUCKETS] + [(B, T) for B in PREFILL_BUCKETS for T in CHUNKS]
    points = {"forward": {f"{B},{T}": a0 + a1 * B + a2 * B * T for B, T in shapes},
              "decode": {f"{B},{S},{n}": TRUE_DECODE_CALL + n * (d0 + d1 * B + d2 * B * S)
                         for B in DECODE_BUCKETS for S in TABLE_S for n in (STEPS // 2, STEPS)},
              "swap_out": 3e-4, "swap_in": 2e-4, "copy": 1e-4}
    points["wake"] = [(g, 1e-3 * (i + 1), 0.05 * i) for i, g in enumerate(WAKE_GAPS)]
    points["cold_window"] = 8 * 2e-3
    calibration = {}
    for kind, (h_key, s_key) in (("forward", ("forward_overhead", "scale")),
                                 ("decode", ("decode_overhead", "decode_scale"))):
        h, s = TRUE_CALIBRATION[kind]
        predicted = np.linspace(1e-3, 2e-2, 12)
        calibration[h_key], calibration[s_key] = _fit_overhead([(p, h + s * p) for p in predicted])
    points["calibration"] = calibration
    return points


def test_profile_fit_recovers_the_costs_of_synthetic_timings():
    """The fit on fabricated measurements with a known answer (no timing in the test): measured shapes are used
    as measured, the fitted forms recover the true coefficients, more decode iterations never cost less."""
    points = synthetic_points()
    cost = CostModel.from_dict(fit_cost_model(points).to_dict())     # through profile.json's form
    forward = points["forward"]
    for key, seconds in forward.items():                              # measured shapes are used as measured
        assert cost.forward_cost(*(int(v) for v in key.split(","))) == seconds
    a0, a1, a2 = cost.forward
    assert min(a0, a1, a2) >= 0 and cost.forward_cost(8, 32) == a0 + 8 * a1 + 256 * a2
    np.testing.assert_allclose(cost.forward, TRUE_FORWARD, rtol=1e-6)
    for key, seconds in points["decode"].items():                     # per batch size, as measured
        assert cost.decode_cost(*(int(v) for v in key.split(","))) == seconds
    d0, d1, d2 = TRUE_DECODE_ITER
    per_iter = d0 + d1 * 4 + d2 * 4 * 64
    assert cost.decode_cost(4, 64, 8) >= cost.decode_cost(4, 64, 1) > 0
    assert cost.decode_cost(4, 64, 1) == pytest.approx(TRUE_DECODE_CALL + per_iter, rel=1e-9)
    assert cost.decode_cost(3, 64, 8) > 0                             # an unmeasured batch: the fitted form
    assert cost.decode_cost(3, 64, 8) == pytest.approx(TRUE_DECODE_CALL + 8 * (d0 + 3 * d1 + 3 * 64 * d2), rel=1e-6)
    assert cost.decode_call == pytest.approx(TRUE_DECODE_CALL, rel=1e-6)
    np.testing.assert_allclose(cost.decode_iter, TRUE_DECODE_ITER, rtol=1e-6)
    assert (cost.swap_out, cost.swap_in, cost.copy) == (3e-4, 2e-4, 1e-4)
    # the calibration (h + s x calls per step kind) and the wake-up points pass through as fitted / measured
    assert cost.scale > 0 and cost.decode_scale > 0 and min(cost.forward_overhead, cost.decode_overhead) >= 0
    assert (cost.forward_overhead, cost.scale) == pytest.approx(TRUE_CALIBRATION["forward"], rel=1e-6)
    assert (cost.decode_overhead, cost.decode_scale) == pytest.approx(TRUE_CALIBRATION["decode"], rel=1e-6)
    assert cost.step == 0.0 and [g for g, _, _ in cost.wake] == list(WAKE_GAPS) and cost.cold_window > 0
    assert all(e >= 0 and f >= 0 for _, e, f in cost.wake)
    assert cost.wake_cost(WAKE_GAPS[1]) == pytest.approx(2e-3)
    # the bottleneck report on made-up machine rates
    cfg = tiny_config(max_context=64)
    rates = {"bandwidth_bytes_per_s": 1e10, "matmul_flops_per_s": 1e11}
    rows = bottleneck_rows(cfg, points, rates, weights_bytes=400_000, kv_bytes_per_token=1024)
    kinds = {r["call"] for r in rows}
    assert kinds == {"prefill", "decode (one step)", "decode (multi-step)"}
    for r in rows:
        assert r["bound"] == ("memory" if r["memory_s"] >= r["compute_s"] else "compute")
        assert np.isclose(r["memory_s"], r["bytes"] / rates["bandwidth_bytes_per_s"])
    assert sum(r["call"] == "decode (multi-step)" for r in rows) == len(DECODE_BUCKETS) * len(TABLE_S)


@pytest.mark.slow
def test_profile_fits_measured_calls_and_records_identity(tmp_path):
    """A real profile of a tiny model (every call timed on this machine): its structure, identity and how the
    cost model uses what was measured. Nothing here compares two measured times (the machine's load decides
    those); the fit itself is tested on synthetic timings above."""
    tok = train_tokenizer("abcdefghij klmnop\n" * 4, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size, max_context=64)
    model = spiky_model(cfg)
    save_run(tmp_path, model, cfg, tok)
    prof = take_profile(str(tmp_path), model, cfg, repeats=2)
    check_profile(prof, model_identity(str(tmp_path), cfg))          # its own model: accepted
    assert prof["machine"]["devices_used"] == 1                       # no mesh: one device, whatever the host has
    cost = CostModel.from_dict(prof["cost_model"])
    forward = prof["points"]["forward"]
    assert {"1,1", "2,1", "4,1", "1,8", "4,64"} <= set(forward)     # every bucket the engine compiles
    for key, seconds in forward.items():                              # measured shapes are used as measured
        assert cost.forward_cost(*(int(v) for v in key.split(","))) == seconds
    a0, a1, a2 = cost.forward
    assert min(a0, a1, a2) >= 0 and cost.forward_cost(8, 32) == a0 + 8 * a1 + 256 * a2
    for key, seconds in prof["points"]["decode"].items():            # per batch size, as measured
        assert cost.decode_cost(*(int(v) for v in key.split(","))) == seconds
    assert {tuple(int(v) for v in k.split(","))[2] for k in prof["points"]["decode"]} == {4, 8}
    assert cost.decode_cost(3, 64, 8) >= 0                            # an unmeasured batch: the fitted form
    # calibrated on real steps, per step kind; the wake-up cost is measured at every listed idle time
    assert cost.scale > 0 and cost.decode_scale > 0 and min(cost.forward_overhead, cost.decode_overhead) >= 0
    assert cost.step == 0.0 and [g for g, _, _ in cost.wake] == list(WAKE_GAPS) and cost.cold_window > 0
    assert all(e >= 0 and f >= 0 for _, e, f in cost.wake)
    kinds = {r["call"] for r in prof["bottleneck"]}
    assert kinds == {"prefill", "decode (one step)", "decode (multi-step)"}
    for r in prof["bottleneck"]:
        assert r["bound"] == ("memory" if r["memory_s"] >= r["compute_s"] else "compute")
        assert np.isclose(r["memory_s"], r["bytes"] / prof["rates"]["bandwidth_bytes_per_s"])


def test_profile_from_before_a_config_field_existed_is_checked_against_its_default():
    """A profile written before a ModelConfig field was added (no key in its config) matches a model with that
    field at its default, and still refuses a model that sets it; a recorded value is compared as recorded."""
    from dantinox.plan.profile import PROFILE_FORMAT
    cfg = tiny_config(vocab_size=40, max_context=64).to_dict()
    identity = {"weights_sha256": "ab" * 32, "config": cfg, "dantinox_version": "x"}
    old = {k: v for k, v in cfg.items() if k != "qkv_bias"}
    profile = {"format": PROFILE_FORMAT, "identity": {**identity, "config": old}}
    check_profile(profile, identity)                                  # qkv_bias absent = False: accepted
    with pytest.raises(ValueError, match=r"qkv_bias=False, this model has qkv_bias=True"):
        check_profile(profile, {**identity, "config": {**cfg, "qkv_bias": True}})
    with pytest.raises(ValueError, match=r"the profile's model has dim="):
        check_profile({**profile, "identity": {**identity, "config": {**old, "dim": cfg["dim"] * 2}}}, identity)


@pytest.mark.slow   # takes a real profile (every engine call timed, with idle gaps)
def test_plan_profiles_itself_on_the_mesh_given_and_records_it(tmp_path):
    """``dantinox plan --mesh data=1,model=1`` (no --profile) takes its profile on that mesh; plan.json says
    which mesh its costs were measured on."""
    import json

    from dantinox.cli import entrypoint as cli
    tok = train_tokenizer("abcdefghij klmnop\n" * 4, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size, max_context=64)
    save_run(tmp_path / "run", spiky_model(cfg), cfg, tok)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"arrival": {0.01 * i}, "prompt_tokens": 8, "max_tokens": 4}}\n' for i in range(4)))
    candidates = tmp_path / "c.yaml"
    candidates.write_text("- {name: baseline}\n")
    assert cli.main(["plan", "--run_dir", str(tmp_path / "run"), "--trace", str(trace), "--mesh", "data=1,model=1",
                     "--profile-repeats", "1", "--cooldown", "0", "--candidates", str(candidates),
                     "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["mesh"] == {"data": 1, "model": 1}


@pytest.mark.slow   # two real profiles of a tiny model
def test_profile_with_two_samples_keeps_both(tmp_path):
    from dantinox.plan.profile import PROFILE_FORMAT, profile_cost_models
    tok = train_tokenizer("abcdefghij klmnop\n" * 4, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size, max_context=64)
    model = spiky_model(cfg)
    save_run(tmp_path, model, cfg, tok)
    prof = take_profile(str(tmp_path), model, cfg, repeats=2, samples=2, cooldown_s=0.01)
    check_profile(prof, model_identity(str(tmp_path), cfg))
    assert prof["format"] == PROFILE_FORMAT and len(prof["samples"]) == 2 and prof["cooldown_s"] == 0.01
    assert prof["samples"][0]["points"] == prof["points"] and prof["cost_model"] == prof["samples"][0]["cost_model"]
    costs = profile_cost_models(prof)
    assert len(costs) == 2 and all(set(c.points) == set(prof["points"]["forward"]) for c in costs)


def test_calibration_workload_stops_growing_with_the_context():
    """A long-context model (SmolLM2: 8192) calibrates on the workload of a 1024-token one, not on prompts of
    up to 2048 tokens; a short-context model's workload is as before (L / 4 prompt, L / 8 new tokens)."""
    from dantinox.plan.profile import CALIBRATION_CONTEXT, _burst

    def longest(work):
        return max(len(ids) for _, ids, _ in work), max(o.max_new_tokens for _, _, o in work)

    assert longest(_burst("t", 100, 8192)) == longest(_burst("t", 100, CALIBRATION_CONTEXT))
    prompt, new = longest(_burst("t", 100, 8192))
    assert prompt <= CALIBRATION_CONTEXT // 4 and new <= CALIBRATION_CONTEXT // 8
    short = _burst("t", 100, 256)
    assert [len(ids) for _, ids, _ in short] == [8 + (37 * i) % 56 for i in range(24)]
    assert [o.max_new_tokens for _, _, o in short] == [4 + (23 * i) % 28 for i in range(24)]


def test_max_context_serves_a_shorter_context_and_a_profile_of_another_is_refused(tmp_path):
    """--max-context N: the same weights served with an N-token context (the engine's tables and pool sized
    for N, what the profile then times); a profile of another context is refused naming both and the flag;
    a value outside [1, the model's context] is refused naming the flag."""
    from dantinox.plan.inputs import load_model
    from dantinox.serving.engine import EngineConfig, PagedEngine
    from dantinox.serving.request import SamplingOptions

    tok = train_tokenizer("abcdefghij klmnop\n" * 4, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size, max_context=256)
    save_run(tmp_path, spiky_model(cfg), cfg, tok)
    _, full, full_cfg, _ = load_model(str(tmp_path))
    _, short, short_cfg, _ = load_model(str(tmp_path), 64)
    assert short_cfg == full_cfg.replace(max_context=64) and short.cfg == short_cfg
    assert load_model(str(tmp_path), 256)[2] == full_cfg                          # its own context: unchanged
    config = EngineConfig(block_size=16, max_running=4, max_batched_tokens=32)
    wide, narrow = PagedEngine(full, config), PagedEngine(short, config)
    assert (wide.table_width, narrow.table_width) == (16, 4) and narrow.table_buckets[-1] == 4
    assert narrow.allocator.num_blocks < wide.allocator.num_blocks
    outputs = []
    for engine in (wide, narrow):                                                 # the same weights, same tokens
        engine.add_request([3, 4, 5, 6], SamplingOptions(5), request_id="r")
        req = engine.requests["r"]
        while engine.has_unfinished():
            engine.step()
        outputs.append(list(req.output_ids))
    assert len(outputs[0]) == 5 and outputs[0] == outputs[1]
    profile = {"format": 3, "identity": model_identity(str(tmp_path), short_cfg)}
    check_profile(profile, model_identity(str(tmp_path), short_cfg))
    with pytest.raises(ValueError, match=r"max_context=64, this model has max_context=256: plan with "
                                         r"--max-context 64, or profile with --max-context 256"):
        check_profile(profile, model_identity(str(tmp_path), full_cfg))
    for bad in (0, 257, 1.5, True, "64"):
        with pytest.raises(ValueError, match=r"--max-context=.* is not allowed: an integer from 1 to the model's "
                                             r"max_context \(256\)"):
            load_model(str(tmp_path), bad)


def test_calibration_runs_share_no_prompt_block():
    """The warm-up, timed and again runs of calibrate_steps use prompts of their own: "timed" and "again" have the
    same length, and the prompts once depended on the tag's length only, so the second timed run hit the
    first one's prefix cache (found by benchmarks/plan_requests.py, 2026-12-04) and timed cheaper prefills."""
    from dantinox.plan.profile import _burst

    block = 16
    firsts = {tag: {tuple(ids[:block]) for _, ids, _ in _burst(tag, 49152, 1024) if len(ids) >= block}
              for tag in ("warm", "timed", "again")}
    assert firsts["timed"] and not (firsts["timed"] & firsts["again"]) and not (firsts["warm"] & firsts["timed"])
