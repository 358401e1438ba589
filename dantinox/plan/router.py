"""Routers: which replica gets an arriving request.

  round_robin       replicas in turn.
  least_tokens      the replica with the fewest outstanding tokens (prompt tokens still to compute plus
                    output tokens still to generate, queued or running); ties to the lowest index.
  prefix_affinity   the replica whose prefix cache holds the most leading blocks of the prompt; with no hit
                    anywhere, the replica the same first block was last sent to (so a shared system prompt
                    keeps landing where its blocks will be), else least_tokens.
"""

from __future__ import annotations

from .candidate import ROUTING


class Router:
    """Stateful router over replicas exposing ``outstanding_tokens()`` and ``cached_prefix_blocks(ids)``
    / ``first_block_key(ids)``. Raises ValueError for an unknown policy."""

    def __init__(self, policy: str):
        if policy not in ROUTING:
            raise ValueError(f"routing={policy!r} is not allowed: one of {ROUTING}")
        self.policy = policy
        self._next = 0
        self._sticky: dict = {}

    def choose(self, replicas: list, prompt_ids: list) -> int:
        """Index of the replica for a request with ``prompt_ids``."""
        if len(replicas) == 1:
            return 0
        if self.policy == "round_robin":
            i, self._next = self._next, (self._next + 1) % len(replicas)
            return i
        if self.policy == "prefix_affinity":
            return self._affinity(replicas, prompt_ids)
        return _least(replicas)

    def _affinity(self, replicas: list, prompt_ids: list) -> int:
        hits = [r.cached_prefix_blocks(prompt_ids) for r in replicas]
        key = replicas[0].first_block_key(prompt_ids)
        if max(hits) > 0:
            best = hits.index(max(hits))
        elif key is not None and key in self._sticky:
            best = self._sticky[key]
        else:
            best = _least(replicas)
        if key is not None:
            self._sticky[key] = best
        return best


def _least(replicas: list) -> int:
    loads = [r.outstanding_tokens() for r in replicas]
    return loads.index(min(loads))
