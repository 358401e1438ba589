"""``dantinox generate --prompt TEXT``: continue a prompt with a run directory's model and print the text.

The flags, the sampling group (--max_new_tokens, --temperature, --top_k, --top_p, --seed) and the masked-diffusion
group (--gen_len, --block_size, --steps_per_block, --threshold, --refresh) are added here; ``cmd_generate``
runs the command through ``dantinox.generation.generator.Generator``, and ``--chat`` goes to
``dantinox.cli.chat``. Every flag is checked before the prompt is printed (bad values, options of the other
paradigm, --stream with --no_cache, a prompt plus --max_new_tokens beyond the context): one line, exit 2.
Without --max_new_tokens an autoregressive model generates DEFAULT_NEW_TOKENS, or what is left of the
context if less; a diffusion model generates --gen_len (default DEFAULT_GEN_LEN). --json-schema, --regex and
--grammar constrain the text (``dantinox.cli.structured``). An autoregressive model stops
early at the run's stop ids (its end-of-turn / end-of-text tokens, not printed; case K11) unless --ignore_eos.
--speculative ngram (with --spec-tokens, --spec-ngram-max, --spec-ngram-min; ``dantinox.cli.flags``) decodes with
prompt-lookup speculation and adds a line with its acceptance rate and mean accepted length; refused naming the
flag with --no_cache, out of bounds or for a diffusion model.
The text goes to stdout, the load, warm-up, speed and acceptance lines to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ..generation.prompts import check_request
from ..generation.sampling import make_sampling_params
from ..parallel.mesh import mesh_from_flag, naming_flag
from ..kv.channel_keys import check_spec_group
from ..quant.kv_dtype import parse_kv_dtype
from ..quant.weights import check_quantize, describe_weights
from .flags import describe_spec_stats, draft_run_of, spec_kwargs, speculative_from_args
from .structured import constraint_kwargs

DEFAULT_NEW_TOKENS = 200


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help="new tokens to generate (default: 200, or what is left of the context if less)")
    p.add_argument("--ignore_eos", action="store_true",
                   help="do not stop at the model's end-of-turn / end-of-text tokens (listed by dantinox import "
                        "and in the run's model_summary.json)")
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
    from ..generation.generator import Generator

    if args.chat is not None:
        from .chat import run_chat

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
    spec = speculative_from_args(args)
    with naming_flag(args.mesh):  # warmed up below, for this prompt's bucket only
        gen = Generator(args.run_dir, warmup=False, mesh=mesh_from_flag(args.mesh), kv_dtype=args.kv_dtype,
                        quantize=check_quantize(args.quantize, "--quantize"), draft_run=draft_run_of(args),
                        kv_keys=args.kv_keys, kv_key_group=args.kv_key_group)
    ids = gen.encode(args.prompt, args.unknown)
    constraint = constraint_kwargs(args, gen)  # --json-schema / --regex / --grammar (cli/structured.py)
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
    if spec is not None and args.no_cache:
        raise ValueError("--speculative needs the cache: drop --no_cache to speculate")
    if spec is not None:
        check_spec_group(gen.cfg, spec.spec_tokens)   # per-channel keys: --spec-tokens + 1 <= --kv-key-group
    started = time.perf_counter()
    gen.warm_up([len(ids)], args.max_new_tokens, speculative=None if constraint else spec)  # grammar: host loop
    gen.load_seconds += time.perf_counter() - started
    print(f"[dantinox] {gen.run_dir}: loaded and warmed up in {gen.load_seconds:.2f} s "
          f"({gen.warmup.compilations} compilations, {gen.warmup.cache_hits} from the persistent cache; "
          f"weights {describe_weights(gen.model)})",
          file=sys.stderr)
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  unknown=args.unknown, ignore_eos=args.ignore_eos, **spec_kwargs(spec))
    start = time.perf_counter()
    print(args.prompt, end="", flush=True)
    if args.stream:
        for piece, tokens, reason in gen.stream_completion(args.prompt, args.max_new_tokens, **kwargs):  # noqa: B007
            print(piece, end="", flush=True)  # the last item's count and finish reason are reported below
    else:
        done = gen.complete(args.prompt, args.max_new_tokens, use_cache=not args.no_cache, **kwargs, **constraint)
        print(done.text, end="")
        tokens, reason = done.tokens, done.finish_reason
    print()
    seconds = time.perf_counter() - start
    ended = "" if reason != "stop" else (", ended where the constraint is complete" if constraint
                                         else f", ended by stop id {_stop_texts(gen)}")
    print(f"[dantinox] prompt {len(ids)} tokens, {tokens} new tokens in {seconds:.2f} s "
          f"({tokens / seconds:.1f} tokens/s, cache {'off' if args.no_cache else 'on'}{ended})", file=sys.stderr)
    if spec is not None:
        print(f"[dantinox] {describe_spec_stats(gen.speculation(*spec[:4]), gen.spec_stats)}", file=sys.stderr)
    return 0



def _stop_texts(gen) -> str:
    """The run's stop ids as '2 (<|im_end|>)', for the report line."""
    from ..runs.stop_ids import describe_stop_ids

    return describe_stop_ids(gen.stop_ids, gen.tokenizer)


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
    from ..generation.diffusion import check_diffusion_request

    given = [flag for flag, used in (("--stream", args.stream), ("--top_k", args.top_k != 0),
                                     ("--top_p", args.top_p != 1.0), ("--ignore_eos", args.ignore_eos),
                                     ("--speculative", args.speculative is not None)) if used]
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
