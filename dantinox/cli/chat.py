"""``dantinox generate --chat MESSAGE [--system TEXT]``: one chat turn with a model that has a chat template.

Prints the assistant's answer (the text before the model's end-of-turn token); timings go to stderr. Errors
(no template, empty message, bad sampling flags, a prompt that fills the context) exit 2 with one line.
"""

from __future__ import annotations

import sys
import time

from ..generation.sampling import make_sampling_params
from ..runs.chat import require_chat_format

DEFAULT_CHAT_TOKENS = 256


def check_chat_args(args) -> None:
    """Raise ValueError naming the flag for --chat / --system / --prompt combinations that are not allowed."""
    if args.chat == "":
        raise ValueError("--chat is empty: give the user's message")
    if args.prompt is not None:
        raise ValueError("--prompt and --chat exclude each other: --prompt continues text, --chat answers a "
                         "message with the model's chat template")
    for flag in ("no_cache", "stream"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag} is not supported with --chat")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens {args.max_new_tokens} is not allowed: an integer >= 1")
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed {args.seed} is not allowed: an integer in [0, 2**32)")
    given = [f"--{k}" for k in ("gen_len", "block_size", "steps_per_block", "threshold", "refresh")
             if getattr(args, k, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to diffusion models, not to --chat")


def run_chat(args) -> int:
    """Answer ``args.chat`` (with ``args.system`` first when given) and print the answer."""
    from ..generation.generator import Generator

    check_chat_args(args)
    make_sampling_params(1, args.temperature, args.top_k, args.top_p)
    gen = Generator(args.run_dir)
    require_chat_format(gen.chat_format, gen.run_dir)  # fail before printing anything
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": args.chat}]
    print(f"[dantinox] {gen.run_dir}: loaded and warmed up in {gen.load_seconds:.2f} s", file=sys.stderr)
    start = time.perf_counter()
    answer = gen.chat(messages, args.max_new_tokens or DEFAULT_CHAT_TOKENS, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(answer)
    print(f"[dantinox] answered in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return 0
