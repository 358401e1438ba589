"""Shared pieces of the serving benchmarks: the small model, the mixed trace, percentiles.

Model ("small"): GQA, dim 128, 4 query heads x 32, 2 KV heads, 4 blocks, vocab 256, max_context 128,
untied output projection, float32, random weights from seed 0 (a random model with an untied head gives
varied greedy text, so equality checks mean something).

Trace: ``n`` requests with prompt lengths uniform in [4, 64] tokens and max_tokens in [8, 48] by default
(``--prompt-range`` / ``--new-range``; prompt + max_tokens <= max_context), greedy, arriving as a Poisson
process of ``rate`` requests/s. max_tokens is uniform over the range (``--new-dist uniform``) or long-tailed
(``--new-dist lognormal``: log-normal with its median at the range's geometric mean and sigma a quarter of
the range's log-width, clipped to the range; most requests are short and a few are long, the shape chat
traces have, and the case continuous batching was made for: Yu et al. 2022, "Orca", OSDI, section 2).
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


NEW_DISTRIBUTIONS = ("uniform", "lognormal")


def mixed_trace(n: int, rate: float, seed: int = 0, vocab: int = 256, prompt_range=(4, 64),
                new_range=(8, 48), new_dist: str = "uniform") -> list[TraceRequest]:
    """Ranges are inclusive token counts; new_dist is one of NEW_DISTRIBUTIONS (see the module docstring)."""
    if new_dist not in NEW_DISTRIBUTIONS:
        raise ValueError(f"new_dist={new_dist!r} is not allowed: one of {NEW_DISTRIBUTIONS}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    lo, hi = prompt_range
    prompts = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
    n_lo, n_hi = new_range
    if new_dist == "uniform":
        new = rng.integers(n_lo, n_hi + 1, n)
    else:
        median, sigma = np.sqrt(n_lo * n_hi), np.log(n_hi / n_lo) / 4
        new = np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(n))), n_lo, n_hi)
    return [TraceRequest(float(t), p, int(k)) for t, p, k in zip(arrivals, prompts, new)]


def add_trace_arguments(parser) -> None:
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(4, 64), metavar=("MIN", "MAX"),
                        help="prompt tokens, inclusive (default 4 64)")
    parser.add_argument("--new-range", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"),
                        help="max_tokens per request, inclusive (default 8 48)")
    parser.add_argument("--new-dist", choices=NEW_DISTRIBUTIONS, default="uniform",
                        help="distribution of max_tokens over --new-range (default uniform)")


def pct(values, q: float) -> float:
    """The q-th percentile (0..100) of ``values`` in the same unit; nan for an empty list."""
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else float("nan")
