"""Replay a trace through the real engine, in process, and measure what the simulator predicts.

``replay_realtime`` drives a warmed-up ``PagedEngine`` on the wall clock with the loop of the server's engine
thread: take every request whose arrival time has come, run one ``engine.step()``, stamp the step's tokens with
the time it returned, sleep until the next arrival when there is nothing to do. Metrics are the simulator's
(metrics.summarize), measured from each request's trace arrival time.

Why not over HTTP with guidellm: an in-process replay stamps tokens where the engine produces them, so the
comparison with the simulator is not blurred by HTTP, JSON and asyncio on a small CPU host shared with the
client; ``dantinox serve`` with guidellm (``--backend kind=openai_http``) remains the end-to-end check.

``RealReplica`` adapts a PagedEngine to the simulator's replica interface, so ``simulate.run_trace`` can drive
the real engine with a virtual clock (each step costing a fixed time): then the simulator and the engine see
the same arrivals at the same steps, and must admit, preempt and finish in the same order.
"""

from __future__ import annotations

import time

from ..serving.request import QueueFullError, RequestError
from .metrics import RequestRecord, summarize
from .simulate import ReplicaView, options_for


class RealReplica(ReplicaView):
    """A PagedEngine behind the replica interface. step_seconds: the virtual cost of every step (None: the
    step's wall time)."""

    def __init__(self, engine, step_seconds: float | None = None):
        self.engine, self.step_seconds = engine, step_seconds
        self.scheduler, self.allocator = engine.scheduler, engine.allocator
        self.inbox: list = []
        self.finished_order: list = []
        self.peak_blocks = 0
        self.queue_samples: list = []

    def add(self, rid, ids, options, arrival):
        """Raises RequestError / QueueFullError as PagedEngine.add_request does."""
        self.engine.add_request(ids, options, request_id=rid)
        return self.engine.requests[rid]

    def step(self, idle: float = 0.0, warming: float = 0.0) -> tuple[float, list]:
        """One engine.step(): (its cost: step_seconds or the wall time, [(request id, tokens generated)]).
        idle, warming: what the simulator's cost model reads (the real engine pays for them itself; ignored)."""
        t0 = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - t0
        self.queue_samples.append(len(self.scheduler.waiting))
        self.peak_blocks = max(self.peak_blocks, self.allocator.num_used)
        self.finished_order += [o.request_id for o in outputs if o.finished]
        emitted = [(o.request_id, len(o.new_token_ids)) for o in outputs if o.new_token_ids]
        return (self.step_seconds if self.step_seconds is not None else seconds), emitted

    def counters(self) -> dict:
        """The engine's preemptions, prefix-cache hits and queries; peak and total KV blocks."""
        s = self.engine.stats()
        return {"preemptions": s["preemptions"], "prefix_cache_hits": s["prefix_cache_hits"],
                "prefix_cache_queries": s["prefix_cache_queries"], "peak_kv_blocks": self.peak_blocks,
                "kv_blocks": s["blocks_total"]}


def replay_realtime(engine, requests: list, prompts: list, slo: dict | None = None, speed: float = 1.0) -> dict:
    """Replay ``requests`` (TraceRequest, arrival order; prompt ids in ``prompts``) on the wall clock through
    ``engine`` (warm it up first). speed: arrival times are divided by it. Returns the metrics dict."""
    rep = RealReplica(engine)
    records = [RequestRecord(q.index, q.arrival / speed, q.slice) for q in requests]
    by_id = {f"r{q.index}": rec for q, rec in zip(requests, records)}
    t0, i = time.perf_counter(), 0
    while i < len(requests) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(requests) and records[i].arrival <= now:
            try:
                rep.add(f"r{requests[i].index}", prompts[i], options_for(requests[i]), records[i].arrival)
            except (RequestError, QueueFullError) as err:
                records[i].rejected = f"{type(err).__name__}: {err}"
            i += 1
        if engine.has_unfinished():
            _, emitted = rep.step()
            end = time.perf_counter() - t0
            for rid, n in emitted:
                by_id[rid].token_times.extend([end] * n)
        elif i < len(requests):
            time.sleep(max(records[i].arrival - now, 0.0))
    counters = rep.counters()
    samples = rep.queue_samples
    counters.update(queue_mean=float(sum(samples) / len(samples)) if samples else 0.0,
                    queue_max=max(samples, default=0))
    out = summarize(records, slo, counters)
    out["records"] = records
    return out
