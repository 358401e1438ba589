"""The request log (``dantinox serve --request-log FILE``): one JSON line per finished request, in the
capacity planner's trace format, so ``dantinox plan --trace FILE`` plans from the traffic the server saw.

A line (keys sorted, compact JSON, appended and flushed as the request finishes):

  source             "request-log"
  arrival            seconds from the log's opening to the request's submission to the engine (the server's
                     perf_counter clock); lines are in finish order, the planner sorts them by arrival
  prompt_tokens      prompt length in tokens
  max_tokens         tokens the request generated (the length a replay generates; 0 when it finished before
                     its first token, a line the planner skips)
  cached_tokens      prompt tokens served by the prefix cache at its last admission
  slice              the request's class when it names one: ``metadata.slice`` (a string), else ``user``
  ttft_s             first token - submission (seconds; null without a token)
  tpot_s             (last token - first token) / (tokens - 1) (seconds; null with fewer than 2 tokens)
  finish_reason      stop, length, abort, error, ...
  model_sha256       the served weights' sha256 (null when unknown), dantinox_version

Token times are when the engine thread routed the step's output (as the /metrics histograms count them).
The log is plain Python with no dependency on the planner (dantinox.plan reads it: plan/trace.py).
"""

from __future__ import annotations

import json
import threading
import time

from .._version import __version__

SOURCE = "request-log"


def slice_from(extra: dict | None) -> str | None:
    """The slice a request body names: ``metadata["slice"]`` when metadata is an object holding a non-empty
    string there, else ``user`` when it is a non-empty string, else None. ``extra``: the body's fields."""
    extra = extra or {}
    meta = extra.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("slice"), str) and meta["slice"]:
        return meta["slice"]
    user = extra.get("user")
    return user if isinstance(user, str) and user else None


def log_line(arrival: float, prompt_tokens: int, token_times: tuple, cached_tokens: int, finish_reason,
             slice_name: str | None, model_sha256: str | None) -> str:
    """One line of the log (with its newline). token_times: (first token, last token, tokens) in the same
    clock as ``arrival`` + the log's start, i.e. seconds since the log opened; (None, None, 0) for none."""
    first, last, count = token_times
    rec = {"source": SOURCE, "arrival": round(arrival, 6), "prompt_tokens": int(prompt_tokens),
           "max_tokens": int(count), "cached_tokens": int(cached_tokens), "finish_reason": finish_reason,
           "ttft_s": None if first is None else round(first - arrival, 6),
           "tpot_s": round((last - first) / (count - 1), 6) if count > 1 else None,
           "model_sha256": model_sha256, "dantinox_version": __version__}
    if slice_name:
        rec["slice"] = slice_name
    return json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"


class RequestLog:
    """Appends log lines to ``path`` (opened at construction; OSError if it cannot be). Thread-safe.
    clock: the seconds clock the worker stamps submissions and tokens with (time.perf_counter)."""

    def __init__(self, path: str, model_sha256: str | None = None, clock=time.perf_counter):
        self.path, self.model_sha256 = path, model_sha256
        self.start = clock()
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def record(self, submitted: float, first_token: float | None, last_token: float | None, tokens: int,
               prompt_tokens: int, cached_tokens: int, finish_reason, slice_name: str | None = None) -> None:
        """Write one finished request (times in the clock's seconds; see log_line)."""
        s = self.start
        line = log_line(submitted - s, prompt_tokens,
                        (None if first_token is None else first_token - s,
                         None if last_token is None else last_token - s, tokens),
                        cached_tokens, finish_reason, slice_name, self.model_sha256)
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        """Close the file (later records raise ValueError)."""
        with self._lock:
            self._file.close()
