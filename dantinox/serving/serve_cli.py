"""``dantinox serve``: load a run directory, size the paged KV pool from a memory budget, serve over HTTP.

  dantinox serve --run_dir R [--host 127.0.0.1] [--port 8000] [--kv-memory 2GB] [--policy swap|recompute]
                 [--block-size 16] [--max-running 16] [--max-queued 256] [--max-batched-tokens 64]
                 [--no-prefix-caching] [--no-warmup]

Without --kv-memory the pool holds max-running sequences of max_context tokens. At start the server logs
"KV cache: N blocks = T tokens, max concurrency C at L tokens per request" (L = max_context).
FastAPI and uvicorn are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
# flag -> (attribute, smallest allowed value); checked before the model loads or warms up
_INT_FLAGS = (("--block-size", "block_size", 1), ("--max-running", "max_running", 1),
              ("--max-queued", "max_queued", 1), ("--max-batched-tokens", "max_batched_tokens", 1),
              ("--max-decode-steps", "max_decode_steps", 1))


def parse_bytes(text: str) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000 (the budget command's parser).
    Raises ValueError naming --kv-memory and the value."""
    from ..budget_cli import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as err:
        raise ValueError(f"--kv-memory={text!r} is not allowed: {err}") from None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run_dir", default=None, help="run directory (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-memory", default=None, help="KV pool size, e.g. 2GB or 512MiB")
    p.add_argument("--policy", choices=("recompute", "swap"), default="recompute",
                   help="what a preempted sequence does with its KV blocks (default recompute)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-running", type=int, default=16, help="sequences decoding at once")
    p.add_argument("--max-queued", type=int, default=256, help="waiting requests before answering 429")
    p.add_argument("--max-batched-tokens", type=int, default=64, help="prefill tokens per engine step")
    p.add_argument("--max-decode-steps", type=int, default=8,
                   help="decode steps per compiled call when a step only decodes (1 = one token per call)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-warmup", action="store_true", help="compile lazily instead of before serving")
    p.add_argument("--model-name", default=None, help="name reported by /v1/models (default: run dir name)")


def kv_summary(engine) -> str:
    """The start-up line: blocks, tokens, and how many max_context requests fit at once."""
    alloc, L = engine.allocator, engine.max_context
    tokens = alloc.num_blocks * alloc.block_size
    concurrency = alloc.num_blocks // alloc.blocks_for(L)
    mib = engine.stats()["kv_cache_bytes"] / 2**20
    line = (f"KV cache: {alloc.num_blocks} blocks = {tokens} tokens, max concurrency {concurrency} at {L} "
            f"tokens per request ({mib:.2f} MiB, block size {alloc.block_size})")
    if concurrency == 0:
        line += (f"\nwarning: the pool holds {tokens} tokens, less than one full-context request ({L} tokens); "
                 f"longer requests will be rejected: raise --kv-memory")
    return line


def check_serve_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for a bad number, port or host (before any loading or warm-up)."""
    for flag, attr, low in _INT_FLAGS:
        value = getattr(args, attr)
        if value < low:
            raise ValueError(f"{flag} {value} is not allowed: an integer >= {low}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not allowed: an integer in 1..65535")
    host = args.host
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ValueError(f"--host {host!r} is not allowed: an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1) "
                             "or a host name") from None
    if args.kv_memory is not None:
        parse_bytes(args.kv_memory)


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer, model name) from the parsed arguments. Raises RunDirError / ValueError."""
    from ..generator import bundled_run_dir
    from ..train.run_dir import load_run
    from .engine import EngineConfig, PagedEngine

    check_serve_args(args)
    run_dir = args.run_dir or bundled_run_dir()
    model, cfg, tokenizer, _ = load_run(run_dir)
    config = EngineConfig(block_size=args.block_size, max_running=args.max_running,
                          max_queued=args.max_queued, max_batched_tokens=args.max_batched_tokens,
                          preemption=args.policy, max_decode_steps=args.max_decode_steps,
                          kv_memory_bytes=parse_bytes(args.kv_memory) if args.kv_memory else None,
                          enable_prefix_caching=not args.no_prefix_caching)
    name = args.model_name or os.path.basename(os.path.normpath(run_dir))
    return PagedEngine(model, config), tokenizer, name


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``dantinox serve``; blocks until the server stops (Ctrl-C)."""
    check_serve_args(args)  # before uvicorn and the model are imported / loaded
    import uvicorn

    from ..chat import load_chat_format
    from ..generator import bundled_run_dir
    from .server import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("dantinox.serving")
    engine, tokenizer, name = build_engine(args)
    chat_format = load_chat_format(args.run_dir or bundled_run_dir(), tokenizer)
    log.info(kv_summary(engine))
    log.info("chat: %s", "POST /v1/chat/completions (stops at token ids %s)" % (chat_format.stop_ids,)
             if chat_format else "no chat template: /v1/chat/completions answers 400")
    if not args.no_warmup:
        counted = engine.warmup()
        log.info("warm-up: %d compilations (%d from the persistent cache) in %.1f s", counted.compilations,
                 counted.cache_hits, counted.seconds)
    uvicorn.run(create_app(engine, tokenizer, name, chat_format), host=args.host, port=args.port, log_level="info")
    return 0
