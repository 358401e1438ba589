"""The profile times the engine's calls and fits the cost model the simulator uses; it records what it was
measured on."""

import numpy as np
from conftest import spiky_model, tiny_config

from dantinox.plan.cost_model import CostModel
from dantinox.plan.profile import WAKE_GAPS, check_profile, model_identity, take_profile
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer


def test_profile_fits_measured_calls_and_records_identity(tmp_path):
    tok = train_tokenizer("abcdefghij klmnop\n" * 4, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size, max_context=64)
    model = spiky_model(cfg)
    save_run(tmp_path, model, cfg, tok)
    prof = take_profile(str(tmp_path), model, cfg, repeats=2)
    check_profile(prof, model_identity(str(tmp_path), cfg))          # its own model: accepted
    cost = CostModel.from_dict(prof["cost_model"])
    forward = prof["points"]["forward"]
    assert {"1,1", "2,1", "4,1", "1,8", "4,64"} <= set(forward)     # every bucket the engine compiles
    for key, seconds in forward.items():                              # measured shapes are used as measured
        assert cost.forward_cost(*(int(v) for v in key.split(","))) == seconds
    a0, a1, a2 = cost.forward
    assert min(a0, a1, a2) >= 0 and cost.forward_cost(8, 32) == a0 + 8 * a1 + 256 * a2
    for key, seconds in prof["points"]["decode"].items():            # per batch size, as measured
        assert cost.decode_cost(*(int(v) for v in key.split(","))) == seconds
    assert cost.decode_cost(4, 64, 8) >= cost.decode_cost(4, 64, 1) > 0
    assert cost.decode_cost(3, 64, 8) > 0                             # an unmeasured batch: the fitted form
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
    import pytest

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
                     "--candidates", str(candidates), "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["mesh"] == {"data": 1, "model": 1}
