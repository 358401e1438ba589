"""The ``dantinox`` command: thin subcommands over library functions.

  dantinox train    --data FILE --out runs/NAME [--preset NAME | --config YAML] [--set field=value ...]
  dantinox generate [--run_dir R] (--prompt P | --chat MESSAGE [--system TEXT]) [--no_cache] [--stream]
                    [--max_new_tokens N] [--ignore_eos] [--temperature T]
                    [--top_k K] [--top_p P] [--seed S] [--unknown error|replace]
                    [--speculative ngram|draft:RUN [--spec-tokens K] [--spec-ngram-max N] [--spec-ngram-min M]]
                    diffusion models: [--gen_len M] [--block_size W] [--steps_per_block N] [--threshold C]
                    [--refresh block|prompt_once|step] [--kv-dtype int8] [--quantize bf16|int8]
  dantinox verify   [--run_dir R] [--prompt P] [--new_tokens N] [--tolerance F] [--relative_tolerance F]
                    [--speculative ngram [--spec-tokens K]]
                    [--kv-dtype int8] [--quantize bf16|int8]
  (generate, verify, train, eval, plan profile: [--mesh data=D,model=M] shards over D x M devices, and
   [--coordinator HOST:PORT --num-processes N --process-id I] joins N processes into one mesh;
   docs/how-to/multi-device.md)
  dantinox budget   --preset NAME | --config YAML | --run_dir R [--device-memory 40GB] [--context ...]
  dantinox serve    [--run_dir R] [--host 127.0.0.1] [--port 8000] [--kv-memory 2GB] [--policy swap|recompute]
  dantinox eval     [--run_dir R] --slice NAME[=FILE] ... [--kv-dtype D] [--quantize Q] [--gate GATE.yaml] [--json OUT]
  dantinox plan     [trace|profile|simulate|replay|gate] ... (capacity plan; see docs/how-to/plan-capacity.md)
  dantinox models   (the bundled models; R may be one of their names, e.g. dante-diffusion, from any directory)

Without --run_dir, generate and verify use the bundled Divina Commedia model. Errors in the user's input
exit with status 2 and one line on stderr (a flag of the wrong type or an unknown flag too: no usage block);
verify exits with status 1 when the cache is not exact. Ctrl-C, in any command and at any point after the
import, exits with status 130 and one line on stderr, "dantinox COMMAND: interrupted" (train adds the step of
the checkpoint it saved; ``dantinox.runs.interrupts``).
"""

from __future__ import annotations

import argparse
import os
import sys

from .._launch import guard_exit, release_imports
from .._version import __version__
from ..config import ConfigError
from ..kv.static import CapacityError
from ..runs.bundled import DEFAULT_BUNDLED, bundled_root, bundled_slice_names, describe_bundled
from ..runs.interrupts import EXIT_STATUS as INTERRUPTED_STATUS
from .flags import (
    _add_kv_dtype,
    _add_kv_keys,
    add_distributed_arguments,
    add_mesh_argument,
    add_quantize_argument,
    add_speculative_arguments,
    initialize_from_args,
)
from .generate import _add_diffusion, _add_sampling, cmd_generate
from .structured import add_constraint_arguments
from .verify import cmd_verify

USER_ERRORS = (ValueError, ConfigError, CapacityError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors (a flag of the wrong type, an unknown or missing flag) are one line
    naming the flag, "dantinox generate: error: argument --max_new_tokens: invalid int value: 'abc' (see
    dantinox generate --help)", exit status 2, instead of the whole usage block. Subcommand parsers are made of
    the same class (argparse's add_subparsers default)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .train import add_train_arguments, run_train_from_args

    parser = OneLineErrorParser(prog="dantinox", description="Fast, memory-honest text generation built "
                                     "around the KV cache: one subcommand per task (dantinox SUBCOMMAND --help).")
    parser.add_argument("--version", action="version", version=f"dantinox {__version__}")
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
    _add_kv_keys(gen)
    gen.add_argument("--unknown", choices=("error", "replace"), default="error",
                     help="characters outside the vocabulary: error (default) or replace with <unk>")
    add_quantize_argument(gen)
    _add_sampling(gen)
    add_speculative_arguments(gen)
    _add_diffusion(gen)
    add_constraint_arguments(gen)
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
    ver.add_argument("--speculative", choices=("ngram",), default=None,
                     help="ngram: decode by greedy n-gram speculation (verify calls of --spec-tokens proposals) and "
                          "check the cached logits of every accepted position")
    ver.add_argument("--spec-tokens", dest="spec_tokens", type=int, default=4, help="proposals per verify call")
    add_mesh_argument(ver)
    add_distributed_arguments(ver)
    _add_kv_dtype(ver)
    _add_kv_keys(ver)
    add_quantize_argument(ver)
    ver.set_defaults(func=cmd_verify)
    from .budget import add_budget_arguments, run_budget

    budget = sub.add_parser("budget", help="KV cache bytes, max batch and capacity for a model shape")
    add_budget_arguments(budget)
    budget.set_defaults(func=run_budget)
    _add_serve(sub)
    _add_import(sub)
    sub.add_parser("models", help="list the bundled models (usable by name: --run_dir dante-diffusion)"
                   ).set_defaults(func=run_models)
    _add_plan(sub)
    _add_eval(sub)
    return parser


def _add_import(sub) -> None:
    from .import_checkpoint import add_import_arguments, run_import

    imp = sub.add_parser("import", help="import a Hugging Face model directory or a GGUF file as a run directory")
    add_import_arguments(imp)
    imp.set_defaults(func=run_import)


def _add_plan(sub) -> None:
    from .plan import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="capacity plan: profile, simulate, replay, recommend"))


def _add_serve(sub) -> None:
    from .serve import add_serve_arguments, run_serve

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, paged KV cache)")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)


def _add_eval(sub) -> None:
    from .eval import add_eval_arguments, run_eval

    ev = sub.add_parser("eval", help="quality per text slice of a quantized variant against the float baseline")
    add_eval_arguments(ev)
    ev.set_defaults(func=run_eval)


SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status.

    0 success; 1 a failed check (verify, budget --measure); 2 bad input (one line on stderr, nothing on
    stdout); 130 Ctrl-C (one line on stderr, "dantinox COMMAND: interrupted", plus what was kept, e.g. train's
    checkpoint step); 141 when stdout was closed by its reader (``dantinox budget ... | head``): no
    traceback, as a Unix tool ended by SIGPIPE.
    argv None means the process is the command (the console script, ``python -m dantinox.cli``): after a
    Ctrl-C it then ends at once with os._exit(130) once stdout and stderr are flushed, because a normal
    interpreter exit while JAX's threads are compiling can crash (a segfault after Ctrl-C in serve's warm-up,
    2 of 3 tries on a cold XLA cache). Every file is written atomically (``dantinox.runs.files``) and the
    server's request log is flushed per line, so nothing is lost by skipping the interpreter's teardown.
    """
    release_imports()  # from here on a Ctrl-C is main's own one line (dantinox._launch)
    try:
        return _run(argv)
    finally:
        if argv is None:
            guard_exit()  # a Ctrl-C after the work, while the interpreter exits: the same one line and 130


def _run(argv: list[str] | None) -> int:
    try:
        parser = build_parser()  # imports the subcommands' libraries (JAX among them): seconds
        args, extras = parser.parse_known_args(argv)
        if extras:  # named by the subcommand ("dantinox generate: error: unrecognized arguments: --promt x")
            from .flags import subcommand_parser

            (subcommand_parser(parser, args.command) or parser).error(f"unrecognized arguments: {' '.join(extras)}")
    except KeyboardInterrupt as err:
        return _interrupted(None, err, argv is None)
    try:
        _check_text_flags(args, parser)
        initialize_from_args(args)  # --coordinator ...: join the process group first (dantinox.parallel.distributed)
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        print(f"dantinox {args.command}: error: {_user_message(err, args, parser)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _silence_stdout()
        return SIGPIPE_STATUS
    except KeyboardInterrupt as err:
        return _interrupted(args.command, err, argv is None)


# flags whose value is text for the model (paths are left alone: a Linux file name may be any bytes)
TEXT_FLAGS = ("prompt", "chat", "system", "regex")


def _check_text_flags(args, parser) -> None:
    """ValueError naming the flag (``--prompt is not valid Unicode: ... the byte 0xff ...``) when a text flag
    holds bytes that are not UTF-8: Python keeps them as lone surrogates, which the tokenizer cannot read."""
    from ..runs.tokenizer import check_unicode
    from .flags import option_names, subcommand_parser

    sub = subcommand_parser(parser, getattr(args, "command", "") or "")
    flags = option_names(sub) if sub is not None else {}
    for dest in TEXT_FLAGS:
        value = getattr(args, dest, None)
        if isinstance(value, str):
            check_unicode(value, flags.get(dest, f"--{dest}"))


def _interrupted(command: str | None, err: KeyboardInterrupt, end_process: bool) -> int:
    """Ctrl-C: one line on stderr naming the command (and what the library kept, ``Interrupted.detail``), stdout
    flushed; returns 130, or with end_process ends the process with that status (see ``main``)."""
    detail = getattr(err, "detail", "")
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"dantinox{' ' + command if command else ''}: interrupted{': ' + detail if detail else ''}",
          file=sys.stderr, flush=True)
    if end_process:
        os._exit(INTERRUPTED_STATUS)
    return INTERRUPTED_STATUS


def _user_message(err: Exception, args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """A user error's message in the flags of the subcommand (``dantinox.cli.flags.in_flags``), one line."""
    from ..parallel.mesh import AXES, MeshError
    from .flags import in_flags, option_names, subcommand_parser

    sub = subcommand_parser(parser, args.command)
    flags = option_names(sub or parser)
    if isinstance(err, MeshError):  # "data=2 x model=4" names mesh axes, not the --data flag of train
        flags = {dest: flag for dest, flag in flags.items() if dest not in AXES}
    typed = [v for value in vars(args).values() for v in (value if isinstance(value, list) else [value])]
    return in_flags(_error_text(err, args, _all_option_names(sub)), flags, typed)


def _error_text(err: Exception, args: argparse.Namespace, flags: dict[str, str]) -> str:
    """The message of a user error as one line: an OS error about a file (``[Errno 2] No such file ...``)
    names the flag whose value is that file; a multi-line message (a YAML parser's) is joined into one."""
    text = str(err)
    filename = getattr(err, "filename", None)
    source = getattr(err, "input_file", None)   # (path, reason) of dantinox.runs.input_files
    if source is not None:
        named = _flag_holding(args, flags, source[0])
        if named is not None and not text.startswith(named):   # the library named the file, not the flag
            text = f"{named}: {source[1]}"
    elif isinstance(err, OSError) and filename is not None and text.startswith("[Errno"):
        named = _flag_holding(args, flags, filename)
        text = f"{named or filename}: {err.strerror or type(err).__name__}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip() not in ("", "^"))


def _flag_holding(args: argparse.Namespace, flags: dict[str, str], filename: str) -> str | None:
    """How the command line gave ``filename``: "--config x.yaml", "--slice rare=x.txt" (a NAME=FILE value), or
    None when no flag holds it."""
    for dest, value in vars(args).items():
        if dest not in flags:
            continue
        for item in value if isinstance(value, list) else [value]:
            if item == filename:
                return f"{flags[dest]} {filename}"
            if isinstance(item, str) and item.endswith("=" + filename):
                return f"{flags[dest]} {item}"
    return None


def _all_option_names(parser: argparse.ArgumentParser | None) -> dict[str, str]:
    """{destination: option as typed} of ``parser`` and of its own subcommands (``plan gate --candidate``)."""
    from .flags import option_names

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
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (e.g. captured by a test)
        pass


def run_models(_args=None) -> int:
    """``dantinox models``: print the bundled models as a table (name, paradigm, attention, parameters,
    size on disk, context, vocabulary, tokenizer) and how to use them."""
    rows = describe_bundled()
    header = ["name", "paradigm", "attention", "parameters", "size", "context", "vocab", "tokenizer"]
    cells = [[r["name"], r["paradigm"], str(r["attention"]), f"{r['parameters']:,}" if r["parameters"] else "?",
              f"{r['size_mib']:.1f} MiB", str(r["max_context"]), str(r["vocab_size"]), str(r["tokenizer"])]
             for r in rows]
    widths = [max(len(c[i]) for c in [header] + cells) for i in range(len(header))]
    for n, row in enumerate([header] + cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\nUse a name wherever a run directory is asked for, e.g. dantinox generate --run_dir "
          f"{rows[-1]['name'] if rows else DEFAULT_BUNDLED} --prompt \"Nel mezzo\" (from any directory). "
          f"Files: {bundled_root()}")
    print(f"Bundled quality slices (usable by name: dantinox eval --slice NAME, plan trace --rare-file NAME): "
          f"{', '.join(bundled_slice_names())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
