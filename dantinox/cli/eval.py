"""``dantinox eval``: quality per text slice of a quantized variant against the float baseline, with gates.

  dantinox eval [--run_dir R] --slice NAME=FILE|NAME [--slice ...] [--kv-dtype D] [--quantize Q]
                [--kv-sinks A] [--kv-keys token|channel] [--kv-key-group G] [--chunk C] [--window W]
                [--baseline default|RUN_DIR]
                [--gate GATE.yaml] [--json OUT] [--prefix P] [--batch B] [--prompts N]
                [--prompt-tokens T] [--continuation C] [--mesh data=D,model=M]
                [--coordinator HOST:PORT --num-processes N --process-id I]

Walkthrough:
  1. Every flag and slice file is checked first (missing and not a bundled slice name, not UTF-8, empty, a bad
     NAME=FILE, a gate file naming an unknown slice or metric, a --mesh that does not parse or needs more
     devices than there are): one line on stderr, exit status 2. A slice is NAME=FILE, or the name of a slice
     shipped in the package (it-heldout, rare-latin-occitan, en-shakespeare; ``dantinox.runs.bundled``).
  2. The run is loaded twice: the baseline ("default": the run as saved, its weights and its own cache dtype;
     or --baseline RUN_DIR, another run directory with the same tokenizer.json, e.g. a GGUF file imported with
     --dtype float32 as the baseline of its blocks) and the candidate (the cache dtype of --kv-dtype, its int8
     sink tokens from --kv-sinks, its int8 key layout from --kv-keys / --kv-key-group, then the weights of
     --quantize). An int8 MHA / GQA / MQA candidate keeps its keys per channel in groups of G tokens (KIVI,
     the default; --kv-keys token: per token), measured through ``dantinox.quality.channel_keys``'s view,
     which holds float32 keys and reads them back as that layout does (the same numbers). With --mesh both
     are then sharded over the mesh (``dantinox.parallel.sharding.shard_model``, as generate and verify do; heads not
     divisible by model: exit 2 naming --mesh) and every figure is measured on it (docs/how-to/multi-device.md).
  3. Each slice is tokenized with the run's tokenizer (characters outside a char vocabulary become <unk>) and
     measured by ``dantinox.quality.slices.slice_quality``: teacher-forced nats per character through the cache
     (windows and caches sized to the slice, --chunk tokens per cached call), greedy agreement with the baseline,
     largest |logit difference|. A tqdm bar on stderr counts the batches when stderr is a terminal (not in a log).
  4. One table (slice x metric: baseline, candidate, change, gate) goes to stdout; --json writes the figures
     (temp file, then rename); with --gate, every failing slice.metric is named on stderr and the exit status
     is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

from ..parallel.mesh import mesh_from_flag, mesh_shape, naming_flag
from ..quality.gate import GATE_METRICS, check_gate, gate_passes, gate_value, load_gate
from ..kv.channel_keys import DEFAULT_GROUP
from ..quant.kv_dtype import parse_kv_dtype
from ..quant.weights import check_quantize, describe_weights, quantize_weights
from ..runs.bundled import bundled_slice_names, resolve_slice_file
from .flags import add_distributed_arguments, add_mesh_argument, add_quantize_argument

SLICE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
BASELINES = ("default",)
KEY_LAYOUTS = ("token", "channel")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``dantinox eval``."""
    p.add_argument("--run_dir", default=None, help="run directory (default: the bundled model)")
    p.add_argument("--slice", action="append", default=[], metavar="NAME=FILE|NAME", dest="slices",
                   help="a text slice to measure: NAME=FILE, or a bundled slice by name ("
                        f"{', '.join(bundled_slice_names())}); repeat the flag for several")
    p.add_argument("--kv-dtype", default=None, help="cache dtype of the candidate (default: the run's own)")
    add_quantize_argument(p)
    p.add_argument("--kv-sinks", type=int, default=None, metavar="A", help="int8 cache: the candidate's first A "
                   "tokens kept in float32 (kv_sink_tokens; default: the run's own, 4 unless set)")
    p.add_argument("--kv-keys", default=None, help="int8 cache keys of the candidate: channel (one scale per "
                   "channel over groups of --kv-key-group tokens, KIVI; MHA / GQA / MQA, MLA stays per token) or "
                   "token (one scale per token and head); default: the run's kv_keys, channel unless set")
    p.add_argument("--kv-key-group", type=int, default=None, metavar="G",
                   help=f"tokens per key-scale group with per-channel keys (default: the run's, {DEFAULT_GROUP})")
    p.add_argument("--chunk", type=int, default=1, metavar="C", help="tokens per cached call after the prefix "
                   "(1: one-token decode steps; larger runs C times fewer steps, same figures up to rounding)")
    p.add_argument("--window", type=int, default=None, metavar="W", help="longest teacher-forced window in "
                   "tokens (default: max_context; a slice longer than it is cut into windows)")
    p.add_argument("--baseline", default="default", help="what the candidate is compared with: default (the run "
                   "as saved: its own weights and cache dtype) or another run directory with the same tokenizer "
                   "(e.g. a GGUF file imported --dtype float32 against its blocks)")
    p.add_argument("--gate", default=None, metavar="GATE.yaml", help="thresholds per slice and metric")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.add_argument("--prefix", type=int, default=64, help="tokens prefilled per window before feeding one by one")
    p.add_argument("--batch", type=int, default=8, help="windows per device call")
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts per slice")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per greedy prompt")
    p.add_argument("--continuation", type=int, default=32, help="greedy tokens compared per prompt")
    add_mesh_argument(p)
    add_distributed_arguments(p)


def resolve_slice_specs(specs: list[str]) -> list[tuple[str, str]]:
    """[(name, path)] from --slice specs: NAME=FILE (a file, or when no such file exists a bundled slice
    name: ``rare=rare-latin-occitan``) or NAME alone (the bundled slice of that name, named as itself).
    Raises ValueError (one line, naming --slice and the spec; an unknown name lists the bundled ones)."""
    if not specs:
        raise ValueError("--slice is required: give at least one NAME=FILE, or the name of a bundled slice ("
                         f"{', '.join(bundled_slice_names())})")
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not SLICE_NAME.match(name) or (sep and not path):
            raise ValueError(f"--slice {spec!r} is not allowed: NAME=FILE or the name of a bundled slice, with "
                             "NAME of letters, digits, '_', '.', '-'")
        if not sep and name not in bundled_slice_names():
            raise ValueError(f"--slice {spec!r} is not a bundled slice (bundled: "
                             f"{', '.join(bundled_slice_names())}); give NAME=FILE for a file of your own")
        if name in out:
            raise ValueError(f"--slice {spec!r}: the name {name!r} is given twice")
        try:
            out[name] = resolve_slice_file(path if sep else name)
        except FileNotFoundError as err:
            raise ValueError(f"--slice {name}={err}") from None
    return list(out.items())


def parse_slices(specs: list[str]) -> dict[str, str]:
    """{name: text} from --slice specs (:func:`resolve_slice_specs`). Raises ValueError (one line, naming
    --slice and the spec)."""
    return {name: read_slice(name, path) for name, path in resolve_slice_specs(specs)}


def read_slice(name: str, path: str) -> str:
    """The text of a slice file. Raises ValueError naming --slice NAME=FILE: missing, a directory, unreadable, not
    UTF-8 (``dantinox.runs.input_files``), empty or blank."""
    from ..runs.input_files import read_text

    text = read_text(path, f"--slice {name}=")
    if not text.strip():
        raise ValueError(f"--slice {name}={path}: the file is empty")
    return text


def check_eval_args(args) -> None:
    """Raise ValueError naming the flag for a bad number, quantize, kv dtype or baseline."""
    for flag in ("prefix", "batch", "prompts", "prompt_tokens", "continuation", "chunk", "kv_key_group"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not allowed: an integer >= 1")
    check_quantize(args.quantize, "--quantize")
    if args.kv_dtype is not None:
        parse_kv_dtype(args.kv_dtype)
    if args.window is not None and args.window < args.prefix + 2:
        raise ValueError(f"--window {args.window} is not allowed: at least --prefix + 2 = {args.prefix + 2}")
    if args.kv_sinks is not None and args.kv_sinks < 0:
        raise ValueError(f"--kv-sinks {args.kv_sinks} is not allowed: an integer >= 0 (0: no float32 sinks)")
    if args.kv_keys is not None and args.kv_keys not in KEY_LAYOUTS:
        raise ValueError(f"--kv-keys {args.kv_keys} is not allowed: one of {', '.join(KEY_LAYOUTS)}")
    if args.baseline not in BASELINES and not os.path.isdir(args.baseline):
        raise ValueError(f"--baseline {args.baseline} is not allowed: one of {', '.join(BASELINES)}, or a run "
                         "directory")


def check_same_tokenizer(run_dir: str, baseline_dir: str) -> None:
    """ValueError naming --baseline unless both run directories hold the same tokenizer.json (byte for byte)."""
    def read(folder):
        try:
            with open(os.path.join(folder, "tokenizer.json"), "rb") as f:
                return f.read()
        except OSError as err:
            raise ValueError(f"--baseline {baseline_dir}: cannot read {folder}'s tokenizer.json "
                             f"({err.strerror or err})") from None

    if read(run_dir) != read(baseline_dir):
        raise ValueError(f"--baseline {baseline_dir}: its tokenizer differs from --run_dir {run_dir}'s; the "
                         "baseline must read the same tokens")


def candidate_model(model, kv_dtype: str | None, quantize: str | None, sinks: int | None = None,
                    keys: str | None = None, group: int | None = None):
    """``model`` with the cache dtype ``kv_dtype`` (the same parameters; ``dantinox.quant.kv_dtype.with_kv_dtype``),
    ``sinks`` int8 sink tokens (None: its own), the int8 key layout ``keys`` / ``group`` (None: its own; by
    default per-channel keys in groups of 64 on MHA / GQA / MQA, ``dantinox.kv.channel_keys.with_kv_keys``)
    and the weights of ``quantize``. Raises KVDtypeError / ValueError naming --kv-dtype, --kv-sinks, --kv-keys,
    --kv-key-group or --quantize (sinks or channel keys on a cache that is not int8, channel keys on MLA)."""
    from ..kv.channel_keys import with_kv_keys
    from ..quant.kv_dtype import with_config, with_kv_dtype

    model = with_kv_dtype(model, kv_dtype)
    if sinks is not None:
        if model.cfg.cache_dtype != "int8":
            raise ValueError(f"--kv-sinks {sinks} needs an int8 cache (give --kv-dtype int8); the candidate's "
                             f"cache is {model.cfg.cache_dtype}")
        model = with_config(model, model.cfg.replace(kv_sink_tokens=sinks))
    return quantize_weights(with_kv_keys(model, keys, group), quantize)


def cache_bytes(cfg, slots: int) -> int:
    """Bytes of one sequence's cache of ``slots`` tokens as the candidate's layout stores it (every layer, sinks
    included; ``dantinox.budget.kv_cache_bytes``, which counts per-channel keys as the static cache allocates
    them)."""
    from ..budget import kv_cache_bytes

    return kv_cache_bytes(cfg, 1, slots)


def measure(args, texts: dict[str, str], baseline, candidate, tokenizer) -> dict[str, dict]:
    """Figures per slice (the JSON rows), with a tqdm bar on stderr when it is a terminal."""
    from tqdm import tqdm

    from ..quality.slices import batch_count, slice_quality

    from ..quality.teacher_forcing import context_cap

    S = context_cap(baseline.cfg.max_context, args.window)
    streams = {}
    for name, text in texts.items():
        ids = tokenizer.encode(text, unknown="replace")
        if len(ids) < args.prefix + 2:
            raise ValueError(f"--slice {name}: {len(ids)} tokens, shorter than --prefix {args.prefix} + 2")
        streams[name] = ids
    total = sum(batch_count(len(ids), S, args.batch) + 1 for ids in streams.values())
    rows = {}
    with tqdm(total=total, desc="dantinox eval", unit="batch", file=sys.stderr, leave=False,
              disable=not sys.stderr.isatty()) as bar:
        for name, ids in streams.items():
            bar.set_postfix_str(name)
            chars = len(texts[name]) - len(tokenizer.decode(ids[:1]))
            q = slice_quality(baseline, candidate, ids, chars, prefix=args.prefix, batch=args.batch,
                              prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                              continuation=args.continuation, chunk=args.chunk,
                              key_group=candidate.cfg.key_group if candidate.cfg.channel_keys else 0,
                              window=args.window,
                              tick=lambda: bar.update(1))
            bar.update(1)
            base, cand = q.loss
            rows[name] = dict(tokens=q.tokens, chars=q.chars, loss_baseline=base, loss_candidate=cand,
                              loss_change_pct=100.0 * (cand - base) / base, agreement=q.agreement,
                              max_logit_diff=q.max_logit_diff)
    return rows


def describe_cache(cfg) -> str:
    """The candidate's cache in words with its bytes per sequence at max_context, e.g. "int8, keys per channel
    in groups of 64, 4 float32 sinks (98.62 MiB per 8192-token sequence)"."""
    words = [cfg.cache_dtype]
    if cfg.cache_dtype == "int8":
        words.append(f"keys per channel in groups of {cfg.key_group}" if cfg.channel_keys
                     else "per-token keys")
        words.append(f"{cfg.sink_slots} float32 sinks")
    size = cache_bytes(cfg, cfg.max_context) / 2 ** 20
    return f"{', '.join(words)} ({size:.2f} MiB per {cfg.max_context}-token sequence)"


def format_table(rows: dict[str, dict], gate: dict) -> str:
    """The slice x metric table (baseline, candidate, change, gate) as text."""
    lines = [f"{'slice':<18} {'metric':<22} {'baseline':>10} {'candidate':>10} {'change':>10}  gate"]
    for name, r in rows.items():
        figures = [("loss (nats/char)", "loss_change_pct", f"{r['loss_baseline']:.4f}",
                    f"{r['loss_candidate']:.4f}", f"{r['loss_change_pct']:+.3f} %"),
                   ("greedy agreement", "agreement_min", "1.000", f"{r['agreement']:.3f}",
                    f"{r['agreement'] - 1:+.3f}"),
                   ("max |logit diff|", "max_logit_diff", "0", f"{r['max_logit_diff']:.3g}",
                    f"{r['max_logit_diff']:+.3g}")]
        for label, metric, base, cand, change in figures:
            verdict = ""
            if metric in gate.get(name, {}):
                threshold = gate[name][metric]
                ok = gate_passes(metric, gate_value(metric, r), threshold)
                verdict = f"{'>=' if metric == 'agreement_min' else '<='} {threshold:g} {'PASS' if ok else 'FAIL'}"
            lines.append(f"{name:<18} {label:<22} {base:>10} {cand:>10} {change:>10}  {verdict}")
    return "\n".join(lines)


def write_json_atomic(path: str, payload: dict) -> None:
    """Write ``payload`` as JSON to a temp file beside ``path``, then rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".eval-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run_eval(args) -> int:
    """The eval command: 0 when every gate passes (or no gate), 1 when one fails; ValueError for bad input."""
    from ..parallel.sharding import shard_model
    from ..runs.bundled import bundled_run_dir
    from ..runs.run_dir import load_run

    check_eval_args(args)
    mesh = mesh_from_flag(args.mesh)
    texts = parse_slices(args.slices)
    gate = load_gate(args.gate, list(texts)) if args.gate else {}
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json}: its folder does not exist")
    run_dir = args.run_dir or bundled_run_dir()
    if args.baseline not in BASELINES:
        check_same_tokenizer(run_dir, args.baseline)
    baseline, cfg, tokenizer, _ = load_run(run_dir if args.baseline in BASELINES else args.baseline)
    if cfg.paradigm != "ar":
        raise ValueError(f"--run_dir {run_dir} holds a paradigm={cfg.paradigm!r} model; eval measures "
                         "autoregressive models (teacher forcing through the causal cache)")
    candidate = candidate_model(load_run(run_dir)[0], args.kv_dtype, args.quantize, args.kv_sinks, args.kv_keys,
                                args.kv_key_group)
    with naming_flag(args.mesh):  # after --kv-dtype and --quantize, as generate and verify
        shard_model(baseline, mesh)
        shard_model(candidate, mesh)
    rows = measure(args, texts, baseline, candidate, tokenizer)
    print(f"{run_dir}: baseline {args.baseline} (weights {describe_weights(baseline)}, cache {cfg.cache_dtype}); "
          f"candidate weights {describe_weights(candidate)}, cache {describe_cache(candidate.cfg)}"
          f"{'' if mesh is None else f'; on the mesh {args.mesh}'}")
    print(format_table(rows, gate))
    failures = check_gate(gate, rows)
    if args.json:
        write_json_atomic(args.json, dict(run_dir=run_dir, baseline=args.baseline, kv_dtype=candidate.cfg.cache_dtype,
                                          kv_cache=describe_cache(candidate.cfg), quantize=args.quantize,
                                          weights=describe_weights(candidate),
                                          mesh=mesh_shape(mesh), slices=rows, gate=gate,
                                          failures=failures, gate_metrics=list(GATE_METRICS)))
    for failure in failures:
        print(f"dantinox eval: gate failed: {failure}", file=sys.stderr)
    return 1 if failures else 0
