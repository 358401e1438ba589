"""``dantinox serve``: load a run directory, size the paged KV pool from a memory budget, serve over HTTP.

  dantinox serve --run_dir R [--host 127.0.0.1] [--port 8000] [--kv-memory 2GB [--kv-memory-all]]
                 [--kv-overcommit] [--kv-host-memory 4GB] [--kv-disk-dir DIR [--kv-disk-bytes 20GB]]
                 [--session-dir DIR]
                 [--kv-dtype int8 [--kv-keys token|channel] [--kv-key-group G]]
                 [--policy swap|recompute]
                 [--block-size 16] [--max-running 16] [--max-queued 256] [--max-batched-tokens 512]
                 [--no-prefix-caching] [--no-warmup] [--max-request-bytes 1MiB] [--config serve.yaml]
                 [--api-key KEY ... [--api-key-all]] [--strict-fields] [--shutdown-grace 5]
                 [--speculative ngram|draft:RUN [--spec-tokens 4] [--spec-ngram-max 4] [--spec-ngram-min 1]]

Without --kv-memory the pool holds max-running sequences of max_context tokens; --kv-memory sizes it from a
byte budget, but takes no more blocks than those max-running sequences can use (--kv-memory-all takes every
block the budget holds). A pool in host memory (a CPU backend) larger than the memory the host has available
is refused at start (``check_pool_fits_host``) unless --kv-overcommit is given. At start the server logs
"KV cache: N blocks = T tokens, max concurrency C at L tokens per request (M MiB = B bytes, ...)"
(L = max_context; C = min(N // blocks per request, max-running)).
--kv-dtype (float32, bfloat16, int8; default the run's cache_dtype) sets the pool's dtype: the same
--kv-memory holds 4D / (D + 4) times the blocks in int8 as in float32 for MHA / GQA / MQA of head size D
(3.6x at D = 32; the float32 scales included, dantinox.kv.int8_rows), up to the max-running cap.
An int8 pool of an MHA / GQA / MQA model stores the keys per channel over groups of --kv-key-group tokens
(KIVI, the default: --kv-keys channel, or the run's kv_keys; ``dantinox.kv.channel_paged``); the
block size must then be a multiple of the group and defaults to it (64 unless set), and a --block-size that
is not is refused naming both flags. --kv-keys token keeps one scale per token (with the float32 sinks); MLA
pools are always per token.
--max-request-bytes (default 1 MiB) is the largest HTTP request body accepted; a larger one is answered 413
before it is read (``dantinox.serving.request_limits``).
It listens as soon as the model is loaded; the warm-up compiles the engine's programs in the background,
most likely first (``dantinox.serving.warmup``), logging its progress, while requests are served: GET /health
says "warming up" (200), GET /ready answers 503 until the warm-up is done. --no-warmup compiles only on demand.
Ctrl-C, during loading and warm-up as while serving, ends the command with one line on stderr and exit
status 130 (``dantinox.cli.entrypoint``); the requests in flight may finish for up to --shutdown-grace seconds
(default GRACEFUL_SHUTDOWN_S), then each still running is ended with OpenAI's error object (a plain request
503, a stream its error event and its normal end; ``dantinox.serving.shutdown``), no traceback.
--api-key KEY (repeatable) or DANTINOX_API_KEY (keys separated by commas) makes every request but GET
/health, /ready and /metrics (--api-key-all: those too) show a key, else 401 (``dantinox.serving.api_keys``);
without a key, a --host beyond loopback is warned about at start. --strict-fields refuses request fields the
server does not read (400), where the default ignores them and names them in the X-Ignored-Fields header.
--speculative ngram decodes with n-gram (prompt lookup) speculation in the engine: each decode step verifies
up to --spec-tokens proposals per request in one compiled call (greedy output unchanged;
docs/how-to/speculative-decoding.md); --speculative draft:RUN takes the proposals from RUN's model instead (same
tokenizer, checked at start; its float KV pool shares the target's block tables and counts in --kv-memory:
``dantinox.serving.draft_model``). A diffusion run (target or draft) is refused, as is --mesh with a draft.
--kv-host-memory and --kv-disk-dir put KV tiers under the prefix cache (``dantinox.kv.tiers``): prefix blocks
the pool evicts go to host memory (at most --kv-host-memory), every prefix block is also written to DIR (at most
--kv-disk-bytes, default 10 GiB), and a prompt whose prefix left the pool is restored from the nearest tier
instead of being computed; a server restarted with the same DIR, model and cache layout finds its prefixes.
A size below one block, a DIR that cannot be written, or a tier with --no-prefix-caching is refused at start
naming the flag; a disk that fills later turns the disk tier off with one warning. The start-up line after
"KV cache:" gives each tier's bytes and blocks; /metrics counts hits, promotions, stores, evictions and bytes
per tier. --session-dir enables POST /sessions/save and /sessions/restore (``dantinox.serving.session_endpoints``):
one prompt's KV blocks written to a file there and read back, as llama-server's --slot-save-path.
FastAPI and uvicorn are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import logging
import os
import re
import socket

from ..parallel.mesh import mesh_from_flag, naming_flag, parse_mesh
from ..kv.channel_keys import with_kv_keys
from ..quant.weights import check_quantize, quantize_weights
from .flags import option_names
from .flags import add_mesh_argument, add_quantize_argument, add_speculative_arguments, speculative_from_args

# Prefill calls of one row each: with chunks of up to --max-batched-tokens, rows of a shared call would pad to the
# longest chunk, and every batch size is one more compiled program per chunk length (start-up time and memory).
SERVE_PREFILL_BATCHES = (1,)
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
# flag -> (attribute, smallest allowed value); checked before the model loads or warms up (None: not given)
_INT_FLAGS = (("--block-size", "block_size", 1), ("--kv-key-group", "kv_key_group", 1),
              ("--max-running", "max_running", 1),
              ("--max-queued", "max_queued", 1), ("--max-batched-tokens", "max_batched_tokens", 1),
              ("--max-decode-steps", "max_decode_steps", 1), ("--max-loaded-programs", "max_loaded_programs", 1),
              ("--min-prefill-chunk", "min_prefill_chunk", 1))


# serve flags whose default None means "not given" and the type their value has (for --config files)
_INT_VALUED = {"block_size": int, "kv_key_group": int, "spec_tokens": int, "ngram_max": int, "ngram_min": int,
               "spec_verify_cost": str, "max_loaded_programs": int, "api_key": list,
               "model_alias": list}

GRACEFUL_SHUTDOWN_S = 5  # after Ctrl-C, seconds uvicorn waits for requests in flight before closing them


def parse_bytes(text: str, flag: str = "--kv-memory") -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000 (``dantinox.budget.memory.parse_memory_size``).
    Raises ValueError naming ``flag`` and the value."""
    from ..budget.size_flags import parse_size_flag

    return parse_size_flag(flag, text)


def max_request_bytes(args: argparse.Namespace) -> int:
    """The request body limit of --max-request-bytes in bytes (default 1 MiB). Raises ValueError naming it."""
    from ..serving.request_limits import DEFAULT_MAX_REQUEST_BYTES

    text = getattr(args, "max_request_bytes", None)
    return DEFAULT_MAX_REQUEST_BYTES if text is None else parse_bytes(text, "--max-request-bytes")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run_dir", default=None, help="run directory (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-memory", default=None, help="KV pool size, e.g. 2GB or 512MiB (per device with --mesh); "
                   "the pool takes at most what --max-running full-context sequences can use")
    p.add_argument("--kv-memory-all", action="store_true",
                   help="allocate every block --kv-memory holds, beyond what --max-running can use (more room "
                        "for the prefix cache)")
    p.add_argument("--kv-overcommit", action="store_true",
                   help="start even when the KV pool (in host memory, on a CPU) is larger than the memory the host "
                        "has available; by default that is refused, since the server would be killed as it fills")
    p.add_argument("--kv-host-memory", default=None, metavar="SIZE",
                   help="a host-memory tier under the prefix cache, e.g. 4GB: prefix blocks the pool evicts wait "
                        "there and come back on a hit instead of being recomputed (default: none)")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="a disk tier under the prefix cache: every prefix block is written to DIR (one folder per "
                        "model and cache layout) and found again, also by a restarted server (default: none)")
    p.add_argument("--kv-disk-bytes", default=None, metavar="SIZE",
                   help="the disk tier's bound, e.g. 20GB (default 10GiB); least recently used blocks go first")
    p.add_argument("--session-dir", default=None, metavar="DIR",
                   help="enable POST /sessions/save and /sessions/restore: one prompt's KV cache saved to a file in "
                        "DIR and restored from it (as llama-server's --slot-save-path; default: off)")
    add_mesh_argument(p)
    p.add_argument("--kv-dtype", default=None,
                   help="KV cache dtype: float32, bfloat16 or int8 (default: the run's cache_dtype)")
    p.add_argument("--kv-keys", choices=("token", "channel"), default=None,
                   help="int8 cache keys: channel (per channel over groups of --kv-key-group tokens, KIVI; MHA / "
                        "GQA / MQA; MLA stays per token) or token (one scale per token); default: the run's "
                        "kv_keys, channel unless set")
    p.add_argument("--kv-key-group", type=int, default=None, metavar="G",
                   help="tokens per key-scale group with per-channel keys (default: the run's kv_key_group, 64)")
    p.add_argument("--policy", choices=("recompute", "swap"), default="recompute",
                   help="what a preempted sequence does with its KV blocks (default recompute)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default 16; with per-channel int8 keys, the int8 default, the key "
                        "group; a block size must then be a multiple of it)")
    p.add_argument("--max-running", type=int, default=16, help="sequences decoding at once")
    p.add_argument("--max-queued", type=int, default=256, help="waiting requests before answering 429")
    p.add_argument("--max-batched-tokens", type=int, default=512,
                   help="prefill tokens per engine step, beside every running stream's decode token (default 512: "
                        "chunks that large finish long prompts sooner; smaller ones keep steps short for the "
                        "streams; --tpot-slo picks it per step)")
    p.add_argument("--tpot-slo", type=float, default=None, metavar="SECONDS",
                   help="a per-output-token latency to keep for running streams: each step's prefill budget is "
                        "derived from it and the measured step costs, between --min-prefill-chunk and "
                        "--max-batched-tokens (default: none, always --max-batched-tokens)")
    p.add_argument("--min-prefill-chunk", type=int, default=32, metavar="TOKENS",
                   help="with --tpot-slo, the smallest prefill budget of a step, so prompts keep moving (default 32)")
    p.add_argument("--max-decode-steps", type=int, default=8,
                   help="decode steps per compiled call when a step only decodes (1 = one token per call)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile only what requests need, when they need it (no background warm-up)")
    p.add_argument("--max-loaded-programs", type=int, default=None, metavar="N",
                   help="keep at most N compiled programs loaded (least recently used dropped, reloaded in about "
                        "0.5 s when needed again): each of a 30-block model holds 45-60 MiB (default: no cap)")
    p.add_argument("--max-request-bytes", default=None,
                   help="largest request body accepted, e.g. 1MiB (the default) or 16MB; larger ones get 413")
    p.add_argument("--request-log", default=None,
                   help="append one JSONL line per finished request (a trace for dantinox plan --trace)")
    p.add_argument("--model-name", default=None, help="name reported by /v1/models (default: run dir name)")
    p.add_argument("--model-alias", action="append", default=None, metavar="NAME",
                   help="another name a request's model may give for the served model (repeatable; answers still "
                        "report --model-name)")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="the tool-call syntax chat answers are read in (default: the one the chat template shows; "
                        "docs/how-to/structured-outputs.md)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY) on every request but GET /health, /ready "
                        "and /metrics; repeat for several keys (default: the comma-separated keys of "
                        "DANTINOX_API_KEY, else none)")
    p.add_argument("--api-key-all", action="store_true",
                   help="with an API key: require it on /health, /ready and /metrics too")
    p.add_argument("--strict-fields", action="store_true",
                   help="answer 400 to request fields the server does not read (default: ignore them, name them "
                        "in the X-Ignored-Fields header and the log)")
    p.add_argument("--shutdown-grace", type=float, default=GRACEFUL_SHUTDOWN_S, metavar="S",
                   help=f"after Ctrl-C, seconds the requests in flight may still run before they are ended with "
                        f"an error answer (default {GRACEFUL_SHUTDOWN_S})")
    p.add_argument("--config", default=None, help="YAML/JSON file of serve flags (e.g. a plan's serve.yaml); "
                   "flags given on the command line win")
    add_quantize_argument(p)
    add_speculative_arguments(p)
    p.add_argument("--spec-verify-cost", default=None, metavar="C|N:C,...",
                   help="with --speculative: a verify call's cost in plain decode steps (measured wall-time ratio), "
                        "one number or per batch size, e.g. 1:1.3,4:2.5; speculation switches off where it loses "
                        "(default: measured by the engine on its own calls)")


def kv_summary(engine) -> str:
    """The start-up line: blocks, tokens, how many max_context requests run at once (the pool's blocks and
    --max-running both bound it), the pool's bytes, and when the pool was capped, what --kv-memory would
    have held."""
    alloc, L, size = engine.allocator, engine.max_context, engine.pool_size
    tokens = alloc.num_blocks * alloc.block_size
    fit = alloc.num_blocks // alloc.blocks_for(L)
    concurrency = min(fit, engine.config.max_running)
    nbytes = engine.stats()["kv_cache_bytes"]
    keys = (f", keys per channel in groups of {engine.cfg.key_group}" if engine.cfg.channel_keys
            else ", keys per token" if engine.cfg.cache_dtype == "int8" and engine.cfg.attention != "mla" else "")
    line = (f"KV cache: {alloc.num_blocks} blocks = {tokens} tokens, max concurrency {concurrency} at {L} "
            f"tokens per request ({nbytes / 2**20:.2f} MiB = {nbytes} bytes, block size {alloc.block_size}, "
            f"{engine.cfg.cache_dtype}{keys}{_draft_share(engine)}{_kind_share(engine)})")
    if size.capped:
        line += (f"; --max-running {engine.config.max_running} uses at most {size.usable} blocks, so the pool "
                 f"takes those of the {size.budget} --kv-memory holds (--kv-memory-all takes them all)")
    elif fit > concurrency:
        line += f"; --max-running {engine.config.max_running} bounds the concurrency ({fit} would fit)"
    available, host = host_available_bytes(), pool_host_bytes(engine)
    if available is not None and host is not None and host > available:   # started with --kv-overcommit
        line += (f"\nwarning: the KV pool ({host / 2**20:.0f} MiB) is larger than the memory this host has "
                 f"available ({available / 2**20:.0f} MiB); its pages are taken as blocks fill, and the server "
                 f"may be killed when they run out: lower --kv-memory"
                 f"{'' if engine.config.kv_memory_all else ' or --max-running'}")
    if fit == 0:
        line += (f"\nwarning: the pool holds {tokens} tokens, less than one full-context request ({L} tokens); "
                 f"longer requests will be rejected: raise --kv-memory")
    return line


def tier_summary(engine) -> str | None:
    """The start-up line of the KV tiers (None without them): each tier's bound, the blocks it holds and the
    bytes of one block, and for the disk tier its folder and what it found from earlier runs."""
    tiers = getattr(getattr(engine, "cache", None), "tiers", None)
    if tiers is None:
        return None
    block = tiers.layout.block_bytes()
    P = engine.allocator.block_size
    parts = []
    if tiers.host is not None:
        cap = tiers.host.capacity
        parts.append(f"host memory {cap / 2**20:.2f} MiB = {cap // block} blocks = {cap // block * P} tokens")
    if tiers.disk is not None:
        disk = tiers.disk
        parts.append(f"disk {disk.capacity / 2**20:.2f} MiB = {disk.capacity // block} blocks in {disk.folder} "
                     f"({len(disk)} blocks = {disk.bytes / 2**20:.2f} MiB there from earlier runs)")
    extra = tiers.layout.block_bytes(first=True) - block
    sinks = f", a prefix's first block {extra} bytes more with its sink rows" if extra else ""
    return f"KV tiers: {'; '.join(parts)} ({block} bytes per block of {P} tokens{sinks})"


def pool_host_bytes(engine) -> int | None:
    """Bytes of host memory the engine's KV pool takes once its blocks are written: every shard of every pool
    array (the draft model's layers included) when they live on CPU devices, which all share the host's memory
    (a CPU --mesh holds one copy per data replica); None when the pool lives on an accelerator's own memory."""
    import jax

    shards = [shard for leaf in jax.tree_util.tree_leaves(engine.pool) for shard in leaf.addressable_shards]
    if not shards or any(shard.device.platform != "cpu" for shard in shards):
        return None
    return int(sum(shard.data.nbytes for shard in shards))


def check_pool_fits_host(engine, overcommit: bool = False) -> None:
    """Refuse a KV pool in host memory larger than the host's available memory (MemAvailable, read after the
    model is loaded), as vLLM refuses a KV cache that does not fit its memory budget: the pool's pages become
    resident only as blocks fill (``dantinox.kv.zero_pages``), so such a pool starts, and the server is killed
    by the kernel later, under load, taking every request in flight with it. ValueError naming the pool's size,
    the memory available and the flags that fix it; ``overcommit`` (--kv-overcommit) starts it anyway (the
    start-up line then carries a warning). Memory for compiled programs, swapped-out blocks (--policy swap) and
    requests is not counted here: the check is a floor, not a guarantee."""
    need, available = pool_host_bytes(engine), host_available_bytes()
    if overcommit or need is None or available is None or need <= available:
        return
    lower = "--kv-memory" if engine.config.kv_memory_all else "--kv-memory or --max-running"
    raise ValueError(f"the KV pool needs {need / 2**20:,.0f} MiB of host memory ({engine.allocator.num_blocks} "
                     f"blocks of {engine.allocator.block_size} tokens) and this host has {available / 2**20:,.0f} "
                     f"MiB available: the server would start and be killed once its blocks fill that far; lower "
                     f"{lower}, or pass --kv-overcommit to start anyway")


def warmup_parallel() -> int:
    """Programs serve's warm-up compiles at once: the CPUs this process may use, at most 2 (XLA compiles one
    program on one core; more at once only holds more memory)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(2, cpus))


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), None where it cannot be read. The pool's pages are
    resident only once written (``dantinox.kv.zero_pages``), so a pool larger than this starts, and fills
    later."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _kind_share(engine) -> str:
    """"; by layer kind: sliding x 15 N MiB, full x 3 M MiB" for a model of more than one layer kind (each
    kind's block rows, ``LayerSpec.page_bytes``), else ""."""
    from ..kv.spec import layer_specs

    specs = layer_specs(engine.cfg)
    kinds = list(dict.fromkeys(spec.kind for spec in specs))
    if len(kinds) < 2:
        return ""
    alloc = engine.allocator
    parts = []
    for kind in kinds:
        chosen = [spec for spec in specs if spec.kind == kind]
        nbytes = alloc.num_blocks * sum(spec.page_bytes(alloc.block_size) for spec in chosen)
        parts.append(f"{kind} x {len(chosen)} {nbytes / 2**20:.2f} MiB")
    return "; by layer kind: " + ", ".join(parts)


def _draft_share(engine) -> str:
    """", of which the draft model's float layers N MiB" with --speculative draft:RUN (its rows of every block,
    ``serving.draft_model``), else ""."""
    draft_cfg = getattr(engine, "draft_cfg", None)
    if draft_cfg is None:
        return ""
    from ..kv.sizes import page_bytes

    nbytes = engine.allocator.num_blocks * page_bytes(draft_cfg, engine.allocator.block_size)
    return f", of which the draft model's {draft_cfg.cache_dtype} layers {nbytes / 2**20:.2f} MiB"


def apply_config_file(args: argparse.Namespace) -> None:
    """Fill ``args`` from ``args.config`` (a YAML or JSON mapping of flag names, dashes or underscores) where
    the command line left a flag at its default; ``args.config_keys`` records {attribute: key as written} of
    the values taken (``naming_config_keys`` names them in later errors). Raises ValueError naming the file and
    an unknown key, a value of the wrong type or outside the flag's choices, or a file that is not a mapping,
    not UTF-8, not YAML / JSON or a directory; FileNotFoundError for a missing file
    (``dantinox.runs.input_files``)."""
    from ..runs.input_files import read_yaml

    if not getattr(args, "config", None):
        return
    data = read_yaml(args.config, "--config")  # JSON is YAML
    if not isinstance(data, dict):
        raise ValueError(f"--config {args.config}: a mapping of serve flags is required")
    defaults = argparse.ArgumentParser()
    add_serve_arguments(defaults)
    default = vars(defaults.parse_args([]))
    choices = {action.dest: action.choices for action in defaults._actions if action.choices}
    args.config_keys = {}
    for key, value in data.items():
        attr = str(key).replace("-", "_")
        if attr not in default or attr == "config":
            raise ValueError(f"--config {args.config}: unknown key {key!r}; allowed: "
                             f"{', '.join(sorted(k for k in default if k != 'config'))}")
        expected = type(default[attr]) if default[attr] is not None else _INT_VALUED.get(attr, str)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            kind = {int: "an integer", bool: "true or false", str: "a string"}.get(expected, expected.__name__)
            raise ValueError(f"--config {args.config}: {key} {value!r} is not allowed: {kind}")
        if attr in choices and value not in choices[attr]:
            raise ValueError(f"--config {args.config}: {key} {value!r} is not allowed: one of "
                             f"{', '.join(choices[attr])}")
        if getattr(args, attr) == default[attr]:
            setattr(args, attr, value)
            args.config_keys[attr] = str(key)


@contextlib.contextmanager
def naming_config_keys(args: argparse.Namespace):
    """Errors raised inside name the --config file and the key, as the file spells it, when the flag they name
    took its value from that file (``apply_config_file`` records which): "--max-running 0 is not allowed: an
    integer >= 1" becomes "--config serve.yaml: max_running 0 is not allowed: an integer >= 1". An error about
    a flag given on the command line is left as it is."""
    try:
        yield
    except ValueError as err:
        text = str(err)
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        for attr, key in getattr(args, "config_keys", {}).items():
            flag = option_names(parser).get(attr) or f"--{attr.replace('_', '-')}"
            found = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
            if found:
                text = f"--config {args.config}: {text[:found.start()]}{key}{text[found.end():]}"
                break
        if text == str(err):
            raise
        try:
            renamed = type(err)(text)
        except TypeError:   # an error type whose constructor takes other arguments
            renamed = ValueError(text)
        raise renamed from None


def check_serve_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for a bad number, port or host (before any loading or warm-up)."""
    for flag, attr, low in _INT_FLAGS:
        value = getattr(args, attr, None)
        if value is not None and value < low:
            raise ValueError(f"{flag} {value} is not allowed: an integer >= {low}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not allowed: an integer in 1..65535")
    grace = getattr(args, "shutdown_grace", GRACEFUL_SHUTDOWN_S)
    if not 0 <= grace < float("inf"):
        raise ValueError(f"--shutdown-grace {grace} is not allowed: seconds >= 0")
    from ..serving.api_keys import parse_api_keys
    parse_api_keys(getattr(args, "api_key", None))
    host = args.host
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ValueError(f"--host {host!r} is not allowed: an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1) "
                             "or a host name") from None
    if args.kv_memory is not None:
        parse_bytes(args.kv_memory)
    check_tier_args(args)
    if getattr(args, "max_loaded_programs", None) is None:   # the variable applies: refuse a bad one now
        from ..programs.store import max_loaded_programs
        max_loaded_programs()
    max_request_bytes(args)
    from ..serving.token_budget import TokenBudget
    TokenBudget(getattr(args, "tpot_slo", None), args.max_batched_tokens, getattr(args, "min_prefill_chunk", 32))
    if getattr(args, "mesh", None) is not None:
        parse_mesh(args.mesh)
    check_quantize(getattr(args, "quantize", None), "--quantize")
    if getattr(args, "kv_dtype", None) is not None:
        from ..quant.kv_dtype import parse_kv_dtype
        parse_kv_dtype(args.kv_dtype)
    spec = serve_speculation(args)
    if spec is not None and spec.proposer == "draft" and getattr(args, "mesh", None) is not None:
        raise ValueError(f"--mesh is not allowed with --speculative {args.speculative}: the sharded engine does "
                         "not carry a draft model's pool (use --speculative ngram, or serve on one device)")


def check_tier_args(args: argparse.Namespace) -> None:
    """The KV tier and session flags: sizes parse, --kv-disk-bytes goes with --kv-disk-dir, tiers need the prefix
    cache, and the directories can be made and written (a probe file). ValueError naming the flag."""
    from ..kv.disk_tier import check_directory

    host, disk_dir = getattr(args, "kv_host_memory", None), getattr(args, "kv_disk_dir", None)
    if host is not None:
        parse_bytes(host, "--kv-host-memory")
    if getattr(args, "kv_disk_bytes", None) is not None:
        if disk_dir is None:
            raise ValueError("--kv-disk-bytes needs --kv-disk-dir (the directory of the disk tier)")
        parse_bytes(args.kv_disk_bytes, "--kv-disk-bytes")
    if (host is not None or disk_dir is not None) and getattr(args, "no_prefix_caching", False):
        raise ValueError(f"{'--kv-host-memory' if host is not None else '--kv-disk-dir'} is not allowed with "
                         "--no-prefix-caching: the tiers hold prefix-cache blocks")
    for flag, path in (("--kv-disk-dir", disk_dir), ("--session-dir", getattr(args, "session_dir", None))):
        problem = None if path is None else check_directory(path)
        if problem is not None:
            raise ValueError(f"{flag} {path} is not a writable directory ({problem}): give one this process can "
                             "create and write")


def tier_config(args: argparse.Namespace, run_dir, summary: dict):
    """The engine's TierConfig of --kv-host-memory / --kv-disk-dir / --kv-disk-bytes (None without them); its
    model digest names the weights (``model_digest``)."""
    from ..kv.tiers import TierConfig

    host, disk_dir = getattr(args, "kv_host_memory", None), getattr(args, "kv_disk_dir", None)
    if host is None and disk_dir is None:
        return None
    disk_bytes = getattr(args, "kv_disk_bytes", None)
    return TierConfig(host_bytes=parse_bytes(host, "--kv-host-memory") if host is not None else None,
                      disk_dir=disk_dir, disk_bytes=parse_bytes(disk_bytes, "--kv-disk-bytes") if disk_bytes else None,
                      model_digest=model_digest(args, run_dir, summary))


def model_digest(args: argparse.Namespace, run_dir, summary: dict | None = None) -> str:
    """What names the served weights for the KV tiers and sessions: the run directory's weights sha256
    (model_summary.json ``weights_sha256``, else the file hashed), the --quantize mode (it changes the weights
    the keys and values come from) and a --speculative draft:RUN's weights (its layers share the blocks).
    summary: the run's model_summary.json dict (None: read here)."""
    from ..runs.bundled import resolve_run_dir

    parts = [_weights_digest(run_dir, summary), f"quantize={getattr(args, 'quantize', None)}"]
    draft = getattr(args, "speculative", None)
    if draft and str(draft).startswith("draft:"):
        parts.append("draft=" + _weights_digest(resolve_run_dir(str(draft)[len("draft:"):])))
    return "|".join(parts)


def _weights_digest(run_dir, summary: dict | None = None) -> str:
    """A run directory's weights sha256: recorded in model_summary.json, else its model.safetensors hashed."""
    from ..runs.run_dir import RunDirError, read_summary
    from ..runs.weights_checksum import KEY, file_sha256

    if summary is None:
        try:
            summary = read_summary(run_dir)
        except RunDirError:
            summary = {}
    value = summary.get(KEY) if isinstance(summary, dict) else None
    return value if isinstance(value, str) else file_sha256(os.path.join(run_dir, "model.safetensors"))


def serve_speculation(args: argparse.Namespace):
    """The engine's ``SpecConfig`` of --speculative ngram or draft:RUN and its --spec-* flags, or None without
    it (the draft model itself is loaded by ``build_engine``). Raises ValueError naming the flag: a bound broken
    (``spec_settings``) or --spec-* without --speculative."""
    from ..serving.speculation import SpecConfig

    spec = speculative_from_args(args)
    costs = getattr(args, "spec_verify_cost", None)
    if spec is None:
        if costs is not None:
            raise ValueError("--spec-verify-cost needs --speculative ngram or draft:RUN")
        return None
    return SpecConfig(spec.proposer, spec.spec_tokens, spec.ngram_max, spec.ngram_min, parse_verify_costs(costs))


def parse_verify_costs(text: str | None) -> tuple:
    """--spec-verify-cost as SpecConfig.verify_costs: "1.5" -> ((1, 1.5),) (every batch), "1:1.3,4:2.5" ->
    ((1, 1.3), (4, 2.5)); None -> (). Raises ValueError naming the flag and the value."""
    if text is None:
        return ()
    pairs = []
    try:
        for part in str(text).split(","):
            rows, _, cost = part.rpartition(":")
            pairs.append((int(rows) if rows else 1, float(cost)))
    except ValueError:
        pairs = None
    if not pairs or any(n < 1 or not c > 0 or c == float("inf") for n, c in pairs):
        raise ValueError(f"--spec-verify-cost {text} is not allowed: a cost > 0 in plain decode steps, or "
                         "BATCH:COST pairs separated by commas (e.g. 1:1.3,4:2.5)")
    return tuple(pairs)


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer, model name) from the parsed arguments. Raises RunDirError / ValueError."""
    from ..quant.kv_dtype import with_kv_dtype
    from ..runs.bundled import resolve_run_dir
    from ..runs.run_dir import load_run
    from ..serving.engine import EngineConfig, PagedEngine

    check_serve_args(args)
    run_dir = resolve_run_dir(args.run_dir)
    model, cfg, tokenizer, summary = load_run(run_dir)
    speculative = serve_speculation(args)
    if speculative is not None and cfg.paradigm != "ar":
        raise ValueError(f"--speculative {args.speculative} is not allowed with {run_dir}: it holds a "
                         f"paradigm={cfg.paradigm!r} model; speculative decoding needs an autoregressive one")
    model = with_kv_keys(with_kv_dtype(model, getattr(args, "kv_dtype", None)), getattr(args, "kv_keys", None),
                         getattr(args, "kv_key_group", None))
    quantize_weights(model, getattr(args, "quantize", None))
    config = EngineConfig(block_size=block_size(args, model.cfg), max_running=args.max_running,
                          max_queued=args.max_queued, max_batched_tokens=args.max_batched_tokens,
                          preemption=args.policy, max_decode_steps=args.max_decode_steps,
                          kv_memory_bytes=parse_bytes(args.kv_memory) if args.kv_memory else None,
                          kv_memory_all=bool(getattr(args, "kv_memory_all", False)),
                          enable_prefix_caching=not args.no_prefix_caching, speculative=speculative,
                          tpot_slo=getattr(args, "tpot_slo", None), prefill_buckets=SERVE_PREFILL_BATCHES,
                          min_prefill_chunk=getattr(args, "min_prefill_chunk", 32),
                          kv_tiers=tier_config(args, run_dir, summary))
    name = args.model_name or os.path.basename(os.path.normpath(run_dir))
    if getattr(args, "mesh", None) is not None:  # docs/how-to/multi-device.md
        from ..serving.sharded_engine import ShardedPagedEngine

        with naming_flag(args.mesh):
            return ShardedPagedEngine(model, config, mesh_from_flag(args.mesh)), tokenizer, name
    draft = load_serve_draft(args, run_dir, tokenizer) if speculative is not None else None
    try:
        return PagedEngine(model, config, draft=draft), tokenizer, name
    except ValueError as err:
        if args.kv_memory and str(err).startswith("kv memory "):   # name the flag as typed, then the bytes
            raise ValueError(f"--kv-memory {args.kv_memory}: {err}") from None
        for flag, attr, prefix in (("--kv-host-memory", "kv_host_memory", "kv_host_bytes="),
                                   ("--kv-disk-bytes", "kv_disk_bytes", "kv_disk_bytes="),
                                   ("--kv-disk-dir", "kv_disk_dir", "kv_disk_dir=")):
            if getattr(args, attr, None) and str(err).startswith(prefix):
                raise ValueError(f"{flag} {getattr(args, attr)}: {str(err).split(' ', 1)[1]}") from None
        if draft is None or not str(err).startswith("draft "):
            raise
        raise ValueError(f"--speculative {args.speculative}: {err}") from None


def load_serve_draft(args: argparse.Namespace, run_dir, tokenizer):
    """The draft model of --speculative draft:RUN (None for ngram), after ``runs.draft_run``'s tokenizer check
    against the target's tokenizer and stop ids. Raises RunDirError, or ValueError naming the flag and the
    first difference (vocabulary size, special ids, stop ids)."""
    from ..runs.draft_run import load_draft_run
    from ..runs.stop_ids import read_stop_ids
    from .flags import draft_run_of

    draft_run = draft_run_of(args)
    if draft_run is None:
        return None
    try:
        return load_draft_run(draft_run, tokenizer, read_stop_ids(run_dir, tokenizer))
    except ValueError as err:
        raise ValueError(f"--speculative {args.speculative}: {err}") from None


def block_size(args: argparse.Namespace, cfg) -> int:
    """--block-size, or when not given ``step_plan.default_block_size``: 16, or the key group with per-channel
    int8 keys (the int8 default on MHA / GQA / MQA)."""
    from ..serving.step_plan import default_block_size

    if getattr(args, "block_size", None) is not None:
        return args.block_size
    return default_block_size(cfg)


def bind_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for uvicorn to listen on; checked before the model loads, so a
    port in use is reported in a second, not after loading and warm-up. Raises ValueError naming --port
    (address in use, permission denied) or --host (cannot be resolved or assigned)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r} cannot be resolved: {err.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse TIME_WAIT
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port} is in use on {host}: stop the other server or choose another "
                             "--port") from None
        if err.errno == errno.EACCES:
            raise ValueError(f"--port {port} needs privileges on {host}: choose a port above 1023") from None
        raise ValueError(f"--host {host} --port {port} cannot be bound: {err.strerror}") from None
    return sock


def uvicorn_log_config() -> dict:
    """uvicorn's logging setup with its life-cycle lines ("Started server process", "Application startup
    complete", "Shutting down", ...) below the level shown: dantinox logs the start once ("listening on ..."),
    and Ctrl-C ends with the one line of ``dantinox.cli.entrypoint``. The access log (stdout) and uvicorn's
    warnings and errors stay."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["uvicorn.error"]["level"] = "WARNING"
    config["loggers"]["uvicorn.access"]["level"] = "INFO"
    return config


def configure_logging() -> None:
    """INFO lines from dantinox and uvicorn only; other libraries (JAX's backend probing, which logs an INFO
    line about a missing TPU library on every start) only from WARNING up."""
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("dantinox").setLevel(logging.INFO)


def _request_log(args):
    """The RequestLog of --request-log (None without it); OSError naming the flag if the file cannot be opened."""
    if not getattr(args, "request_log", None):
        return None
    from ..plan.profile import weights_digest
    from ..runs.bundled import resolve_run_dir
    from ..serving.request_log import RequestLog

    try:
        digest = weights_digest(resolve_run_dir(args.run_dir))
    except OSError:
        digest = None
    try:
        return RequestLog(args.request_log, digest)
    except OSError as err:
        raise OSError(f"--request-log {args.request_log}: {err.strerror or err}") from None


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``dantinox serve``; blocks until the server stops (Ctrl-C)."""
    apply_config_file(args)
    with naming_config_keys(args):   # a bad value from --config names the file and its key
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    """``run_serve`` once the --config file is applied: check, bind, load, warm up and serve."""
    check_serve_args(args)  # before uvicorn and the model are imported / loaded
    sock = bind_address(args.host, args.port)
    import uvicorn

    from ..runs.bundled import resolve_run_dir
    from ..runs.chat import load_chat_format
    from ..runs.stop_ids import describe_stop_ids, read_stop_ids
    from ..serving.api_keys import exposure_warning, parse_api_keys
    from ..serving.server import create_app
    from ..serving.shutdown import DrainingServer

    configure_logging()
    log = logging.getLogger("dantinox.serving")
    engine, tokenizer, name = build_engine(args)   # checks the flags first
    check_pool_fits_host(engine, getattr(args, "kv_overcommit", False))  # before the warm-up: refused in seconds
    if args.max_loaded_programs is not None:
        from ..programs.store import set_max_loaded_programs
        set_max_loaded_programs(args.max_loaded_programs)
    chat_format = load_chat_format(resolve_run_dir(args.run_dir), tokenizer)
    stop_ids = read_stop_ids(resolve_run_dir(args.run_dir), tokenizer)
    log.info(kv_summary(engine))
    tiers_line = tier_summary(engine)
    if tiers_line is not None:
        log.info(tiers_line)
    if engine.speculative is not None:
        spec = engine.speculative
        if getattr(engine, "draft_cfg", None) is not None:
            log.info("speculative decoding: draft model %s (%d layers, %s KV pool under the target's block "
                     "tables, counted above), %d proposals per verify call", args.speculative[len("draft:"):],
                     engine.draft_cfg.num_blocks, engine.draft_cfg.cache_dtype, spec.spec_tokens)
        else:
            log.info("speculative decoding: %s, %d proposals per verify call, n-gram %d..%d", spec.proposer,
                     spec.spec_tokens, spec.ngram_max, spec.ngram_min)
    if hasattr(engine, "blocks_per_device"):
        per = engine.blocks_per_device()
        log.info("mesh %s: %d devices, each holds all %d blocks with %s KV heads: %.2f MiB of KV per device",
                 args.mesh, per["devices"], per["blocks"], per["heads_per_device"] or "the whole latent (no)",
                 per["bytes_per_device"] / 2**20)
    log.info("stop token ids (unless a request sets ignore_eos): %s", describe_stop_ids(stop_ids, tokenizer))
    log.info("chat: %s", "POST /v1/chat/completions" if chat_format
             else "no chat template: /v1/chat/completions answers 400")
    warmup = None
    if not args.no_warmup:
        from ..serving.warmup import Warmup

        warmup = Warmup(engine.warmup_items(), parallel=warmup_parallel())  # logs from the engine thread
    keys = parse_api_keys(args.api_key)
    app = create_app(engine, tokenizer, name, chat_format, stop_ids, _request_log(args), max_request_bytes(args),
                     tool_parser=args.tool_call_parser, warmup=warmup, api_keys=keys, api_key_all=args.api_key_all,
                     strict_fields=args.strict_fields, model_aliases=tuple(args.model_alias or ()),
                     session_dir=getattr(args, "session_dir", None),
                     model_digest=model_digest(args, resolve_run_dir(args.run_dir)) if args.session_dir else None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=uvicorn_log_config())
    if keys:
        log.info("API keys: %d configured; every request needs one%s", len(keys),
                 "" if args.api_key_all else " (but GET /health, /ready and /metrics)")
    warning = exposure_warning(args.host, keys)
    if warning is not None:
        log.warning(warning)
    log.info("listening on http://%s:%d (Ctrl-C to stop)", args.host, args.port)
    DrainingServer(config, app.state.worker, args.shutdown_grace).run(sockets=[sock])
    return 0
