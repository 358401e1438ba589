"""``dantinox plan``: the capacity plan, and its steps as subcommands.

  dantinox plan trace    --out T.jsonl --requests N --rate R [--arrivals poisson|gamma] [--rare-file F|NAME]
                         [--seed S]
  dantinox plan trace    --from mooncake FILE --out T.jsonl
  dantinox plan profile  [--run_dir R] [--kv-dtype D] [--quantize Q] [--mesh data=D,model=M] --out profile.json
                         [--repeats K] [--cooldown S] [--call-repeats N] [--max-context N]
                         [--coordinator HOST:PORT --num-processes N --process-id I]
  dantinox plan simulate --trace T --config C.yaml [--profile P] [--slo ...] [--max-context N] [--out M.json]
  dantinox plan replay   --trace T --config C.yaml [--profile P] [--max-context N] [--out M.json]
  dantinox plan gate     --candidate plan.json --last-good plan.json
  dantinox plan --trace T --slo ttft_p99=MS,tpot_p99=MS --device-memory BYTES --price-per-hour USD
                [--gate GATE.yaml --slice NAME=FILE|NAME ...] [--candidates C.yaml] [--baseline NAME|plan.json]
                [--profile P] [--out DIR [--force]] [--interval t|range] [--confidence C] [--decide-at edge|median]
                [--confirm N [--confirm-repeats R]] [--max-context N]

Bad input exits 2 with one line naming the flag, file and line, or value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..parallel.mesh import mesh_from_flag, naming_flag
from ..runs.bundled import resolve_slice_file
from ..runs.files import atomic_write_bytes
from .flags import add_distributed_arguments, add_mesh_argument
from .plan_run import _costs, _profile, _samples_flags


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan command's flags and its subcommands."""
    p.add_argument("--run_dir", default=None, help="run directory (default: the bundled model)")
    p.add_argument("--trace", help="JSONL trace (see docs/how-to/plan-capacity.md)")
    p.add_argument("--slo", default="ttft_p99=1000,tpot_p99=200", help="ttft_p99=MS,tpot_p99=MS")
    p.add_argument("--device-memory", default="1GiB", help="memory of one device, e.g. 80GB")
    p.add_argument("--price-per-hour", default="1.0", help="USD per device-hour")
    p.add_argument("--gate", default=None, help="quality gate YAML for dantinox eval")
    p.add_argument("--slice", action="append", default=[], help="NAME=FILE quality slice, FILE a path or a bundled "
                   "slice name (e.g. rare=rare-latin-occitan), or NAME alone for a bundled slice (repeatable)")
    p.add_argument("--gate-window", type=int, default=None, metavar="W", help="dantinox eval --window W for the gate")
    p.add_argument("--gate-chunk", type=int, default=None, metavar="C", help="dantinox eval --chunk C for the gate")
    p.add_argument("--gate-prompts", type=int, default=None, metavar="N", help="dantinox eval --prompts N for the "
                   "gate")
    p.add_argument("--gate-timeout", type=float, default=600.0, metavar="S", help="seconds one dantinox eval may "
                   "take before its variant counts as not measured (default 600)")
    p.add_argument("--candidates", default=None, help="YAML list of candidates (default: the built-in sweep)")
    p.add_argument("--baseline", default="baseline", help="fallback: a candidate name or a last known-good plan.json")
    p.add_argument("--profile", action="append", default=None,
                   help="profile.json, one per model variant (repeatable; default: profile the float model now)")
    p.add_argument("--out", default="plan", help="output directory (default ./plan; refused when it already holds "
                   "files, unless --force)")
    p.add_argument("--force", action="store_true", help="write into an --out directory that already holds files "
                   "(plan.json, plan.md, serve.yaml and the plots are replaced)")
    p.add_argument("--interval", default=None, choices=("t", "range"),
                   help="latency interval over the profile samples (default: t when every profile has >= 2)")
    p.add_argument("--confidence", default=None, help="the t interval's confidence (default 0.9)")
    p.add_argument("--decide-at", default="edge", choices=("edge", "median"),
                   help="SLO check at the interval's pessimistic edge (default) or at the median")
    p.add_argument("--profile-repeats", type=int, default=3, help="samples of the profile taken without --profile")
    p.add_argument("--cooldown", default="10", help="seconds between two profile samples")
    p.add_argument("--confirm", type=int, default=0, metavar="N",
                   help="replay the N cheapest passing candidates (and the baseline) on the real engine and recommend "
                        "the first whose measured latencies meet the SLO (default 0: simulation only)")
    p.add_argument("--spec-acceptance", type=float, default=None, metavar="A",
                   help="speculative acceptance rate in [0, 1] of trace lines without spec_acceptance; with it (or "
                        "a trace that gives one) the default sweep adds spec-2, spec-4, spec-8")
    p.add_argument("--confirm-repeats", type=int, default=3, metavar="R", help="replays per confirmed candidate")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="at most N tokens of context (default: the model's max_context; vLLM's --max-model-len): "
                        "the engine's block tables, pool and buckets, the profile and the simulation are sized "
                        "for N; a plan refuses a profile taken at another N")
    add_mesh_argument(p)   # the mesh of the profile taken when no --profile is given
    p.set_defaults(func=run_plan)
    sub = p.add_subparsers(dest="plan_command")
    t = sub.add_parser("trace", help="generate a mixed trace, or convert one (--from)")
    t.add_argument("--out", required=True)
    t.add_argument("--from", dest="convert_from", nargs=2, metavar=("FORMAT", "FILE"), default=None,
                   help="convert FILE from FORMAT (mooncake: JSONL of timestamp, input_length, output_length, "
                        "hash_ids)")
    t.add_argument("--requests", type=int, default=200)
    t.add_argument("--rate", default="4", help="mean requests per second")
    t.add_argument("--arrivals", default="poisson", help="poisson or gamma")
    t.add_argument("--burstiness", default="2", help="gamma gaps' coefficient of variation")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--rare-file", default=None, help="text file of the rare-language slice, or a bundled slice by "
                   "name (e.g. rare-latin-occitan)")
    t.add_argument("--max-context", type=int, default=256)
    t.set_defaults(func=run_trace_cmd)
    pr = sub.add_parser("profile", help="time the engine's compiled calls, fit the cost model")
    pr.add_argument("--run_dir", default=None)
    pr.add_argument("--kv-dtype", default="float32")
    pr.add_argument("--quantize", default="none")
    pr.add_argument("--repeats", type=int, default=3, help="independent profile samples, --cooldown apart")
    pr.add_argument("--cooldown", default="10", help="seconds between two samples")
    pr.add_argument("--call-repeats", type=int, default=15, help="timed runs per call in a sample (median)")
    pr.add_argument("--spec-tokens", type=int, default=0, metavar="K",
                    help="also time the speculative verify call, forward_step B x (K + 1) (default 0: not timed)")
    pr.add_argument("--max-context", type=int, default=None, metavar="N",
                    help="at most N tokens of context (default: the model's max_context; vLLM's --max-model-len): "
                         "the engine's block tables, pool and buckets, the profile and the simulation are sized "
                         "for N (profile at the longest request plus output the deployment will see; the "
                         "profile records N)")
    pr.add_argument("--out", required=True)
    add_mesh_argument(pr)
    add_distributed_arguments(pr)
    pr.set_defaults(func=run_profile_cmd)
    for name, func in (("simulate", run_simulate_cmd), ("replay", run_replay_cmd)):
        s = sub.add_parser(name, help=f"{name} a trace for one candidate configuration")
        s.add_argument("--run_dir", default=None)
        s.add_argument("--trace", required=True)
        s.add_argument("--config", default=None, help="candidate YAML/JSON (default: the baseline)")
        s.add_argument("--profile", default=None, help="profile.json" + (" (default: profile now)" if name ==
                                                                          "simulate" else " (also simulate)"))
        s.add_argument("--slo", default="ttft_p99=1000,tpot_p99=200")
        s.add_argument("--spec-acceptance", type=float, default=None, metavar="A",
                       help="speculative acceptance rate in [0, 1] of trace lines without spec_acceptance")
        s.add_argument("--max-context", type=int, default=None, metavar="N",
                       help="serve contexts of at most N tokens (as dantinox plan --max-context)")
        s.add_argument("--out", default=None, help="metrics JSON (default: stdout)")
        s.set_defaults(func=func)
    g = sub.add_parser("gate", help="release gate: re-check a plan against the last known-good one")
    g.add_argument("--candidate", required=True)
    g.add_argument("--last-good", required=True)
    g.set_defaults(func=run_gate_cmd)


def _write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    atomic_write_bytes(path, data)


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def run_trace_cmd(args) -> int:
    """``plan trace``: write a generated trace (temp file, rename). Raises TraceError / FileNotFoundError."""
    from ..plan.inputs import positive_number
    from ..plan.trace import TraceSpec, default_classes, generate_trace, trace_text

    if args.convert_from:
        return _convert_trace(args)
    rare_file = None
    if args.rare_file:
        try:
            rare_file = resolve_slice_file(args.rare_file)   # a path, or a bundled slice by name
        except FileNotFoundError as err:
            raise FileNotFoundError(f"--rare-file {err}") from None
    spec = TraceSpec(requests=args.requests, rate=positive_number("--rate", args.rate),
                     classes=default_classes(rare_file), arrivals=args.arrivals,
                     burstiness=positive_number("--burstiness", args.burstiness), seed=args.seed,
                     max_context=args.max_context)
    records = generate_trace(spec)
    _write(args.out, trace_text(records).encode())
    print(f"wrote {args.out}: {len(records)} requests over {records[-1]['arrival']:.1f} s")
    return 0


def _convert_trace(args) -> int:
    """``plan trace --from FORMAT FILE``: write FILE converted to the trace format."""
    from ..plan.trace_import import TRACE_FORMATS, convert_trace

    fmt, path = args.convert_from
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"--from {fmt!r} is not allowed: one of {', '.join(TRACE_FORMATS)}")
    records = convert_trace(fmt, path, f"--from {fmt}")
    from ..plan.trace import trace_text

    _write(args.out, trace_text(records).encode())
    print(f"wrote {args.out}: {len(records)} requests from {fmt} {path}")
    return 0


def run_profile_cmd(args) -> int:
    """``plan profile``: write profile.json and its bottleneck report next to it."""
    from ..parallel.sharding import check_model_fits
    from ..plan.inputs import load_model
    from ..plan.report import bottleneck_markdown

    mesh = mesh_from_flag(args.mesh)   # docs/how-to/multi-device.md; the profile records its shape
    samples, cooldown = _samples_flags(args)
    run_dir, model, cfg, _ = load_model(args.run_dir, args.max_context)
    with naming_flag(args.mesh):       # heads or MLP width not dividing over model: before any timing
        check_model_fits(cfg, mesh)
    prof = _profile(run_dir, model, cfg, args.kv_dtype, args.quantize, args.call_repeats, mesh, args.mesh,
                    samples, cooldown, args.spec_tokens)
    _write(args.out, _json_bytes(prof))
    md = ["# Bottleneck report", ""] + bottleneck_markdown(prof["bottleneck"], prof["rates"])
    _write(os.path.splitext(args.out)[0] + "_bottleneck.md", ("\n".join(md) + "\n").encode())
    print("\n".join(md))
    return 0


def _one_candidate(path):
    from ..plan.candidate import Candidate
    from ..plan.inputs import load_candidates

    return load_candidates(path, "--config")[0] if path else Candidate()


def run_simulate_cmd(args) -> int:
    """``plan simulate``: one candidate on a trace in simulation; metrics JSON to --out or stdout."""
    from ..plan.inputs import load_model, load_trace, parse_slo
    from ..plan.simulate import simulate

    slo = parse_slo(args.slo)
    cand = _one_candidate(args.config)
    run_dir, model, cfg, tok = load_model(args.run_dir, args.max_context)
    requests, prompts = load_trace(args.trace, cfg, tok)
    costs, _ = _costs(args, run_dir, model, cfg)
    cost = (costs.get((cand.kv_dtype, cand.quantize)) or next(iter(costs.values())))[0]   # its first sample
    result = simulate(cfg, cand, cost, requests, prompts, slo, spec_acceptance=args.spec_acceptance)
    result.pop("records")
    _emit(args.out, {"candidate": cand.to_dict(), "simulated": result})
    return 0


def run_replay_cmd(args) -> int:
    """``plan replay``: the trace through the real engine in process (and simulated with --profile)."""
    from ..plan.inputs import load_model, load_trace, parse_slo
    from ..plan.replay import replay_realtime
    from ..plan.variants import apply_variant

    slo = parse_slo(args.slo)
    cand = _one_candidate(args.config)
    run_dir, model, cfg, tok = load_model(args.run_dir, args.max_context)
    requests, prompts = load_trace(args.trace, cfg, tok)
    from ..serving.engine import PagedEngine

    vmodel, _ = apply_variant(model, cfg, cand.kv_dtype, cand.quantize)
    engine = PagedEngine(vmodel, cand.engine_config())
    engine.warmup()
    replayed = replay_realtime(engine, requests, prompts, slo)
    replayed.pop("records")
    out = {"candidate": cand.to_dict(), "replayed": replayed}
    if args.profile:
        from ..plan.simulate import simulate

        costs, _ = _costs(args, run_dir, model, cfg)
        sim = simulate(cfg, cand, next(iter(costs.values()))[0], requests, prompts, slo)
        sim.pop("records")
        out["simulated"] = sim
    _emit(args.out, out)
    return 0


def _emit(path, obj) -> None:
    if path:
        _write(path, _json_bytes(obj))
        print(f"wrote {path}")
    else:
        sys.stdout.write(_json_bytes(obj).decode())


def run_gate_cmd(args) -> int:
    """``plan gate``: exit 0 to release, 1 with the failed checks and the fallback."""
    from ..plan.release_gate import release_gate

    ok, lines = release_gate(args.candidate, args.last_good)
    print("\n".join(lines))
    return 0 if ok else 1


def check_plan_out(out: str, force: bool) -> None:
    """Raise ValueError naming --out when it is a file, or a directory that already holds files and --force was
    not given (a plan never overwrites an earlier one silently)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file: give a directory for the plan")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ValueError(f"--out {out} already holds files ({', '.join(sorted(os.listdir(out))[:4])}"
                         f"{', ...' if len(os.listdir(out)) > 4 else ''}): choose another --out, or pass --force "
                         "to replace the plan there")


def run_plan(args) -> int:
    """The default action: profile (unless --profile), sweep, recommend, write the plan."""
    from .plan_run import build_plan

    if not args.trace:
        raise ValueError("--trace is required (a JSONL trace; `dantinox plan trace --out T.jsonl` makes one)")
    check_plan_out(args.out, args.force)  # before the profile and the sweep, which take minutes
    plan, ttfts, run_dir = build_plan(args)
    from ..plan.report import write_plan

    paths = write_plan(args.out, plan, ttfts, args.run_dir)
    rec = plan["recommendation"]
    word = "fallback" if rec["fallback"] else "confirmed" if rec.get("confirmed") else "recommended"
    print(f"{word}: {rec['name']} ({rec['reason']}); wrote {', '.join(paths)}")
    return 0
