"""The measurement behind ``plan --confirm``: one candidate's trace replayed on the real engine, in process.

``EngineReplayer(model, cfg, requests, prompts, slo, route_cost)`` is the ``measure`` callable of
confirm.confirm_candidates. For a candidate it builds the variant's model (plan.variants.apply_variant) and a
``PagedEngine`` with the candidate's engine settings, warms it up (compiles every call before timing), and
replays the trace on the wall clock (replay.replay_realtime) with a cold prefix cache each time.

Replicas: a candidate with R > 1 replicas is R engines on R devices. On one host they cannot run side by side
without sharing its cores, so each replica's share of the trace is replayed in turn on the one engine, with
the arrivals it would have seen; the shares are the simulator's routing decisions for this candidate (the
router's choice per request, from a simulation with ``route_cost``). round_robin routing is exactly what the
server does; least_tokens and prefix_affinity decide on replica state, which the simulation approximates.
The engine of the last candidate is kept while the next one has the same variant and settings (repeats reuse
it); otherwise it is dropped before the next is built, so one pool is alive at a time.
"""

from __future__ import annotations

from .metrics import summarize
from .replay import replay_realtime
from .simulate import simulate
from .variants import apply_variant


class EngineReplayer:
    """Candidate -> metrics dict (metrics.summarize's form) measured on the engine. requests / prompts: the
    plan's trace (TraceRequest list, prompt id lists); slo: {"ttft_p99": s, "tpot_p99": s}; route_cost: a
    CostModel for the routing simulation of multi-replica candidates."""

    def __init__(self, model, cfg, requests: list, prompts: list, slo: dict, route_cost):
        self.model, self.cfg = model, cfg
        self.requests, self.prompts, self.slo, self.route_cost = requests, prompts, slo, route_cost
        self._key, self._engine = None, None

    def engine(self, cand):
        """The warmed-up PagedEngine of ``cand``'s variant and settings (the previous one when they match)."""
        from ..serving.engine import PagedEngine

        key = (cand.kv_dtype, cand.quantize, cand.engine_config())
        if key != self._key:
            self._key, self._engine = None, None            # free the previous pool first
            model, _ = apply_variant(self.model, self.cfg, cand.kv_dtype, cand.quantize)
            engine = PagedEngine(model, cand.engine_config())
            engine.warmup()
            self._key, self._engine = key, engine
        return self._engine

    def shares(self, cand) -> list[list[int]]:
        """Trace indices per replica, in arrival order (one share of everything for one replica)."""
        if cand.replicas == 1:
            return [list(range(len(self.requests)))]
        sim = simulate(self.cfg, cand, self.route_cost, self.requests, self.prompts, self.slo)
        replica_of = {rec.index: rec.replica for rec in sim["records"]}
        return [[i for i, q in enumerate(self.requests) if replica_of[q.index] == k] for k in range(cand.replicas)]

    def __call__(self, cand) -> dict:
        """One replay of the whole trace for ``cand`` (every replica's share in turn)."""
        engine = self.engine(cand)
        records, counters = [], []
        for share in self.shares(cand):
            if not share:
                continue
            engine.allocator.pool.forget_all_hashes()        # each replay starts with a cold prefix cache
            out = replay_realtime(engine, [self.requests[i] for i in share], [self.prompts[i] for i in share],
                                  self.slo)
            records += out.pop("records")
            counters.append(out)
        records.sort(key=lambda r: r.index)
        return summarize(records, self.slo, merged_counters(counters))


def merged_counters(runs: list) -> dict:
    """The engine counters of several replays (replica shares) as one deployment's: sums, except the peak KV
    blocks and the longest queue (maxima) and the mean queue (the mean of the shares' means)."""
    if not runs:
        return {}
    total = {}
    for key in ("preemptions", "prefix_cache_hits", "prefix_cache_queries", "kv_blocks"):
        total[key] = sum(r.get(key, 0) for r in runs)
    total["peak_kv_blocks"] = max(r.get("peak_kv_blocks", 0) for r in runs)
    total["queue_max"] = max(r.get("queue_max", 0) for r in runs)
    total["queue_mean"] = float(sum(r.get("queue_mean", 0.0) for r in runs) / len(runs))
    return total
