"""The prefill token budget of an engine step, derived from a per-token latency target (plain Python).

Chunked prefill piggybacked on decoding (Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM
Inference with Sarathi-Serve", OSDI, sections 4.1-4.3): every step carries each running request's decode token
and prefill chunks up to a token budget, so a long prompt never stalls the streams already running for longer
than one chunk. The budget sets the trade: a larger one finishes prompts sooner (time to first token, TTFT) and
batches more (throughput); a smaller one keeps each step short for the running streams (time per output token,
TPOT). Sarathi-Serve picks it from the TPOT target with a profile; here it is measured as the engine runs:

  ``TokenBudget(tpot_slo, max_tokens, min_tokens)`` keeps exponential moving averages of a step's seconds per
  prefill token and of a decode-only step's seconds, and while any request is decoding gives
      budget = (tpot_slo - decode step) / (seconds per prefill token),
  clipped to [min_tokens, max_tokens]; while nobody decodes there is no stream to protect and the budget is
  max_tokens. Without a target (tpot_slo None) the budget is always max_tokens (``--max-batched-tokens``).
The floor min_tokens keeps prefill moving when the target cannot be met even with tiny chunks (a stream then
sees at most one such chunk per token). Times are seconds, budgets tokens.
"""

from __future__ import annotations

SMOOTHING = 0.25   # weight of the newest observation in the moving averages


class TokenBudget:
    """Prefill tokens per step (module docstring).

    Args: tpot_slo: seconds per output token to keep for running streams, or None (no target); max_tokens: the
    largest budget (``max_batched_tokens``); min_tokens: the floor under a target. Raises ValueError naming
    the flag for a tpot_slo that is not a positive finite number, or a max_tokens below min_tokens.
    """

    def __init__(self, tpot_slo: float | None, max_tokens: int, min_tokens: int = 32):
        if tpot_slo is not None and (isinstance(tpot_slo, bool) or not isinstance(tpot_slo, (int, float))
                                     or not 0 < tpot_slo < float("inf")):
            raise ValueError(f"--tpot-slo {tpot_slo!r} is not allowed: a positive number of seconds per output "
                             "token (e.g. 0.05)")
        for name, value in (("--max-batched-tokens", max_tokens), ("--min-prefill-chunk", min_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} is not allowed: a positive integer (tokens)")
        if tpot_slo is not None and max_tokens < min_tokens:
            raise ValueError(f"--max-batched-tokens {max_tokens} is not allowed with --min-prefill-chunk "
                             f"{min_tokens}: the step's prefill budget must hold at least one chunk (give "
                             f"--max-batched-tokens >= {min_tokens} or a smaller --min-prefill-chunk)")
        self.tpot_slo, self.max_tokens, self.min_tokens = tpot_slo, max_tokens, min_tokens
        self.per_token: float | None = None    # seconds per prefill token of a step (EMA)
        self.decode_step: float | None = None  # seconds of a decode-only step (EMA)

    def budget(self, decoding: int) -> int:
        """The prefill tokens the next step may carry while ``decoding`` requests run a decode token in it."""
        if self.tpot_slo is None or not decoding or self.per_token is None:
            return self.max_tokens
        room = self.tpot_slo - (self.decode_step or 0.0)
        tokens = int(room / self.per_token) if self.per_token > 0 else self.max_tokens
        return max(self.min_tokens, min(self.max_tokens, tokens))

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float, iterations: int = 1) -> None:
        """Book a finished step: its prefill tokens, its decode rows, its wall time (seconds) and, for a
        decode-only step, its decode iterations (a multi-step call runs several). A step with prefill updates
        the per-token cost (its decode rows' share taken off first); a decode-only step the time of one decode
        iteration."""
        if seconds <= 0:
            return
        if prefill_tokens:
            share = (self.decode_step or 0.0) if decode_rows else 0.0
            self.per_token = _ema(self.per_token, max(seconds - share, 0.0) / prefill_tokens)
        elif decode_rows:
            self.decode_step = _ema(self.decode_step, seconds / max(int(iterations), 1))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
