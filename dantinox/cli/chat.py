"""``dantinox generate --chat MESSAGE [--system TEXT]``: one chat turn with a model that has a chat template.

Prints the assistant's answer (the text before the model's end-of-turn token; --ignore_eos generates past it);
timings go to stderr. The model flags of ``generate`` work here as they do with --prompt: --kv-dtype,
--quantize, --mesh (and the distributed group), --unknown; those that cannot apply to one chat turn
(--no_cache, the diffusion group) are refused naming the flag; --stream prints the answer as it is generated
(``Generator.stream_chat``: the same text); --speculative ngram works as with --prompt (its acceptance line goes
to stderr). Errors (no template, empty message,
bad sampling or model flags, a mesh that cannot be made, a conversation that fills the context) exit 2 with
one line.
"""

from __future__ import annotations

import sys
import time

from ..generation.sampling import make_sampling_params
from ..kv.static import CapacityError
from ..parallel.mesh import mesh_from_flag, naming_flag
from ..quant.kv_dtype import parse_kv_dtype
from ..quant.weights import check_quantize, describe_weights
from ..runs.chat import require_chat_format
from .flags import describe_spec_stats, draft_run_of, spec_kwargs, speculative_from_args
from .structured import constraint_kwargs

DEFAULT_CHAT_TOKENS = 256


def check_chat_args(args) -> None:
    """Raise ValueError naming the flag for --chat / --system / --prompt combinations that are not allowed."""
    if args.chat == "":
        raise ValueError("--chat is empty: give the user's message")
    if args.prompt is not None:
        raise ValueError("--prompt and --chat exclude each other: --prompt continues text, --chat answers a "
                         "message with the model's chat template")
    if getattr(args, "no_cache", False):
        raise ValueError("--no_cache is not supported with --chat")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens {args.max_new_tokens} is not allowed: an integer >= 1")
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed {args.seed} is not allowed: an integer in [0, 2**32)")
    given = [f"--{k}" for k in ("gen_len", "block_size", "steps_per_block", "threshold", "refresh")
             if getattr(args, k, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to diffusion models, not to --chat")
    make_sampling_params(1, args.temperature, args.top_k, args.top_p)
    if args.kv_dtype is not None:
        parse_kv_dtype(args.kv_dtype)
    check_quantize(args.quantize, "--quantize")


def run_chat(args) -> int:
    """Answer ``args.chat`` (with ``args.system`` first when given) and print the answer."""
    from ..generation.generator import Generator

    check_chat_args(args)
    spec = speculative_from_args(args)
    with naming_flag(args.mesh):  # warmed up below, for this conversation's prompt bucket only
        gen = Generator(args.run_dir, warmup=False, mesh=mesh_from_flag(args.mesh), kv_dtype=args.kv_dtype,
                        quantize=args.quantize, draft_run=draft_run_of(args),
                        kv_keys=getattr(args, "kv_keys", None), kv_key_group=getattr(args, "kv_key_group", None))
    require_chat_format(gen.chat_format, gen.run_dir)  # fail before printing anything
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": args.chat}]
    try:
        ids = gen.chat_prompt_ids(messages, unknown=args.unknown)
    except CapacityError as err:
        given = "--chat and --system" if args.system is not None else "--chat"
        raise CapacityError(f"{given}: {err}") from None
    constraint = constraint_kwargs(args, gen)  # --json-schema / --regex / --grammar (cli/structured.py)
    started = time.perf_counter()
    gen.warm_up([len(ids)], args.max_new_tokens or DEFAULT_CHAT_TOKENS,
                speculative=None if constraint else spec)  # a constraint speculates in its host loop
    gen.load_seconds += time.perf_counter() - started
    print(f"[dantinox] {gen.run_dir}: loaded and warmed up in {gen.load_seconds:.2f} s "
          f"(weights {describe_weights(gen.model)})", file=sys.stderr)
    start = time.perf_counter()
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    unknown=args.unknown, ignore_eos=args.ignore_eos, **spec_kwargs(spec))
    first = ""
    if args.stream:   # --stream with a constraint was refused by constraint_kwargs
        for piece, _, _ in gen.stream_chat(messages, args.max_new_tokens or DEFAULT_CHAT_TOKENS, **sampling):
            if piece and not first:
                first = f", first text after {time.perf_counter() - start:.2f} s"
            print(piece, end="", flush=True)
        print()
    else:
        print(gen.chat(messages, args.max_new_tokens or DEFAULT_CHAT_TOKENS, **sampling, **constraint))
    print(f"[dantinox] prompt {len(ids)} tokens after the chat template, answered in "
          f"{time.perf_counter() - start:.2f} s{first}", file=sys.stderr)
    if spec is not None:
        print(f"[dantinox] {describe_spec_stats(gen.speculation(*spec[:4]), gen.spec_stats)}", file=sys.stderr)
    return 0
