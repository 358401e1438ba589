"""Request traces: the JSONL format the planner reads, and a seeded generator of mixed traces.

One JSON object per line, one request per object, in arrival order:

  arrival        seconds since the trace starts (number >= 0, non-decreasing)            required
  prompt         the prompt as text (encoded with the model's tokenizer)                  one of these three
  prompt_ids     the prompt as token ids (list of integers in [0, V))
  prompt_tokens  only the prompt length (integer >= 1); ids are drawn from a seeded stream, the first
                 prefix_tokens of them shared by every request with the same prefix
  max_tokens     tokens to generate (integer >= 1); the request always generates all of them  required
  temperature, top_p, top_k, seed   sampling settings (as in /v1/completions); default greedy
  slice          a name for the request's class ("chat", "doc", "rare", ...); metrics are reported per slice
  prefix         a shared-prefix id (a system prompt); requests with the same id share their first
                 prefix_tokens tokens, so the prefix cache can serve them
  prefix_tokens  the shared prefix's length (integer >= 0, at most the prompt length)
  hash_ids       with prompt_tokens: the prompt's blocks as content hashes (list of integers >= 0, as in the
                 Mooncake trace); block i gets its ids from a stream keyed by its hash, so requests sharing
                 leading hashes share those tokens exactly (the prefix cache sees what production saw)
  block_tokens   tokens per hash_ids block (integer >= 1; default 512, the Mooncake trace's block)

Request logs (``dantinox serve --request-log FILE``, dantinox/serving/request_log.py) are traces too: their
lines carry ``"source": "request-log"`` and what the server observed, which the planner reads past:
  source                      "request-log"
  cached_tokens               prompt tokens the prefix cache served (integer >= 0)
  ttft_s, tpot_s              the server's own TTFT and TPOT (seconds, or null)
  finish_reason               stop, length, abort, error, ...
  model_sha256, dantinox_version
A request log is written as requests finish, so its arrivals are not in order: a trace whose every line is a
request-log line is sorted by arrival (ties by line) and its requests numbered in that order. A logged request
that generated no token (max_tokens 0, allowed only in a request log: aborted or refused before its first
token) is skipped: there is nothing to replay.

The generator draws arrivals from a Poisson process (exponential gaps) or a gamma process (gaps with a
coefficient of variation ``burstiness`` > 1 are bursty), lengths from log-normal distributions per class, and
the class of each request from a mixture. A class may take its prompts from a text file (the rare-language
slice). Same arguments and seed, same file, byte for byte (fixed key order, rounded floats, numpy PCG64).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..runs.input_files import read_text, where

ARRIVAL_PROCESSES = ("poisson", "gamma")
_KNOWN = {"arrival", "prompt", "prompt_ids", "prompt_tokens", "max_tokens", "temperature", "top_p", "top_k",
          "seed", "slice", "prefix", "prefix_tokens", "hash_ids", "block_tokens", "spec_acceptance"}
OBSERVED = ("source", "cached_tokens", "ttft_s", "tpot_s", "finish_reason", "model_sha256", "dantinox_version")
REQUEST_LOG = "request-log"
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A bad trace line or generator argument; the message names the line (1-based) or the field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. arrival: seconds. Exactly one of prompt (text), prompt_ids, prompt_tokens."""

    index: int
    arrival: float
    max_tokens: int
    prompt: str | None = None
    prompt_ids: tuple | None = None
    prompt_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    slice: str = "default"
    prefix: str | None = None
    prefix_tokens: int = 0
    hash_ids: tuple | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    source: str = "trace"
    spec_acceptance: float | None = None     # speculative acceptance rate in [0, 1] (plan/speculation.py)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_line(text: str, lineno: int, max_context: int | None = None) -> TraceRequest:
    """One trace line -> TraceRequest. Raises TraceError("line N: ...") naming the field, value, what is allowed."""
    where = f"line {lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a JSON object is required, got {type(obj).__name__}")
    logged = obj.get("source") == REQUEST_LOG
    known = _KNOWN | set(OBSERVED) if logged else _KNOWN
    unknown = sorted(set(obj) - known)
    if unknown:
        raise TraceError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
    for name in ("arrival", "max_tokens"):
        if name not in obj:
            raise TraceError(f"{where}: field {name!r} is missing")
    if not _is_num(obj["arrival"]) or obj["arrival"] < 0:
        raise TraceError(f"{where}: arrival={obj['arrival']!r} is not allowed: seconds, a number >= 0")
    if not _is_int(obj["max_tokens"]) or obj["max_tokens"] < (0 if logged else 1):
        raise TraceError(f"{where}: max_tokens={obj['max_tokens']!r} is not allowed: an integer >= 1")
    given = [k for k in ("prompt", "prompt_ids", "prompt_tokens") if k in obj]
    if len(given) != 1:
        raise TraceError(f"{where}: exactly one of 'prompt', 'prompt_ids', 'prompt_tokens' is required, "
                         f"got {given or 'none'}")
    length = _check_prompt(obj, given[0], where)
    prefix_tokens = obj.get("prefix_tokens", 0)
    if not _is_int(prefix_tokens) or not 0 <= prefix_tokens <= (length or prefix_tokens):
        raise TraceError(f"{where}: prefix_tokens={prefix_tokens!r} is not allowed: an integer in [0, prompt "
                         f"length]")
    if max_context is not None and length is not None and length + obj["max_tokens"] > max_context:
        raise TraceError(f"{where}: prompt of {length} tokens + max_tokens={obj['max_tokens']} = "
                         f"{length + obj['max_tokens']} exceeds the model's context of {max_context} tokens")
    _check_sampling(obj, where)
    hash_ids, block_tokens = _check_hash_ids(obj, given[0], where)
    accept = obj.get("spec_acceptance")
    if accept is not None and (not _is_num(accept) or not 0 <= accept <= 1):
        raise TraceError(f"{where}: field 'spec_acceptance' = {accept!r} is not allowed: a number in [0, 1]")
    return TraceRequest(
        index=lineno - 1, arrival=float(obj["arrival"]), max_tokens=obj["max_tokens"], prompt=obj.get("prompt"),
        prompt_ids=tuple(obj["prompt_ids"]) if "prompt_ids" in obj else None,
        prompt_tokens=obj.get("prompt_tokens"), temperature=float(obj.get("temperature", 0.0)),
        top_p=float(obj.get("top_p", 1.0)), top_k=obj.get("top_k", 0), seed=obj.get("seed", 0),
        slice=str(obj.get("slice", "default")), prefix=obj.get("prefix"), prefix_tokens=prefix_tokens,
        hash_ids=hash_ids, block_tokens=block_tokens, source=REQUEST_LOG if logged else "trace",
        spec_acceptance=None if accept is None else float(accept))


def _check_hash_ids(obj: dict, kind: str, where: str) -> tuple:
    """(hash_ids tuple or None, block_tokens); TraceError naming the field for a bad one."""
    block = obj.get("block_tokens", MOONCAKE_BLOCK_TOKENS)
    if not _is_int(block) or block < 1:
        raise TraceError(f"{where}: block_tokens={block!r} is not allowed: an integer >= 1")
    if "hash_ids" not in obj:
        return None, block
    value = obj["hash_ids"]
    if not isinstance(value, list) or not all(_is_int(h) and h >= 0 for h in value):
        raise TraceError(f"{where}: hash_ids is not allowed: a list of integers >= 0")
    if kind != "prompt_tokens" or "prefix" in obj:
        raise TraceError(f"{where}: hash_ids is allowed only with prompt_tokens and without prefix")
    return tuple(value), block


def _check_prompt(obj: dict, kind: str, where: str) -> int | None:
    """The prompt's length in tokens (None for text, known only after encoding)."""
    value = obj[kind]
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise TraceError(f"{where}: prompt={value!r} is not allowed: a non-empty string")
        return None
    if kind == "prompt_tokens":
        if not _is_int(value) or value < 1:
            raise TraceError(f"{where}: prompt_tokens={value!r} is not allowed: an integer >= 1")
        return value
    if not isinstance(value, list) or not value or not all(_is_int(t) and t >= 0 for t in value):
        raise TraceError(f"{where}: prompt_ids is not allowed: a non-empty list of integers >= 0")
    return len(value)


def _check_sampling(obj: dict, where: str) -> None:
    t, p, k, s = (obj.get(n) for n in ("temperature", "top_p", "top_k", "seed"))
    if t is not None and (not _is_num(t) or t < 0):
        raise TraceError(f"{where}: temperature={t!r} is not allowed: a number >= 0")
    if p is not None and (not _is_num(p) or not 0 < p <= 1):
        raise TraceError(f"{where}: top_p={p!r} is not allowed: a number in (0, 1]")
    if k is not None and (not _is_int(k) or k < 0):
        raise TraceError(f"{where}: top_k={k!r} is not allowed: an integer >= 0")
    if s is not None and (not _is_int(s) or not 0 <= s < 2**32):
        raise TraceError(f"{where}: seed={s!r} is not allowed: an integer in [0, 2**32)")
    for name in ("slice", "prefix"):
        if name in obj and not isinstance(obj[name], str):
            raise TraceError(f"{where}: {name}={obj[name]!r} is not allowed: a string")


def read_trace(path: str, max_context: int | None = None, label: str | None = None) -> list[TraceRequest]:
    """Read and check a JSONL trace. Blank lines are skipped. Raises TraceError naming the file (after
    ``label``, e.g. "--trace") and line: invalid JSON, a missing or bad field, a negative or decreasing arrival,
    a request longer than ``max_context``; a file that is a directory, unreadable or not UTF-8
    (``dantinox.runs.input_files``); InputFileNotFound (a FileNotFoundError) for a missing file."""
    out = []
    name = where(label, path)
    for lineno, text in enumerate(read_text(path, label, TraceError).split("\n"), 1):
        if not text.strip():
            continue
        try:
            out.append((lineno, parse_line(text, lineno, max_context)))
        except TraceError as err:
            raise TraceError(f"{name} {err}") from None
    if out and all(req.source == REQUEST_LOG for _, req in out):   # written as requests finished
        kept = sorted(((req.arrival, lineno, req) for lineno, req in out if req.max_tokens > 0),
                      key=lambda t: t[:2])
        out = [(lineno, dataclasses.replace(req, index=i)) for i, (_, lineno, req) in enumerate(kept)]
    last = 0.0
    for lineno, req in out:
        if req.arrival < last:
            raise TraceError(f"{name} line {lineno}: arrival={req.arrival} is not allowed: arrivals must "
                             f"not decrease (previous {last})")
        if req.max_tokens < 1:
            raise TraceError(f"{name} line {lineno}: max_tokens=0 is not allowed in a trace mixing request-log "
                             "and other lines")
        last = req.arrival
    if not out:
        raise TraceError(f"{name}: the trace has no requests")
    return [req for _, req in out]


def _stream(key: str, n: int, vocab_size: int, low: int = 1) -> list[int]:
    """n token ids in [low, V) from a PCG64 stream keyed by ``key`` (stable across runs and machines)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(seed)).integers(low, vocab_size, n).tolist()


def prompt_token_ids(req: TraceRequest, tokenizer, vocab_size: int) -> list[int]:
    """The request's prompt as token ids: prompt_ids as given, text encoded (unknown characters replaced),
    or for a length-only prompt the shared prefix's stream followed by the request's own stream.
    Raises TraceError for an id >= vocab_size or text that encodes to nothing."""
    if req.prompt_ids is not None:
        bad = [t for t in req.prompt_ids if t >= vocab_size]
        if bad:
            raise TraceError(f"line {req.index + 1}: prompt_ids contains {bad[0]}: ids must be < {vocab_size}")
        return list(req.prompt_ids)
    if req.prompt is not None:
        if tokenizer is None:
            raise TraceError(f"line {req.index + 1}: a text prompt needs the model's tokenizer (--run_dir)")
        ids = tokenizer.encode(req.prompt, unknown="replace")
        if not ids:
            raise TraceError(f"line {req.index + 1}: prompt encodes to no tokens")
        return ids
    if req.hash_ids is not None:
        ids = [t for h in req.hash_ids for t in _stream(f"block:{h}", req.block_tokens, vocab_size)]
        ids = ids[:req.prompt_tokens]
        return ids + _stream(f"request:{req.index}", req.prompt_tokens - len(ids), vocab_size)
    shared = _stream(f"prefix:{req.prefix}", req.prefix_tokens, vocab_size) if req.prefix else []
    return shared + _stream(f"request:{req.index}", req.prompt_tokens - len(shared), vocab_size)


# Generator ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceClass:
    """One class of a mixed trace. weight: its share of requests (relative). prompt_median / output_median:
    log-normal medians (tokens), prompt_sigma / output_sigma their log-space spreads. prefix / prefix_tokens:
    a shared system prompt for every request of the class (None: none). text_file: draw the prompt text from
    this file instead (``prompt_median`` then counts characters, a window of consecutive lines)."""

    name: str
    weight: float = 1.0
    prompt_median: float = 32.0
    prompt_sigma: float = 0.5
    output_median: float = 24.0
    output_sigma: float = 0.4
    prefix: str | None = None
    prefix_tokens: int = 0
    text_file: str | None = None


@dataclass(frozen=True)
class TraceSpec:
    """What ``generate_trace`` draws. rate: mean requests per second; arrivals: "poisson" or "gamma";
    burstiness: coefficient of variation of the gaps for "gamma" (1 = Poisson); max_context: every request
    keeps prompt + max_tokens within it (tokens)."""

    requests: int
    rate: float
    classes: tuple = field(default_factory=tuple)
    arrivals: str = "poisson"
    burstiness: float = 2.0
    seed: int = 0
    max_context: int = 256

    def validate(self) -> None:
        """Raise TraceError naming the flag for a bad count, rate, arrival process, burstiness or class mix."""
        if not _is_int(self.requests) or self.requests < 1:
            raise TraceError(f"--requests={self.requests!r} is not allowed: an integer >= 1")
        if not _is_num(self.rate) or self.rate <= 0:
            raise TraceError(f"--rate={self.rate!r} is not allowed: requests per second, a number > 0")
        if self.arrivals not in ARRIVAL_PROCESSES:
            raise TraceError(f"--arrivals={self.arrivals!r} is not allowed: one of {ARRIVAL_PROCESSES}")
        if not _is_num(self.burstiness) or self.burstiness <= 0:
            raise TraceError(f"--burstiness={self.burstiness!r} is not allowed: a number > 0")
        if not self.classes or any(not _is_num(c.weight) or c.weight <= 0 for c in self.classes):
            raise TraceError("classes: at least one class with a weight > 0 is required")


def default_classes(rare_file: str | None = None) -> tuple:
    """Short chat behind a shared 32-token system prompt, long documents, and (given a file) a rare slice."""
    classes = [TraceClass("chat", 0.6, 24, 0.5, 32, 0.4, prefix="system-a", prefix_tokens=32),
               TraceClass("doc", 0.3, 120, 0.3, 16, 0.3)]
    if rare_file:
        classes.append(TraceClass("rare", 0.1, 60, 0.3, 24, 0.3, text_file=rare_file))
    return tuple(classes)


def _gaps(spec: TraceSpec, rng: np.random.Generator) -> np.ndarray:
    mean = 1.0 / spec.rate
    if spec.arrivals == "poisson":
        return rng.exponential(mean, spec.requests)
    shape = 1.0 / spec.burstiness ** 2          # gamma gaps: CV = 1 / sqrt(shape)
    return rng.gamma(shape, mean / shape, spec.requests)


def _text_prompt(lines: Sequence[str], chars: int, rng: np.random.Generator) -> str:
    start = int(rng.integers(0, len(lines)))
    text = ""
    for i in range(start, start + len(lines)):
        text += lines[i % len(lines)]
        if len(text) >= chars:
            break
    return text[:max(chars, 1)]


def generate_trace(spec: TraceSpec) -> list[dict]:
    """Draw the trace's records (dicts in the JSONL format, keys sorted when written). Raises TraceError for
    bad arguments, FileNotFoundError for a missing text file."""
    spec.validate()
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    texts = {c.name: [ln for ln in read_text(c.text_file, error=TraceError).splitlines(True) if ln.strip()]
             for c in spec.classes if c.text_file}
    weights = np.array([c.weight for c in spec.classes], float)
    arrivals = np.cumsum(_gaps(spec, rng))
    kinds = rng.choice(len(spec.classes), spec.requests, p=weights / weights.sum())
    records = []
    for i in range(spec.requests):
        c = spec.classes[int(kinds[i])]
        out = int(np.clip(round(rng.lognormal(math.log(c.output_median), c.output_sigma)), 1, spec.max_context // 2))
        prompt = int(np.clip(round(rng.lognormal(math.log(c.prompt_median), c.prompt_sigma)), 1,
                             spec.max_context - out))
        rec = {"arrival": round(float(arrivals[i]), 6), "max_tokens": out, "slice": c.name}
        if c.text_file:
            rec["prompt"] = _text_prompt(texts[c.name], prompt, rng)
        else:
            rec["prompt_tokens"] = max(prompt, c.prefix_tokens + 1) if c.prefix else prompt
            if c.prefix:
                rec["prefix"], rec["prefix_tokens"] = c.prefix, c.prefix_tokens
        records.append(rec)
    return records


def trace_text(records: list[dict]) -> str:
    """The JSONL text of ``records``: one compact JSON object per line, keys sorted."""
    return "".join(json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
                   for r in records)
