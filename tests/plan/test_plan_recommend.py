"""The plan's drop rules (memory, SLO, quality), the fallback, the course's failure caught, byte-identical
plan.json, the release gate, and bad input (exit 2, one line)."""

import json
import os

import numpy as np
import pytest
from paths import REPO

from dantinox.budget.memory import param_bytes
from dantinox.cli import entrypoint as cli
from dantinox.config import ModelConfig
from dantinox.plan.candidate import Candidate, default_candidates
from dantinox.plan.cost_model import CostModel
from dantinox.plan.quality_gate import GateResult
from dantinox.plan.recommend import PlanInputs, make_plan
from dantinox.plan.trace import TraceSpec, default_classes, generate_trace, prompt_token_ids, read_trace, trace_text
from dantinox.runs.bundled import bundled_run_dir
from dantinox.runs.tokenizer import TextTokenizer

# ../shared/data beside the repository (CI lays it there); the test writes its own slice when it is absent
RARE = os.path.join(REPO, "..", "shared", "data",
                    "slices-rare-latin-occitan.txt")
# costs of the bundled model's calls as profiled on the 2-core development host (seconds)
COST = CostModel(forward=(1.4e-3, 4.5e-4, 1.9e-4), decode_call=6e-3, decode_iter=(8.6e-4, 1.8e-4, 1.4e-6))
MiB = 2 ** 20


@pytest.fixture(scope="module")
def bundled():
    run = bundled_run_dir()
    cfg = ModelConfig.from_dict(json.load(open(os.path.join(run, "config.json"))))
    return cfg, TextTokenizer.load(os.path.join(run, "tokenizer.json"))


@pytest.fixture(scope="module")
def mixed_trace(bundled, tmp_path_factory):
    """60 requests, gamma (bursty) arrivals at 8 requests/s: chat behind a shared prefix, documents, and a rare
    Latin/Occitan slice whose prompts come from the shared data file (a stand-in text if it is absent)."""
    cfg, tok = bundled
    d = tmp_path_factory.mktemp("trace")
    rare = RARE if os.path.exists(RARE) else str(d / "rare.txt")
    if rare != RARE:
        open(rare, "w").write("Tan m'abellis vostre cortes deman,\nqu'ieu no me puesc ni voill a vos cobrire.\n")
    recs = generate_trace(TraceSpec(requests=60, rate=8, classes=default_classes(rare), arrivals="gamma", seed=0))
    path = d / "t.jsonl"
    path.write_text(trace_text(recs))
    reqs = read_trace(str(path), cfg.max_context)
    return reqs, [prompt_token_ids(q, tok, cfg.vocab_size) for q in reqs]


def _inputs(bundled, trace, **kw):
    cfg, _ = bundled
    fields = dict(cfg=cfg, requests=trace[0], prompts=trace[1], costs={("float32", "none"): COST},
                  slo={"ttft_p99": 0.2, "tpot_p99": 0.2}, device_bytes=64 * MiB, price_per_hour=2.0,
                  weights_bytes=param_bytes(cfg),
                  gates={("float32", "none"): GateResult(True), ("int8", "int8"): GateResult(True)})
    fields.update(kw)
    return PlanInputs(**fields)


def _row(plan, name):
    return next(r for r in plan["candidates"] if r["candidate"]["name"] == name)


def test_memory_drop_rule(bundled, mixed_trace):
    cands = [Candidate("baseline"), Candidate("running-32", max_running=32)]
    plan = make_plan(_inputs(bundled, mixed_trace, device_bytes=24 * MiB), cands)
    big, base = _row(plan, "running-32"), _row(plan, "baseline")
    cfg = bundled[0]
    kv = 32 * (cfg.max_context // 16) * 16 * cfg.num_blocks * 2 * cfg.kv_heads * cfg.head_size * 4
    assert big["ledger"]["kv"] == kv
    assert big["ledger"]["weights"] + kv + big["ledger"]["reserve"] > 24 * MiB
    assert big["dropped"] and big["dropped"][0].startswith("memory:") and big["metrics"] is None
    assert not base["dropped"]
    assert plan["recommendation"] == {"name": "baseline", "candidate": base["candidate"], "fallback": False,
                                      "reason": "cheapest of 1 passing candidates"}


def test_slo_drop_rule_uses_p99_ttft_of_the_simulation(bundled, mixed_trace):
    cands = [Candidate("baseline"), Candidate("single-step", max_decode_steps=1)]
    loose = make_plan(_inputs(bundled, mixed_trace), cands)
    p99 = {n: _row(loose, n)["metrics"]["ttft"]["p99"] for n in ("baseline", "single-step")}
    assert p99["single-step"] < p99["baseline"]
    slo = (p99["single-step"] + p99["baseline"]) / 2
    tight = make_plan(_inputs(bundled, mixed_trace, slo={"ttft_p99": slo}), cands)
    base = _row(tight, "baseline")
    assert base["dropped"] == [f"SLO: p99 TTFT {p99['baseline'] * 1e3:.1f} ms > {slo * 1e3:.1f} ms"]
    assert not _row(tight, "single-step")["dropped"]
    assert tight["recommendation"]["name"] == "single-step"
    ttfts = [t for t in _row(tight, "baseline")["ttfts"]]
    assert np.isclose(np.percentile(ttfts, 99), p99["baseline"])    # independent recomputation


def test_course_failure_max_throughput_rejected_and_plan_falls_back(bundled, mixed_trace):
    """The candidate that maximizes aggregate tokens/s (largest batch and chunks, int8 everything) on a trace
    with a rare-language slice and a tight p99 TTFT SLO is rejected for p99 TTFT and for the rare slice's
    quality gate; with nothing else passing, the plan recommends the named baseline, never the failing one."""
    gates = {("float32", "none"): GateResult(True),
             ("int8", "int8"): GateResult(False, ("rare: loss_per_char +0.21 nats > 0.05",), "failed")}
    max_tp = next(c for c in default_candidates() if c.name == "max-throughput")
    assert (max_tp.max_running, max_tp.max_batched_tokens, max_tp.kv_dtype, max_tp.quantize) == (64, 256, "int8",
                                                                                                "int8")
    assert max_tp.block_size is None and max_tp.for_model(bundled[0]).block_size == 64   # keys per channel in
    #                                                                   groups of 64 (the int8 default): one a block
    plan = make_plan(_inputs(bundled, mixed_trace, gates=gates, slo={"ttft_p99": 0.2}), [max_tp])
    row = _row(plan, "max-throughput")
    assert any(r.startswith("SLO: p99 TTFT") for r in row["dropped"]), row["dropped"]
    assert any("quality gate failed: rare" in r for r in row["dropped"]), row["dropped"]
    rec = plan["recommendation"]
    assert rec["fallback"] and rec["name"] == "baseline" and rec["candidate"]["quantize"] == "none"
    fallback_row = _row(plan, "baseline")              # simulated for the report, never chosen by the sweep
    assert fallback_row["notes"] == ["the fallback, not among the swept candidates"]
    # with the baseline among the candidates it passes the same SLO and is recommended outright
    both = make_plan(_inputs(bundled, mixed_trace, gates=gates, slo={"ttft_p99": 0.2}), [Candidate(), max_tp])
    assert both["recommendation"]["name"] == "baseline" and not both["recommendation"]["fallback"]


def test_no_candidate_passes_recommends_last_good(bundled, mixed_trace):
    last_good = {"recommendation": {"name": "known-good", "candidate": Candidate("known-good").to_dict()}}
    plan = make_plan(_inputs(bundled, mixed_trace, slo={"ttft_p99": 1e-4}, last_good=last_good),
                     [Candidate("baseline"), Candidate("running-8", max_running=8)])
    assert all(r["dropped"] for r in plan["candidates"])
    assert plan["recommendation"]["name"] == "known-good" and plan["recommendation"]["fallback"]


# CLI: byte-identical plan.json, release gate, bad input ----------------------------------------------------

def _fake_profile(path, run_dir, **identity_changes):
    from dantinox.plan.profile import PROFILE_FORMAT, model_identity
    from dantinox.runs.run_dir import load_run

    _, cfg, _, _ = load_run(run_dir)
    ident = dict(model_identity(run_dir, cfg), **identity_changes)
    prof = {"format": PROFILE_FORMAT, "identity": ident, "kv_dtype": "float32", "quantize": "none",
            "cost_model": COST.to_dict(), "bottleneck": [], "rates": {}}
    path.write_text(json.dumps(prof))
    return str(path)


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    trace = d / "t.jsonl"
    assert cli.main(["plan", "trace", "--out", str(trace), "--requests", "30", "--rate", "6", "--seed", "1"]) == 0
    return d, str(trace), _fake_profile(d / "profile.json", bundled_run_dir())


def _plan_args(d, trace, profile, out, *extra):
    cands = d / "c.yaml"
    cands.write_text("- {name: baseline}\n- {name: running-8, max_running: 8}\n- {name: kv-bf16, kv_dtype: bfloat16}\n")
    return ["plan", "--trace", trace, "--profile", profile, "--slo", "ttft_p99=500,tpot_p99=100",
            "--device-memory", "64MiB", "--price-per-hour", "2", "--candidates", str(cands), "--out", str(out),
            *extra]


def test_plan_json_byte_identical_and_release_gate(cli_inputs, capsys):
    d, trace, profile = cli_inputs
    assert cli.main(_plan_args(d, trace, profile, d / "a")) == 0
    assert cli.main(_plan_args(d, trace, profile, d / "b")) == 0
    a, b = (d / "a" / "plan.json").read_bytes(), (d / "b" / "plan.json").read_bytes()
    assert a == b
    plan = json.loads(a)
    assert plan["identity"]["weights_sha256"] and plan["identity"]["dantinox_version"]
    assert _row(plan, "kv-bf16")["dropped"][0].startswith("quality not measured")
    for name in ("plan.md", "serve.yaml", "ttft_cdf.png", "rate_sweep.png", "memory_ledger.png", "pareto.png"):
        assert (d / "a" / name).stat().st_size > 0
    assert not [f for f in os.listdir(d / "a") if f.endswith(".tmp")]
    capsys.readouterr()
    assert cli.main(["plan", "gate", "--candidate", str(d / "a" / "plan.json"), "--last-good",
                     str(d / "b" / "plan.json")]) == 0
    assert capsys.readouterr().out.startswith("release: ")
    # a plan that found nothing passing is not released; the last good deployment is named
    assert cli.main(_plan_args(d, trace, profile, d / "c", "--slo", "ttft_p99=0.01")) == 0
    assert cli.main(["plan", "gate", "--candidate", str(d / "c" / "plan.json"), "--last-good",
                     str(d / "a" / "plan.json")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("FAILED: the candidate plan found no passing deployment") for line in out)
    assert out[-1].startswith(f"fallback: keep {plan['recommendation']['name']} from the last known-good plan")


@pytest.mark.parametrize("extra, expected", [
    (("--slo", "ttft_p99=-5"), "--slo ttft_p99='-5' is not allowed: a positive number"),
    (("--slo", "ttft_p50=5"), "--slo ttft_p50: unknown SLO"),
    (("--price-per-hour", "abc"), "--price-per-hour='abc' is not allowed: a positive number"),
    (("--device-memory", "1MiB"), "--device-memory=1048576 B is too small: the smallest weights plus reserve"),
    (("--max-context", "0"), "--max-context=0 is not allowed: an integer from 1 to the model's max_context"),
])
def test_bad_plan_input_exit_2_one_line(cli_inputs, capsys, extra, expected):
    d, trace, profile = cli_inputs
    code = cli.main(_plan_args(d, trace, profile, d / "bad", *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (d / "bad" / "plan.json").exists()


@pytest.mark.parametrize("change, expected", [
    ({"weights_sha256": "0" * 64}, "the profile was taken on model weights sha256 000000000000"),
    ({"dantinox_version": "0.0.1"}, "the profile was taken with dantinox 0.0.1"),
])
def test_profile_of_another_model_or_version_is_refused(cli_inputs, capsys, change, expected):
    d, trace, _ = cli_inputs
    other = _fake_profile(d / "other.json", bundled_run_dir(), **change)
    code = cli.main(_plan_args(d, trace, other, d / "bad2"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err


def test_profile_taken_at_another_context_is_refused_naming_the_flag(cli_inputs, capsys):
    from dantinox.runs.run_dir import load_run

    d, trace, _ = cli_inputs
    cfg = load_run(bundled_run_dir())[1]
    short = _fake_profile(d / "short.json", bundled_run_dir(), config=dict(cfg.to_dict(), max_context=128))
    code = cli.main(_plan_args(d, trace, short, d / "bad3"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    # the CLI names config fields by their flags (max_context=128 -> --max-context 128)
    assert (f"the profile's model has --max-context 128, this model has --max-context {cfg.max_context}: plan "
            f"with --max-context 128, or profile with --max-context {cfg.max_context}") in err[0]


def test_plan_refuses_to_overwrite_an_earlier_plan_unless_forced(cli_inputs, capsys):
    d, trace, profile = cli_inputs
    out = d / "earlier"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    assert cli.main(_plan_args(d, trace, profile, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out} already holds files (plan.json)" in err and "--force" in err
    assert (out / "plan.json").read_text() == "{}"
    (d / "a-file").write_text("x")
    assert cli.main(_plan_args(d, trace, profile, d / "a-file")) == 2
    assert "is a file" in capsys.readouterr().err
    assert cli.main(_plan_args(d, trace, profile, out, "--force")) == 0
    assert json.loads((out / "plan.json").read_text())["recommendation"]


def test_gate_eval_flags_are_passed_on_and_checked():
    """--gate-window / --gate-chunk / --gate-prompts reach the gate's dantinox eval command; a bad one is named."""
    import argparse

    from dantinox.cli.plan_run import gate_eval_flags
    from dantinox.plan.quality_gate import eval_command

    extra = gate_eval_flags(argparse.Namespace(gate_window=1024, gate_chunk=256, gate_prompts=None))
    assert extra == ("--window", "1024", "--chunk", "256")
    cmd = eval_command("run", "g.yaml", [], "int8", "none", "o.json", extra)
    assert cmd[cmd.index("--window") + 1] == "1024" and cmd[cmd.index("--chunk") + 1] == "256"
    with pytest.raises(ValueError, match="--gate-chunk=0 is not allowed: an integer >= 1"):
        gate_eval_flags(argparse.Namespace(gate_window=None, gate_chunk=0, gate_prompts=None))


def test_an_interrupted_plan_leaves_no_directory_behind(cli_inputs, capsys, monkeypatch):
    """Ctrl-C while the plots render (issue 19's new-user walk-through found an empty --out left behind): exit 130,
    no --out directory and no staging directory; a plan written into an existing --out (with --force) keeps
    what was there until every new file is ready."""
    from dantinox.plan import report

    d, trace, profile = cli_inputs
    before = set(os.listdir(d))

    def interrupted(plan, ttfts):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "plot_files", interrupted)
    assert cli.main(_plan_args(d, trace, profile, d / "interrupted")) == 130
    assert "interrupted" in capsys.readouterr().err
    assert set(os.listdir(d)) == before
    kept = d / "kept"
    kept.mkdir()
    (kept / "plan.json").write_text("{}")
    assert cli.main(_plan_args(d, trace, profile, kept, "--force")) == 130
    assert (kept / "plan.json").read_text() == "{}" and set(os.listdir(d)) == before | {"kept"}
