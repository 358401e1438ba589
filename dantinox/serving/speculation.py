"""Host side of the engine's speculative decoding: its settings, which rows speculate in a step, and the
switch-off rule. Plain Python, no device (the verify call itself: ``dantinox.serving.verify_step``).

With ``EngineConfig.speculative`` set, every step's decode rows (one token each, no structured-output
constraint: a constraint's mask needs the host after every token) may go through one verify call instead of a
plain decode: row b proposes up to ``limit[b]`` tokens by prompt lookup and the call emits the accepted ones plus
the target's own token (``verify_step``'s docstring). ``limit[b]`` is the smallest of k (spec_tokens), the
tokens the request may still generate minus one (so no call computes past max_tokens) and the positions its
blocks already hold past its last token minus one (the Scheduler reserves up to k more slots for each decode
row, from free blocks only, after admission: speculation never preempts and never holds back an admission).

Switch-off rule, the Generator's (``dantinox.generation.speculative``, ``speculative_generate.break_even``) as a
host rule. A verify call over a batch of n decode rows costs c(n) plain decode steps (``SpecConfig.verify_costs``,
serve's --spec-verify-cost, when given; else the engine measures it on its own calls, ``verify_cost``) and gives row
r 1 + a_r tokens, a_r its accepted proposals; a plain step gives 1 per row. Per row: after PROBE_VERIFIES verify
calls (calls in which it could accept), a row whose measured mean a_r falls below min_accept = c(n) - 1 stops
proposing (limit 0). Per step: the step verifies only when sum_r (1 + est_r) > c(n) * n, est_r the row's measured
mean (k before its probes are done, so each row is probed), 0 for rows not proposing; else it is an ordinary step
(multi-step decoding included). A larger batch makes the verify call dearer (c grows towards k + 1 as the step
becomes compute-bound), so speculation turns itself off where the batch makes it a loss, and on again when the batch
shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..generation.speculative import PROBE_VERIFIES
from ..generation.speculative_generate import break_even, check_spec_settings
from .request import Request

PROPOSERS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding in the engine.

    proposer: "ngram" (prompt lookup, ``dantinox.generation.ngram``) or "draft" (a draft model's proposals: the
    engine is given the model, ``draft_model``; the n-gram lengths are then unused); spec_tokens: k proposals per
    verify call, 1..MAX_SPEC_TOKENS; ngram_max / ngram_min: the n-gram lengths looked up
    (1 <= ngram_min <= ngram_max <= 16);
    verify_costs: ((n, c), ...) the time of a verify call over n decode rows divided by a plain decode step's over
    the same rows (wall-time ratio, > 0); the cost of a batch of n is that of the smallest listed n' >= n (the
    largest listed beyond them); with none listed the engine measures c(n) itself (``verify_cost``). Raises
    ValueError naming the field."""

    proposer: str = "ngram"
    spec_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    verify_costs: tuple = ()

    def __post_init__(self):
        if self.proposer not in PROPOSERS:
            raise ValueError(f"speculative proposer={self.proposer!r} is not allowed: one of "
                             f"{', '.join(map(repr, PROPOSERS))}")
        check_spec_settings(self.spec_tokens, self.ngram_max, self.ngram_min)
        for pair in self.verify_costs:
            ok = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int) and pair[0] >= 1
            if not ok or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float)) or not pair[1] > 0:
                raise ValueError(f"verify_costs entry {pair!r} is not allowed: (batch rows >= 1, cost > 0)")

    def cost(self, rows: int) -> float:
        """c(rows): verify-call cost in plain decode steps for a batch of ``rows`` decode rows."""
        costs = sorted(self.verify_costs)
        if not costs:
            return 1.0
        return float(next((c for n, c in costs if n >= rows), costs[-1][1]))


@dataclass
class SpecRowStats:
    """One request's speculation so far: verifies (verify calls in which it could accept at least one
    proposal), proposed (proposals verified: limit where its lookup found a match), accepted (proposals
    emitted)."""

    verifies: int = 0
    proposed: int = 0
    accepted: int = 0

    def mean_accepted(self, k: int) -> float:
        """Accepted proposals per verify call; k (optimistic) before the PROBE_VERIFIES probes are done."""
        return k if self.verifies < PROBE_VERIFIES else self.accepted / self.verifies


def row_stats(req: Request) -> SpecRowStats:
    """``req``'s SpecRowStats (created on first use; kept across preemptions)."""
    if req.spec is None:
        req.spec = SpecRowStats()
    return req.spec


def eligible(chunk) -> bool:
    """A chunk may be verified: a decode chunk (one token, the request's last) of a request without a constraint
    or logit biases (the verify call applies neither)."""
    options = chunk.request.options
    return (chunk.num_tokens == 1 and chunk.request.remaining == 1 and options.constraint is None
            and not options.logit_bias)


def row_limit(chunk, k: int, held: int) -> int:
    """Proposals the chunk's row may accept: min(k, tokens it may still generate - 1, held - 1), held the
    positions its blocks hold from its last token on."""
    req = chunk.request
    return max(0, min(k, req.options.max_new_tokens - len(req.output_ids) - 1, held - 1))


def plan_speculation(chunks: list, spec: SpecConfig, held, cost: float | None = None) -> dict | None:
    """{id(chunk): limit} for the step's verify call(s), or None for an ordinary step (module docstring).

    held: a function chunk -> the positions its request's blocks hold from chunk.start on. cost: c(n) for the
    step's n eligible rows (the engine's measured ``verify_cost.VerifyCostMeter``); None: ``spec.cost(n)``."""
    rows = [c for c in chunks if eligible(c)]
    if not rows:
        return None
    k, c = spec.spec_tokens, spec.cost(len(rows)) if cost is None else cost
    min_accept = break_even(c, k)
    limits, estimate = {}, 0.0
    for chunk in rows:
        stats = row_stats(chunk.request)
        limit = row_limit(chunk, k, held(chunk))
        mean = stats.mean_accepted(k)
        if limit and (stats.verifies < PROBE_VERIFIES or mean >= min_accept):
            limits[id(chunk)] = limit
            estimate += 1.0 + min(mean, limit)
        else:
            limits[id(chunk)] = 0
            estimate += 1.0
    if not any(limits.values()) or estimate <= c * len(rows) and c > 1.0:
        return None
    return limits


def record(req: Request, limit: int, proposed: int, emitted: int) -> tuple[int, int]:
    """Book one verify call of ``req``: ``limit`` proposals allowed, ``proposed`` verified (0 without a match),
    ``emitted`` tokens it added. Returns (proposed, accepted) of this call (accepted: emitted - 1 or 0)."""
    stats = row_stats(req)
    accepted = max(emitted - 1, 0) if proposed else 0
    stats.verifies += bool(limit)
    stats.proposed += proposed
    stats.accepted += accepted
    return proposed, accepted

