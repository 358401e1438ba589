"""Speculative decoding in simulation: which rows verify, how many tokens a verify step emits, when a row stops.

A speculating candidate (``Candidate.spec_tokens`` k >= 1, n-gram proposals: no draft model, so proposing
costs no device time) replaces a decode row's plain step by one verify call, a forward over [B, k + 1] tokens
(the last token and k proposals, ``CostModel.verify_cost``), which emits 1 + accepted tokens.

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", section 3.1):
each proposal is accepted independently with probability a (the request's acceptance rate), and the first
rejection ends the run, so accepted = min(k, G) with P(accepted >= i) = a^i, and the expected tokens per
verify step are sum_{i=0..k} a^i = (1 - a^(k+1)) / (1 - a) (k + 1 at a = 1; ``expected_tokens_per_step``).
Counts are drawn by inverting that distribution at a uniform u in (0, 1] from a numpy PCG64 stream seeded by
(seed, request index): accepted = min(k, floor(log u / log a)). One stream per request, independent of the
candidate and of the other requests, so two candidates see the same draws (common random numbers) and the same
inputs give the same plan, byte for byte.

Switch-off rule, as the engine's (``dantinox.generation.speculative``): a verify call costing c plain steps
pays while the accepted proposals per call exceed min_accept = c - 1 (``break_even``); after PROBE_VERIFIES
verify calls a row whose accepted count falls below min_accept x calls stops speculating for the rest of the
request. Here c = verify_cost(B, k) / forward_cost(B, 1) at the step's decode batch bucket B, so the rule sees
that a verify call grows costlier with the batch (the generation engine measures c at B = 1). A row also
decodes plainly when fewer than k + 1 context slots are left, or when it has one token left to generate.
"""

from __future__ import annotations

import math

import numpy as np

from ..generation.speculative import MAX_SPEC_TOKENS, PROBE_VERIFIES
from ..generation.speculative_generate import break_even


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens one verify step emits: (1 - a^(k+1)) / (1 - a), k + 1 at a = 1 (module docstring)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def accepted_count(u: float, acceptance: float, k: int) -> int:
    """Accepted proposals (0..k) at uniform draw u in (0, 1]: min(k, floor(log u / log a)); P(>= i) = a^i."""
    if acceptance <= 0.0:
        return 0
    if acceptance >= 1.0 or u >= 1.0:
        return k if acceptance >= 1.0 else 0
    return min(k, int(math.floor(math.log(u) / math.log(acceptance))))


def check_acceptance(name: str, value) -> float:
    """value as a float in [0, 1]; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r} is not allowed: an acceptance rate, a number in [0, 1]")
    return float(value)


def check_spec_tokens(name: str, value) -> int:
    """value as an int in [0, MAX_SPEC_TOKENS] (0: no speculation); ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SPEC_TOKENS:
        raise ValueError(f"{name}={value!r} is not allowed: an integer in [0, {MAX_SPEC_TOKENS}] "
                         "(proposed tokens per verify call; 0: no speculation)")
    return value


class _Row:
    """One request's speculation: its acceptance, draw stream, verify calls and accepted proposals so far."""

    def __init__(self, acceptance: float, seed: int, index: int):
        self.acceptance, self.calls, self.accepted, self.off = acceptance, 0, 0, False
        self.rng = np.random.Generator(np.random.PCG64([seed, index]))


class Speculation:
    """The speculation state of one simulated replica. k: proposed tokens per verify call (>= 1);
    acceptance: {request id: acceptance rate in [0, 1]} (every request the replica may see); index:
    {request id: trace index} (seeds the request's stream); seed: the draws' seed."""

    def __init__(self, k: int, acceptance: dict, index: dict, seed: int = 0):
        self.k, self.acceptance, self.index, self.seed = k, acceptance, index, seed
        self.rows: dict = {}

    def speculates(self, chunk, max_context: int) -> bool:
        """True when this decode chunk is verified (module docstring: a decode row, not switched off, with at
        least k + 1 free slots and two or more tokens to generate)."""
        req = chunk.request
        if chunk.num_tokens != 1 or chunk.start < len(req.prompt_ids):
            return False
        if chunk.start + self.k + 1 > max_context or req.options.max_new_tokens - len(req.output_ids) < 2:
            return False
        return not self._row(req.request_id).off

    def draw(self, request_id: str) -> int:
        """Tokens the next verify of this request emits: 1 + accepted proposals (drawn from its stream)."""
        row = self._row(request_id)
        u = 1.0 - row.rng.random()          # in (0, 1]
        return 1 + accepted_count(u, row.acceptance, self.k)

    def record(self, request_id: str, accepted: int, min_accept: float) -> None:
        """Count one verify call that accepted ``accepted`` proposals; apply the switch-off rule."""
        row = self._row(request_id)
        row.calls, row.accepted = row.calls + 1, row.accepted + accepted
        if row.calls >= PROBE_VERIFIES and row.accepted < min_accept * row.calls:
            row.off = True

    def min_accept(self, cost, B: int) -> float:
        """The switch-off threshold at decode batch bucket B: break_even(verify / plain step cost, k)."""
        plain = cost.forward_cost(B, 1)
        return break_even(cost.verify_cost(B, self.k) / plain, self.k) if plain > 0 else 0.0

    def counters(self) -> dict:
        """Verify calls, accepted proposals and rows switched off, over the requests seen."""
        rows = self.rows.values()
        return {"spec_verify_calls": sum(r.calls for r in rows), "spec_accepted": sum(r.accepted for r in rows),
                "spec_switched_off": sum(r.off for r in rows)}

    def _row(self, request_id: str) -> _Row:
        if request_id not in self.rows:
            self.rows[request_id] = _Row(self.acceptance[request_id], self.seed, self.index[request_id])
        return self.rows[request_id]
