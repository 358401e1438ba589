"""Other tools' trace files converted to the planner's trace format (``dantinox plan trace --from FORMAT FILE``).

  mooncake     the Mooncake JSONL trace (Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture
               for LLM Serving", FAST 2025; the trace files of github.com/kvcache-ai/Mooncake, which AIPerf and
               guidellm replay): one object per line with
                 timestamp      milliseconds since the trace starts (number >= 0, non-decreasing)
                 input_length   prompt tokens (integer >= 1)
                 output_length  tokens generated (integer >= 1)
                 hash_ids       the prompt's 512-token blocks as content hashes (list of integers >= 0)
               converted to {"arrival": (timestamp - first timestamp) / 1000, "prompt_tokens": input_length,
               "max_tokens": output_length, "hash_ids": hash_ids, "block_tokens": 512}; requests that share
               leading hash ids share those prompt tokens (trace.prompt_token_ids), so prefix-cache hits
               carry over. Other fields are refused by name.
  request-log  a ``dantinox serve --request-log`` file: sorted by arrival, what the server observed dropped
               (the plain trace a planner or another tool reads).
"""

from __future__ import annotations

import json

from ..runs.input_files import read_text, where
from .trace import MOONCAKE_BLOCK_TOKENS, TraceError, _is_int, _is_num, read_trace

TRACE_FORMATS = ("mooncake", "request-log")
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _mooncake_line(obj, where: str) -> dict:
    """One Mooncake object checked; TraceError naming the line and field."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a JSON object is required, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_MOONCAKE_FIELDS))
    if unknown:
        raise TraceError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(_MOONCAKE_FIELDS)}")
    missing = [k for k in _MOONCAKE_FIELDS[:3] if k not in obj]
    if missing:
        raise TraceError(f"{where}: field {missing[0]!r} is missing")
    if not _is_num(obj["timestamp"]) or obj["timestamp"] < 0:
        raise TraceError(f"{where}: timestamp={obj['timestamp']!r} is not allowed: milliseconds, a number >= 0")
    for name in ("input_length", "output_length"):
        if not _is_int(obj[name]) or obj[name] < 1:
            raise TraceError(f"{where}: {name}={obj[name]!r} is not allowed: an integer >= 1")
    hashes = obj.get("hash_ids", [])
    if not isinstance(hashes, list) or not all(_is_int(h) and h >= 0 for h in hashes):
        raise TraceError(f"{where}: hash_ids is not allowed: a list of integers >= 0")
    return obj


def read_mooncake(path: str, label: str | None = None) -> list[dict]:
    """The Mooncake trace at ``path`` as trace records (see the module docstring). Raises TraceError naming the
    file (after ``label``, e.g. "--from mooncake") and line (not JSON, a missing, unknown or bad field, a
    decreasing timestamp, no requests), or the file (a directory, unreadable, not UTF-8:
    ``dantinox.runs.input_files``), and InputFileNotFound (a FileNotFoundError)."""
    out, first, last = [], None, 0.0
    name = where(label, path)
    for lineno, text in enumerate(read_text(path, label, TraceError).split("\n"), 1):
        if not text.strip():
            continue
        at = f"{name} line {lineno}"
        try:
            obj = _mooncake_line(json.loads(text), at)
        except json.JSONDecodeError as err:
            raise TraceError(f"{at}: not valid JSON ({err.msg} at column {err.colno})") from None
        if obj["timestamp"] < last:
            raise TraceError(f"{at}: timestamp={obj['timestamp']} is not allowed: timestamps must not "
                             f"decrease (previous {last})")
        last = obj["timestamp"]
        first = obj["timestamp"] if first is None else first
        rec = {"arrival": round((obj["timestamp"] - first) / 1000.0, 6), "prompt_tokens": obj["input_length"],
               "max_tokens": obj["output_length"]}
        if obj.get("hash_ids"):
            rec["hash_ids"], rec["block_tokens"] = list(obj["hash_ids"]), MOONCAKE_BLOCK_TOKENS
        out.append(rec)
    if not out:
        raise TraceError(f"{name}: the trace has no requests")
    return out


def read_request_log(path: str, label: str | None = None) -> list[dict]:
    """A request log as plain trace records in arrival order (arrival, prompt_tokens, max_tokens, slice)."""
    out = []
    for req in read_trace(path, label=label):
        rec = {"arrival": req.arrival, "prompt_tokens": req.prompt_tokens, "max_tokens": req.max_tokens}
        if req.slice != "default":
            rec["slice"] = req.slice
        out.append(rec)
    return out


def convert_trace(fmt: str, path: str, label: str | None = None) -> list[dict]:
    """Trace records converted from ``path`` in format ``fmt`` (one of TRACE_FORMATS). Raises ValueError for
    another format, TraceError for a bad line or file (naming it after ``label``), FileNotFoundError."""
    if fmt == "mooncake":
        return read_mooncake(path, label)
    if fmt == "request-log":
        return read_request_log(path, label)
    raise ValueError(f"format={fmt!r} is not allowed: one of {', '.join(TRACE_FORMATS)}")
