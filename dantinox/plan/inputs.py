"""Reading and checking the planner's inputs: the model, a trace, a profile, SLOs, prices, memory sizes.

Every function raises ValueError (or TraceError, a ValueError) with one line naming the flag or the file
and line, the value, and what is allowed; the CLI prints it and exits 2.
"""

from __future__ import annotations

import hashlib
import math

from ..budget.size_flags import parse_size_flag
from ..runs.bundled import bundled_run_dir
from ..runs.run_dir import load_run
from ..runs.input_files import read_json, read_yaml, where
from .candidate import Candidate
from .trace import TraceError, prompt_token_ids, read_trace

SLO_KEYS = ("ttft_p99", "tpot_p99")


def parse_slo(text: str) -> dict:
    """'ttft_p99=500,tpot_p99=80' (milliseconds) -> {"ttft_p99": 0.5, "tpot_p99": 0.08} (seconds)."""
    out = {}
    for part in (p for p in str(text).split(",") if p.strip()):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in SLO_KEYS:
            raise ValueError(f"--slo {key}: unknown SLO; allowed: {', '.join(SLO_KEYS)} (milliseconds)")
        ms = positive_number(f"--slo {key}", value)
        out[key] = ms / 1e3
    if not out:
        raise ValueError(f"--slo {text!r} is not allowed: e.g. ttft_p99=500,tpot_p99=80 (milliseconds)")
    return out


def positive_number(flag: str, value) -> float:
    """float(value) if it is a finite number > 0, else ValueError naming ``flag``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{flag}={value!r} is not allowed: a positive number")
    return number


def parse_memory(flag: str, text: str) -> int:
    """'80GB', '512MiB', '1000' -> bytes, via ``dantinox.budget.size_flags.parse_size_flag``; ValueError
    naming ``flag``, the value and what is allowed."""
    return parse_size_flag(flag, text)


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_model(run_dir: str | None, max_context: int | None = None, flag: str = "--max-context"):
    """(run_dir, model, cfg, tokenizer) of a run directory or the bundled model. With ``max_context`` N the
    model is served with an N-token context (its config's max_context set to N, the same weights; what
    vLLM's --max-model-len does): the engine's block tables, pool and buckets, the profile and the
    simulation are then sized for N tokens, not the checkpoint's context. Raises RunDirError, or ValueError
    naming ``flag`` when N is not an integer in [1, the model's max_context]."""
    run_dir = run_dir or bundled_run_dir()
    model, cfg, tokenizer, _ = load_run(run_dir)
    if max_context is not None:
        model, cfg = with_max_context(model, cfg, max_context, flag)
    return run_dir, model, cfg, tokenizer


def with_max_context(model, cfg, max_context: int, flag: str = "--max-context"):
    """(model, cfg) serving contexts of at most ``max_context`` tokens (the same parameter arrays; the model
    itself when it is already its context). Raises ValueError naming ``flag`` for a value that is not an
    integer in [1, cfg.max_context] (a longer context than the checkpoint's would be positions it never
    saw)."""
    if isinstance(max_context, bool) or not isinstance(max_context, int) or not 1 <= max_context <= cfg.max_context:
        raise ValueError(f"{flag}={max_context!r} is not allowed: an integer from 1 to the model's max_context "
                         f"({cfg.max_context})")
    if max_context == cfg.max_context:
        return model, cfg
    from ..quant.kv_dtype import with_config

    model = with_config(model, cfg.replace(max_context=max_context))
    return model, model.cfg


def load_trace(path: str, cfg, tokenizer, flag: str = "--trace") -> tuple[list, list]:
    """(requests, prompt ids) of a trace for the model; TraceError naming ``flag``, the file and the line for a
    bad request, including a text prompt that, encoded, no longer fits the context (``read_trace``)."""
    requests = read_trace(path, cfg.max_context, flag)
    path = where(flag, path)
    prompts = []
    for q in requests:
        try:
            ids = prompt_token_ids(q, tokenizer, cfg.vocab_size)
        except TraceError as err:
            raise TraceError(f"{path} {err}") from None
        if len(ids) + q.max_tokens > cfg.max_context:
            raise TraceError(f"{path} line {q.index + 1}: prompt of {len(ids)} tokens + max_tokens={q.max_tokens}"
                             f" exceeds the model's context of {cfg.max_context} tokens")
        prompts.append(ids)
    return requests, prompts


def load_json(flag: str, path: str) -> dict:
    """A JSON object from ``path``; ValueError naming the flag and the file for a missing, unreadable, non-UTF-8
    or non-JSON file (``dantinox.runs.input_files``) or JSON that is not an object."""
    data = read_json(path, flag)
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {path}: a JSON object is required")
    return data


def load_candidates(path: str, flag: str = "--candidates") -> list:
    """Candidates from a YAML file: a list of mappings (Candidate fields), or {"candidates": [...]}.
    ValueError naming ``flag`` and the file: a missing,
    unreadable, non-UTF-8 or non-YAML file (``dantinox.runs.input_files``), no candidates, a bad field."""
    data = read_yaml(path, flag)
    if isinstance(data, dict):
        data = data.get("candidates")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{flag} {path}: a non-empty list of candidates is required")
    out = []
    for d in data:
        try:
            out.append(Candidate.from_dict(d))
        except ValueError as err:
            raise ValueError(f"{flag} {path}: {err}") from None
    return out
