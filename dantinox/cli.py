"""The ``dantinox`` command: thin subcommands over library functions.

  dantinox train    --data FILE --out runs/NAME [--preset NAME | --config YAML] [--set field=value ...]
  dantinox generate [--run_dir R] (--prompt P | --chat MESSAGE [--system TEXT]) [--no_cache] [--stream]
                    [--max_new_tokens N] [--temperature T]
                    [--top_k K] [--top_p P] [--seed S] [--unknown error|replace]
                    diffusion models: [--gen_len M] [--block_size W] [--steps_per_block N] [--threshold C]
                    [--refresh block|prompt_once|step] [--kv-dtype int8] [--quantize bf16|int8]
  dantinox verify   [--run_dir R] [--prompt P] [--new_tokens N] [--tolerance F] [--kv-dtype int8]
                    [--quantize bf16|int8]
  (generate, verify, train, eval, plan profile: [--mesh data=D,model=M] shards over D x M devices, and
   [--coordinator HOST:PORT --num-processes N --process-id I] joins N processes into one mesh;
   docs/multi-device.md)
  dantinox budget   --preset NAME | --config YAML | --run_dir R [--device-memory 40GB] [--context ...]
  dantinox serve    [--run_dir R] [--host 127.0.0.1] [--port 8000] [--kv-memory 2GB] [--policy swap|recompute]
  dantinox eval     [--run_dir R] --slice NAME=FILE ... [--kv-dtype D] [--quantize Q] [--gate GATE.yaml] [--json OUT]
  dantinox plan     [trace|profile|simulate|replay|gate] ... (capacity plan; see docs/planning.md)
  dantinox models   (the bundled models; R may be one of their names, e.g. dante-diffusion, from any directory)

Without --run_dir, generate and verify use the bundled Divina Commedia model. Errors in the user's input
exit with status 2 and one line on stderr; verify exits with status 1 when the cache is not exact.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .cache import CapacityError
from .config import ConfigError
from .distributed import add_distributed_arguments, initialize_from_args
from .generate import check_request
from .mesh import add_mesh_argument, mesh_from_flag, naming_flag
from .kv_dtype import parse_kv_dtype, with_kv_dtype
from .sampling import make_sampling_params
from .sharding import shard_model
from .weight_quant import add_quantize_argument, check_quantize, quantize_weights

USER_ERRORS = (ValueError, ConfigError, CapacityError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError)
DEFAULT_NEW_TOKENS = 200


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help="new tokens to generate (default: 200, or what is left of the context if less)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens; 0 = off (a k above the "
                   "vocabulary size keeps every token, like 0)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=0)


def _add_diffusion(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("masked diffusion models (paradigm=diffusion)")
    g.add_argument("--gen_len", type=int, default=None, help="tokens to generate (default --max_new_tokens if "
                   "given, else 128; giving both with different values is an error)")
    g.add_argument("--block_size", type=int, default=None, help="tokens per block (default min(32, gen_len))")
    g.add_argument("--steps_per_block", type=int, default=None, help="denoising steps per block (default "
                   "block_size: one token per step)")
    g.add_argument("--threshold", type=float, default=None, help="parallel decoding: commit every token whose "
                   "confidence exceeds this, in (0, 1]")
    g.add_argument("--refresh", choices=("block", "prompt_once", "step"), default=None,
                   help="DualCache refresh policy (default block)")


def cmd_generate(args) -> int:
    """Print the prompt followed by the generated text; timings go to stderr."""
    from .generator import Generator

    if args.chat is not None:
        from .chat_cli import run_chat

        return run_chat(args)
    if args.prompt is None:
        raise ValueError("give --prompt TEXT (continue text) or --chat MESSAGE (answer with the chat template)")
    if args.system is not None:
        raise ValueError("--system needs --chat")
    for flag in ("max_new_tokens",) + DIFFUSION_INT_ARGS:
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} {value} is not allowed: an integer >= 1")
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed {args.seed} is not allowed: an integer in [0, 2**32)")
    if args.kv_dtype is not None:
        parse_kv_dtype(args.kv_dtype)
    with naming_flag(args.mesh):  # warmed up below, for this prompt's bucket only
        gen = Generator(args.run_dir, warmup=False, mesh=mesh_from_flag(args.mesh), kv_dtype=args.kv_dtype,
                        quantize=check_quantize(args.quantize, "--quantize"))
    ids = gen.encode(args.prompt, args.unknown)
    if gen.cfg.paradigm == "diffusion":
        return _generate_diffusion(args, gen, ids)
    given = [f"--{k}" for k in DIFFUSION_ARGS if getattr(args, k, None) is not None]
    if given:
        raise ValueError(f"{_listed(given)} only for paradigm='diffusion' models; {gen.run_dir} holds "
                         f"a paradigm={gen.cfg.paradigm!r} model")
    if args.max_new_tokens is None:  # the default never asks for more than the context holds
        args.max_new_tokens = max(1, min(DEFAULT_NEW_TOKENS, gen.cfg.max_context - len(ids)))
    check_request(np.array([len(ids)]), args.max_new_tokens, gen.cfg.max_context)  # fail before printing
    make_sampling_params(1, args.temperature, args.top_k, args.top_p)
    if args.stream and args.no_cache:
        raise ValueError("--stream needs the cache: drop --no_cache to stream")
    started = time.perf_counter()
    gen.warm_up([len(ids)])
    gen.load_seconds += time.perf_counter() - started
    print(f"[dantinox] {gen.run_dir}: loaded and warmed up in {gen.load_seconds:.2f} s "
          f"({gen.warmup.compilations} compilations, {gen.warmup.cache_hits} from the persistent cache)",
          file=sys.stderr)
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  unknown=args.unknown)
    start = time.perf_counter()
    print(args.prompt, end="", flush=True)
    if args.stream:
        for piece in gen.stream(args.prompt, args.max_new_tokens, **kwargs):
            print(piece, end="", flush=True)
    else:
        print(gen.generate(args.prompt, args.max_new_tokens, use_cache=not args.no_cache, **kwargs), end="")
    print()
    seconds = time.perf_counter() - start
    print(f"[dantinox] prompt {len(ids)} tokens, {args.max_new_tokens} new tokens in {seconds:.2f} s "
          f"({args.max_new_tokens / seconds:.1f} tokens/s, cache {'off' if args.no_cache else 'on'})",
          file=sys.stderr)
    return 0


def _listed(flags: list[str]) -> str:
    """'--a is', '--a and --b are', '--a, --b and --c are': the flags the user gave, with the verb."""
    names = flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"
    return f"{names} {'is' if len(flags) == 1 else 'are'}"


DIFFUSION_ARGS = ("gen_len", "block_size", "steps_per_block", "threshold", "refresh")
DIFFUSION_INT_ARGS = ("gen_len", "block_size", "steps_per_block")
DEFAULT_GEN_LEN = 128


def _generate_diffusion(args, gen, ids) -> int:
    """cmd_generate for a masked-diffusion model: --gen_len tokens in --block_size blocks.

    gen_len is --gen_len, else --max_new_tokens, else 128; --gen_len and --max_new_tokens with different values
    are an error. Every value is checked (cmd_generate rejects values < 1) before anything is printed.
    """
    from .diffusion import check_diffusion_request

    given = [flag for flag, used in (("--stream", args.stream), ("--top_k", args.top_k != 0),
                                     ("--top_p", args.top_p != 1.0)) if used]
    if given:
        raise ValueError(f"{_listed(given)} only for autoregressive models; {gen.run_dir} holds a "
                         "paradigm='diffusion' model")
    if args.gen_len is not None and args.max_new_tokens is not None and args.gen_len != args.max_new_tokens:
        raise ValueError(f"--gen_len {args.gen_len} and --max_new_tokens {args.max_new_tokens} disagree: on a "
                         "diffusion model both set the tokens to generate; give one of them")
    gen_len = next(v for v in (args.gen_len, args.max_new_tokens, DEFAULT_GEN_LEN) if v is not None)
    block_size = args.block_size if args.block_size is not None else min(32, gen_len)
    opts = dict(block_size=block_size, steps_per_block=args.steps_per_block,
                threshold=args.threshold, refresh=args.refresh or "block")
    check_diffusion_request(gen.cfg, len(ids), gen_len, opts["block_size"],
                            opts["steps_per_block"] if opts["steps_per_block"] is not None else block_size,
                            args.threshold, args.temperature,
                            opts["refresh"])
    print(f"[dantinox] {gen.run_dir}: loaded in {gen.load_seconds:.2f} s (masked diffusion)", file=sys.stderr)
    start = time.perf_counter()
    print(args.prompt, end="", flush=True)
    print(gen.generate(args.prompt, gen_len, use_cache=not args.no_cache, temperature=args.temperature,
                       seed=args.seed, unknown=args.unknown, **opts))
    seconds = time.perf_counter() - start
    print(f"[dantinox] prompt {len(ids)} tokens, {gen_len} new tokens in {seconds:.2f} s ({gen_len / seconds:.1f}"
          f" tokens/s incl. compilation, DualCache {'off' if args.no_cache else 'on, refresh=' + opts['refresh']})",
          file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    """Print the largest cached-vs-uncached difference per position range; 1 if above tolerance."""
    from .train.run_dir import load_run
    from .bundled_runs import resolve_run_dir
    from .verify import verify_cache

    run_dir = resolve_run_dir(args.run_dir)
    mesh = mesh_from_flag(args.mesh)
    if args.kv_dtype is not None:
        parse_kv_dtype(args.kv_dtype)
    check_quantize(args.quantize, "--quantize")
    model, cfg, tokenizer, _ = load_run(run_dir)
    model = with_kv_dtype(model, args.kv_dtype)
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
    report = verify_cache(model, prompt, new_tokens, args.tolerance, args.relative_tolerance)
    print(f"{run_dir}: attention={cfg.attention} compute={cfg.compute_dtype} cache={cfg.cache_dtype} "
          f"weights={args.quantize or 'float32'}; "
          f"prompt {len(prompt)} tokens, {new_tokens} greedy tokens decoded")
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


def build_parser() -> argparse.ArgumentParser:
    from .train.trainer import add_train_arguments, run_train_from_args

    parser = argparse.ArgumentParser(prog="dantinox", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model on a text file")
    add_train_arguments(train)
    add_distributed_arguments(train)
    train.set_defaults(func=run_train_from_args)
    gen = sub.add_parser("generate", help="generate text from a run directory")
    gen.add_argument("--run_dir", default=None, help="run directory (default: the bundled model)")
    gen.add_argument("--prompt", default=None, help="text to continue")
    gen.add_argument("--chat", default=None, help="a user message, answered with the model's chat template")
    gen.add_argument("--system", default=None, help="with --chat: a system message put first")
    gen.add_argument("--no_cache", action="store_true", help="recompute the whole sequence for every token")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    _add_kv_dtype(gen)
    gen.add_argument("--unknown", choices=("error", "replace"), default="error",
                     help="characters outside the vocabulary: error (default) or replace with <unk>")
    add_quantize_argument(gen)
    _add_sampling(gen)
    _add_diffusion(gen)
    add_mesh_argument(gen)
    add_distributed_arguments(gen)
    gen.set_defaults(func=cmd_generate)
    ver = sub.add_parser("verify", help="check cached against uncached logits at every generated position")
    ver.add_argument("--run_dir", default=None)
    ver.add_argument("--prompt", default="Nel mezzo del cammin di nostra vita")
    ver.add_argument("--new_tokens", type=int, default=None, help="default: fill the context")
    ver.add_argument("--tolerance", type=float, default=1e-4, help="absolute |cached - uncached| allowed")
    ver.add_argument("--relative_tolerance", type=float, default=1e-5,
                     help="or this times the position's largest |logit|, where larger (float32 rounding grows "
                          "with the values)")
    ver.add_argument("--range", type=int, default=32, help="positions per printed range")
    add_mesh_argument(ver)
    add_distributed_arguments(ver)
    _add_kv_dtype(ver)
    add_quantize_argument(ver)
    ver.set_defaults(func=cmd_verify)
    try:
        from .budget_cli import add_budget_arguments, run_budget
    except ImportError:  # pragma: no cover - planner not installed yet
        pass
    else:
        budget = sub.add_parser("budget", help="KV cache bytes, max batch and capacity for a model shape")
        add_budget_arguments(budget)
        budget.set_defaults(func=run_budget)
    _add_serve(sub)
    _add_import(sub)
    from .bundled_runs import run_models

    sub.add_parser("models", help="list the bundled models (usable by name: --run_dir dante-diffusion)"
                   ).set_defaults(func=run_models)
    _add_plan(sub)
    _add_eval(sub)
    return parser


def _add_import(sub) -> None:
    from .import_cli import add_import_arguments, run_import

    imp = sub.add_parser("import", help="import a Hugging Face model directory or a GGUF file as a run directory")
    add_import_arguments(imp)
    imp.set_defaults(func=run_import)


def _add_plan(sub) -> None:
    from .plan.cli import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="capacity plan: profile, simulate, replay, recommend"))


def _add_kv_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype: float32, bfloat16 or int8 (symmetric absmax "
                   "per token and head, float32 scales; default: the run's cache_dtype)")


def _add_serve(sub) -> None:
    from .serving.serve_cli import add_serve_arguments, run_serve

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, paged KV cache)")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)


def _add_eval(sub) -> None:
    from .eval_cli import add_eval_arguments, run_eval

    ev = sub.add_parser("eval", help="quality per text slice of a quantized variant against the float baseline")
    add_eval_arguments(ev)
    ev.set_defaults(func=run_eval)


SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status.

    0 success; 1 a failed check (verify, budget --measure); 2 bad input (one line on stderr, nothing on
    stdout); 141 when stdout was closed by its reader (``dantinox budget ... | head``): no traceback, as a
    Unix tool ended by SIGPIPE.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        initialize_from_args(args)  # --coordinator ...: join the process group first (dantinox.distributed)
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        from .cli_flags import in_flags, option_names, subcommand_parser

        flags = option_names(subcommand_parser(parser, args.command) or parser)
        message = in_flags(_error_text(err, args, _all_option_names(subcommand_parser(parser, args.command))), flags)
        print(f"dantinox {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _silence_stdout()
        return SIGPIPE_STATUS


def _error_text(err: Exception, args: argparse.Namespace, flags: dict[str, str]) -> str:
    """The message of a user error as one line: an OS error about a file (``[Errno 2] No such file ...``)
    names the flag whose value is that file; a multi-line message (a YAML parser's) is joined into one."""
    text = str(err)
    filename = getattr(err, "filename", None)
    if isinstance(err, OSError) and filename is not None and text.startswith("[Errno"):
        flag = next((flags[dest] for dest, value in vars(args).items()
                     if dest in flags and (value == filename or (isinstance(value, list) and filename in value))),
                    None)
        reason = err.strerror or type(err).__name__
        text = f"{flag} {filename}: {reason}" if flag else f"{filename}: {reason}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip() not in ("", "^"))


def _all_option_names(parser: argparse.ArgumentParser | None) -> dict[str, str]:
    """{destination: option as typed} of ``parser`` and of its own subcommands (``plan gate --candidate``)."""
    from .cli_flags import option_names

    if parser is None:
        return {}
    out = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's subcommands
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(_all_option_names(sub))
    out.update(option_names(parser))
    return out


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of unwritten output cannot fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (e.g. captured by a test)
        pass


if __name__ == "__main__":
    sys.exit(main())
