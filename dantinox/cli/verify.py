"""``dantinox verify``: prove the cache exact on a run directory's model (``dantinox.quality.verify``).

Loads the run (with --kv-dtype and --quantize applied, sharded over --mesh), decodes greedily from --prompt
for --new_tokens tokens (default: fill the context) and prints the largest |cached - uncached| logit
difference per --range positions. A position passes when its difference is at most
max(--tolerance, --relative_tolerance x its largest |logit|). For an int8 cache it also prints the rounding
flips the reference adopted and the distance to a float32 cache. Exit status 0 when every position passes,
1 otherwise, 2 for bad input (an empty prompt, a prompt or --new_tokens that does not fit the context).
--speculative ngram decodes by greedy n-gram speculation instead (``dantinox.quality.verify_speculative``): the
positions compared are the accepted ones, each from the verify call that emitted it.
"""

from __future__ import annotations

import numpy as np

from ..kv.static import CapacityError
from ..parallel.mesh import mesh_from_flag, naming_flag
from ..parallel.sharding import shard_model
from ..kv.channel_keys import with_kv_keys
from ..quant.kv_dtype import parse_kv_dtype, with_kv_dtype
from ..quant.weights import check_quantize, describe_weights, quantize_weights


def cmd_verify(args) -> int:
    """Print the largest cached-vs-uncached difference per position range; 1 if above tolerance."""
    from ..quality.verify import verify_cache
    from ..runs.bundled import resolve_run_dir
    from ..runs.run_dir import load_run

    run_dir = resolve_run_dir(args.run_dir)
    mesh = mesh_from_flag(args.mesh)
    if args.kv_dtype is not None:
        parse_kv_dtype(args.kv_dtype)
    check_quantize(args.quantize, "--quantize")
    model, cfg, tokenizer, _ = load_run(run_dir)
    model = with_kv_keys(with_kv_dtype(model, args.kv_dtype), args.kv_keys, args.kv_key_group)
    quantize_weights(model, args.quantize)
    cfg = model.cfg
    with naming_flag(args.mesh):
        shard_model(model, mesh)
    if not args.prompt:
        raise ValueError("--prompt is empty: give at least one character")
    if args.new_tokens is not None and args.new_tokens < 1:
        raise ValueError(f"--new_tokens {args.new_tokens} is not allowed: an integer >= 1")
    if not args.tolerance >= 0:
        raise ValueError(f"--tolerance {args.tolerance} is not allowed: a number >= 0")
    if not args.relative_tolerance >= 0:
        raise ValueError(f"--relative_tolerance {args.relative_tolerance} is not allowed: a number >= 0")
    if args.range < 1:
        raise ValueError(f"--range {args.range} is not allowed: an integer >= 1 (positions per printed range)")
    prompt = tokenizer.encode(args.prompt, unknown="replace")
    if len(prompt) >= cfg.max_context:
        raise CapacityError(f"--prompt has {len(prompt)} tokens; max_context={cfg.max_context} leaves no room")
    if args.new_tokens is not None and len(prompt) + args.new_tokens > cfg.max_context:
        raise CapacityError(f"--new_tokens {args.new_tokens} is not allowed: the prompt has {len(prompt)} tokens "
                            f"and max_context={cfg.max_context} leaves room for at most "
                            f"{cfg.max_context - len(prompt)} (omit --new_tokens to fill the context)")
    new_tokens = args.new_tokens or cfg.max_context - len(prompt)
    how = "greedy tokens decoded"
    if getattr(args, "speculative", None) is None:
        report = verify_cache(model, prompt, new_tokens, args.tolerance, args.relative_tolerance)
    else:
        from ..generation.speculative_generate import check_spec_settings
        from ..quality.verify_speculative import verify_speculative

        check_spec_settings(args.spec_tokens, 4, 1)
        report, accepted, proposed = verify_speculative(model, prompt, new_tokens, args.spec_tokens, 4,
                                                        args.tolerance, args.relative_tolerance)
        how = (f"greedy tokens decoded by n-gram speculation (k={args.spec_tokens}: {accepted} of {proposed} "
               "proposals accepted; the logits compared are those of accepted positions)")
    print(f"{run_dir}: attention={cfg.attention} compute={cfg.compute_dtype} cache={cfg.cache_dtype} "
          f"weights={describe_weights(model)}; "
          f"prompt {len(prompt)} tokens, {new_tokens} {how}")
    print(f"{'positions':>12}  max |cached - uncached|")
    for first, last, diff in report.ranges(args.range):
        print(f"{first:>5}-{last:<6}  {diff:.3e}")
    if report.float_distance is not None:
        print(f"distance to the float32 cache: max |int8 cached - float32 cached| logits = "
              f"{report.float_distance:.3e} (same tokens; what int8 costs, not an exactness check)")
    if report.rounding_flips is not None:
        print(report.rounding_flips.describe())
    verdict = "PASS" if report.passed else "FAIL"
    faults = f", {report.rounding_flips.faults:,} int8 cache faults" if report.rounding_flips else ""
    worst = int(np.argmax(report.max_diff / np.maximum(report.tolerance, 1e-30)))
    print(f"{verdict}: largest difference {report.max_diff.max():.3e}; tightest position {worst}: "
          f"{report.max_diff[worst]:.3e} against {report.tolerance[worst]:.1e} allowed (--tolerance "
          f"{args.tolerance:.1e}, or --relative_tolerance {args.relative_tolerance:.0e} x its largest |logit|) "
          f"over {len(report.positions)} positions{faults}")
    return 0 if report.passed else 1
