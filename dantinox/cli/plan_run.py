"""One ``dantinox plan`` run: read and check the inputs, profile or load the profile, evaluate the quality
gates, sweep the candidates and assemble the plan dict (what plan.json holds).

The plan records what it was measured on (model weights sha256, config, dantinox version), the inputs
(trace sha256 and path, profile sha256 and path when one was given, SLOs, device memory, price), the machine
rates and bottleneck rows of the profile, the gates, every candidate and the recommendation.
"""

from __future__ import annotations

import math
import os
import sys

from ..parallel.mesh import mesh_from_flag, naming_flag
from ..plan.candidate import default_candidates
from ..plan.inputs import (file_sha256, load_candidates, load_json, load_model, load_trace, parse_memory, parse_slo,
                           positive_number)
from ..plan.ledger import memory_ledger
from ..plan.quality_gate import gate_variants, run_eval_gate
from ..plan.recommend import PlanInputs, make_plan
from .eval import resolve_slice_specs


def check_weights_fit(cfg, candidates, weights_bytes: int, device_bytes: int) -> None:
    """ValueError naming --device-memory when no candidate's weights plus reserve fit the device."""
    ledgers = [memory_ledger(cfg, c, weights_bytes, device_bytes) for c in candidates]
    if all(g.weights + g.reserve > device_bytes for g in ledgers):
        least = min(g.weights + g.reserve for g in ledgers)
        raise ValueError(f"--device-memory={device_bytes} B is too small: the smallest weights plus reserve need "
                         f"{least} B")


def _baseline(text: str):
    """(baseline name, last-good plan or None) from --baseline NAME or --baseline plan.json."""
    if text.endswith(".json") or os.path.isfile(text):
        plan = load_json("--baseline", text)
        if "recommendation" not in plan:
            raise ValueError(f"--baseline {text}: not a plan.json (no recommendation)")
        return plan["recommendation"]["name"], plan
    return text, None


def build_plan(args) -> tuple[dict, dict, str]:
    """(plan dict, {candidate: sorted TTFTs}, run_dir) for the parsed ``dantinox plan`` arguments."""
    from ..budget.memory import param_bytes
    from ..plan.profile import model_identity

    slo = parse_slo(args.slo)
    check_confirm_flags(args)
    gate_extra = gate_eval_flags(args)
    price = positive_number("--price-per-hour", args.price_per_hour)
    device = parse_memory("--device-memory", args.device_memory)
    candidates = load_candidates(args.candidates) if args.candidates else default_candidates()
    resolved = resolve_slice_specs(args.slice) if args.slice else []
    slices = [f"{name}={path}" for name, path in resolved]
    check_gate_inputs(args.gate, resolved)
    baseline, last_good = _baseline(args.baseline)
    run_dir, model, cfg, tok = load_model(args.run_dir, getattr(args, "max_context", None))
    weights = param_bytes(model)
    check_weights_fit(cfg, candidates, weights, device)
    requests, prompts = load_trace(args.trace, cfg, tok)
    candidates = _with_speculation(args, candidates, requests)
    costs, prof = _costs(args, run_dir, model, cfg)
    interval, confidence = interval_flags(args, costs)
    gates = gate_variants([(c.kv_dtype, c.quantize) for c in candidates],
                          lambda kv, q: run_eval_gate(args.run_dir, args.gate, slices, kv, q,
                                                      getattr(args, "gate_timeout", 600.0), gate_extra))
    inp = PlanInputs(cfg, requests, prompts, costs, slo, device, price, weights, gates, baseline, last_good,
                     interval=interval, confidence=confidence, decide_at=args.decide_at,
                     spec_acceptance=getattr(args, "spec_acceptance", None))
    result = make_plan(inp, candidates)
    if getattr(args, "confirm", 0):
        result = _confirm(args, inp, result, model, costs)
    ttfts = {r["candidate"]["name"]: r.pop("ttfts") for r in result["candidates"]}
    plan = dict(result, identity=model_identity(run_dir, cfg), bottleneck=prof.get("bottleneck", []),
                rates=prof.get("rates", {}), mesh=prof.get("mesh"),
                gates=[dict(g.to_dict(), variant=list(v)) for v, g in gates.items()],
                inputs={"trace": os.path.basename(args.trace), "trace_sha256": file_sha256(args.trace),
                        "trace_requests": len(requests), "slo": slo, "device_bytes": device,
                        "price_per_hour": price, "baseline": baseline,
                        **({"spec_acceptance": args.spec_acceptance}
                           if getattr(args, "spec_acceptance", None) is not None else {}),
                        "profile_sha256": [file_sha256(p) for p in args.profile or []]})
    return plan, ttfts, run_dir


def check_gate_inputs(gate: str | None, slices: list) -> None:
    """Read the --gate file and the --slice files now, as ``dantinox eval`` will after the profile: a file that
    is missing, a directory, not UTF-8 or not YAML, a gate naming another slice, an empty slice, is one error
    naming the flag and the file before minutes of profiling (``load_gate``, ``read_slice``)."""
    from ..quality.gate import load_gate
    from .eval import read_slice

    if not gate:
        return
    load_gate(gate, [name for name, _ in slices])
    for name, path in slices:
        read_slice(name, path)


def _with_speculation(args, candidates: list, requests: list) -> list:
    """The default sweep gains speculative_candidates when an acceptance rate is given (--spec-acceptance or
    a trace line's spec_acceptance); a --candidates list is kept as given. ValueError naming the flag: a bad
    --spec-acceptance, or --confirm with a speculating candidate (the replay engine does not speculate)."""
    from ..plan.candidate import speculative_candidates
    from ..plan.speculation import check_acceptance

    accept = getattr(args, "spec_acceptance", None)
    if accept is not None:
        check_acceptance("--spec-acceptance", accept)
    if not args.candidates and (accept is not None or any(q.spec_acceptance is not None for q in requests)):
        candidates = candidates + speculative_candidates()
    spec = [c.name for c in candidates if c.spec_tokens]
    if getattr(args, "confirm", 0) and spec:
        raise ValueError(f"--confirm: candidate {spec[0]!r} speculates, and the replay on the real engine does "
                         "not speculate yet: confirm without speculating candidates (--candidates)")
    return candidates


def gate_eval_flags(args) -> tuple:
    """The ``dantinox eval`` flags the quality gate passes on: --window / --chunk / --prompts from --gate-window
    / --gate-chunk / --gate-prompts when given (a long-context model's eval at its full window is slow).
    ValueError naming the flag for a value < 1."""
    out = ()
    for flag, name in (("--window", "gate_window"), ("--chunk", "gate_chunk"), ("--prompts", "gate_prompts")):
        value = getattr(args, name, None)
        if value is None:
            continue
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} is not allowed: an integer >= 1")
        out += (flag, str(value))
    return out


def check_confirm_flags(args) -> None:
    """ValueError (one line naming the flag) for --confirm / --confirm-repeats below their bounds, or --confirm
    with --mesh (the replay runs on one device)."""
    args.confirm, args.confirm_repeats = getattr(args, "confirm", 0), getattr(args, "confirm_repeats", 3)
    if args.confirm < 0:
        raise ValueError(f"--confirm={args.confirm} is not allowed: an integer >= 0 (0: no confirmation)")
    if args.confirm and args.confirm_repeats < 1:
        raise ValueError(f"--confirm-repeats={args.confirm_repeats} is not allowed: an integer >= 1")
    if args.confirm and getattr(args, "mesh", None):
        raise ValueError(f"--confirm with --mesh {args.mesh} is not supported: the confirmation replays on one "
                         "device; plan on the mesh without --confirm, or confirm without --mesh")


def _confirm(args, inp, result: dict, model, costs: dict) -> dict:
    """result with the N best candidates replayed on the engine (confirm.py), progress on stderr."""
    from ..plan.confirm import apply_confirmation, confirm_candidates
    from ..plan.confirm_replay import EngineReplayer

    replayer = EngineReplayer(model, inp.cfg, inp.requests, inp.prompts, inp.slo, costs[("float32", "none")][0])

    def measure(cand):
        print(f"confirming {cand.name} on the engine ({len(inp.requests)} requests) ...", file=sys.stderr)
        return replayer(cand)

    conf = confirm_candidates(result["candidates"], result["recommendation"], inp.slo, args.confirm,
                              args.confirm_repeats, measure, inp.interval or "t", inp.confidence, inp.baseline)
    if conf["warning"]:
        print(f"warning: {conf['warning']}", file=sys.stderr)
    return apply_confirmation(result, conf, inp)


def interval_flags(args, costs: dict) -> tuple:
    """(interval method or None, confidence) from --interval / --confidence and the profiles' samples: t by
    default when every variant has >= 2 samples, point estimates otherwise. ValueError (one line naming the
    flag) for an interval asked of a profile with fewer than 2 samples, or a confidence outside (0, 1)."""
    from ..plan.uncertainty import check_interval_request

    fewest = min(len(v) for v in costs.values())
    asked = args.interval is not None or args.confidence is not None
    method = args.interval or "t"
    try:
        confidence = float(args.confidence) if args.confidence is not None else 0.9
    except ValueError:
        confidence = math.nan
    if not 0 < confidence < 1:
        raise ValueError(f"--confidence={args.confidence} is not allowed: a number in (0, 1), e.g. 0.9")
    if not asked and fewest < 2:
        return None, confidence
    try:
        check_interval_request(fewest, method, confidence)
    except ValueError as err:
        flag = "--interval" if args.interval is not None else "--confidence"
        if str(err).startswith("samples="):
            raise ValueError(f"{flag}: a profile has {fewest} sample: an interval needs at least 2 (take it with "
                             "dantinox plan profile --repeats K, K >= 2)") from None
        raise ValueError(f"{flag}: {err}") from None
    return method, confidence


def _profile(run_dir, model, cfg, kv_dtype="float32", quantize="none", repeats=15, mesh=None, mesh_flag=None,
             samples=1, cooldown_s=0.0, spec_tokens=0) -> dict:
    from ..plan.profile import take_profile

    print(f"profiling kv_dtype={kv_dtype} quantize={quantize}{f' mesh {mesh_flag}' if mesh else ''}, "
          f"{samples} sample(s) {cooldown_s:g} s apart ...", file=sys.stderr)
    with naming_flag(mesh_flag):
        return take_profile(run_dir, model, cfg, kv_dtype, quantize, repeats, mesh, samples, cooldown_s,
                            spec_tokens, progress=lambda line: print(line, file=sys.stderr, flush=True))


def _samples_flags(args) -> tuple[int, float]:
    """(--repeats / --profile-repeats, --cooldown) checked: ValueError naming the flag."""
    from ..plan.inputs import positive_number

    samples = getattr(args, "repeats", None) if getattr(args, "plan_command", None) == "profile" else \
        getattr(args, "profile_repeats", 1)
    flag = "--repeats" if getattr(args, "plan_command", None) == "profile" else "--profile-repeats"
    if samples < 1:
        raise ValueError(f"{flag}={samples} is not allowed: an integer >= 1")
    text = str(getattr(args, "cooldown", 0))
    cooldown = 0.0 if text in ("0", "0.0") else positive_number("--cooldown", text)
    return samples, cooldown


def _costs(args, run_dir, model, cfg) -> tuple[dict, dict]:
    """({(kv, quantize): [CostModel per sample]}, the first profile) from --profile (one path or several, each
    checked against the model) or from a fresh profile of the float model (--profile-repeats samples)."""
    from ..plan.inputs import load_json
    from ..plan.profile import check_profile, model_identity, profile_cost_models

    paths = [args.profile] if isinstance(args.profile, str) else (args.profile or [])
    profiles = []
    for path in paths:
        prof = load_json("--profile", path)
        check_profile(prof, model_identity(run_dir, cfg), f"--profile {path}")
        profiles.append(prof)
    if not profiles:
        from ..parallel.sharding import check_model_fits

        flag = getattr(args, "mesh", None)
        mesh = mesh_from_flag(flag)
        with naming_flag(flag):
            check_model_fits(cfg, mesh)
        samples, cooldown = _samples_flags(args)
        profiles = [_profile(run_dir, model, cfg, mesh=mesh, mesh_flag=flag, samples=samples, cooldown_s=cooldown)]
    costs = {}
    for prof in profiles:
        costs[(prof.get("kv_dtype", "float32"), prof.get("quantize", "none"))] = profile_cost_models(prof)
    if ("float32", "none") not in costs:
        raise ValueError("--profile: one profile must be of the float model (--kv-dtype float32 --quantize none)")
    return costs, profiles[0]
