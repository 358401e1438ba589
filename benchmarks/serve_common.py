"""Shared pieces of the serving benchmarks: the small model, the mixed trace, percentiles.

Model ("small"): GQA, dim 128, 4 query heads x 32, 2 KV heads, 4 blocks, vocab 256, max_context 128,
untied output projection, float32, random weights from seed 0 (a random model with an untied head gives
varied greedy text, so equality checks mean something).

Trace: ``n`` requests with prompt lengths uniform in [4, 64] tokens and max_tokens uniform in [8, 48] by
default (``--prompt-range`` / ``--new-range``; prompt + max_tokens <= max_context), greedy, arriving as a
Poisson process of ``rate`` requests/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import dantinox as dx


def small_config() -> dx.ModelConfig:
    return dx.ModelConfig(attention="gqa", kv_heads=2, dim=128, n_heads=4, head_size=32, num_blocks=4,
                          vocab_size=256, max_context=128, mlp_hidden=256, tie_embeddings=False)


def small_model(seed: int = 0):
    return dx.build_model(small_config(), seed)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float      # seconds after the trace starts
    prompt: list          # token ids
    max_tokens: int


def mixed_trace(n: int, rate: float, seed: int = 0, vocab: int = 256, prompt_range=(4, 64),
                new_range=(8, 48)) -> list[TraceRequest]:
    """Ranges are inclusive token counts."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    lo, hi = prompt_range
    return [TraceRequest(float(t), rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist(),
                         int(rng.integers(new_range[0], new_range[1] + 1))) for t in arrivals]


def add_trace_arguments(parser) -> None:
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(4, 64), metavar=("MIN", "MAX"),
                        help="prompt tokens, inclusive (default 4 64)")
    parser.add_argument("--new-range", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"),
                        help="max_tokens per request, inclusive (default 8 48)")


def pct(values, q: float) -> float:
    """The q-th percentile (0..100) of ``values`` in the same unit; nan for an empty list."""
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else float("nan")
