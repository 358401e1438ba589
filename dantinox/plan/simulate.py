"""Simulate a trace through the serving engine's own scheduling code with a virtual clock.

A ``SimReplica`` holds the real ``Scheduler``, ``BlockAllocator`` and ``ContextPolicy`` of dantinox.serving, built
exactly as ``PagedEngine`` builds them (``step_plan.engine_policy`` / ``pool_blocks`` / ``engine_buckets``). Its
``step()`` does what ``PagedEngine.step()`` does on the host: schedule, plan the multi-step decode
(``plan_decode_steps``), pick the compiled calls (``forward_calls`` / ``decode_step_calls``) and advance every
request (``advance`` / ``finish_reason``); instead of running the calls it adds up their profiled cost (a
CostModel), times one draw per step from the profile's step-time spread (a seeded stream, consecutive draws correlated
as the profile measured: spread_draws.py). No model runs. Generated
tokens are id 0 and requests never stop early (the trace's max_tokens are generated), as in a replay with no stop
tokens. A speculating candidate (``spec_tokens`` k >= 1) verifies its decode rows instead (``Speculation``,
plan/speculation.py): one verify call per decode-bucket group of rows (B x (k + 1) tokens) beside the step's other
forward_step calls, each row emitting 1 + accepted tokens; a step with no verified row runs as without speculation
(multi-step decode included).

The event loop (``run_trace``) is discrete-event over several replicas: the next event is the next arrival
or the end of a replica's step, whichever is first (arrivals first on a tie, then replicas by index). An
arrival is routed at once; a replica takes its routed requests at the start of its next step, as the server's
engine thread takes its commands before each step. A step's tokens are stamped at the step's end. Everything
is ordered by (time, index): the same inputs give the same output, byte for byte.
"""

from __future__ import annotations

import math

from ..kv.allocator import BlockAllocator
from ..kv.paged import reads_filled_only
from ..serving.request import QueueFullError, Request, RequestError, RequestStatus, SamplingOptions
from ..serving.scheduler import Scheduler
from ..serving.step_plan import (advance, bucket, decode_step_calls, engine_buckets, engine_policy, finish_reason,
                                 forward_calls, plan_decode_steps, pool_blocks, resume_align)
from .cost_model import CostModel
from .metrics import RequestRecord, summarize
from .router import Router
from .speculation import Speculation, check_acceptance
from .spread_draws import SpreadDraws


class ReplicaView:
    """What routers and the event loop read from a replica holding ``scheduler`` and ``allocator``.
    idle_since: when the replica last ran out of work (None while busy; -inf before its first step);
    woke: (when its current busy period began, seconds idle before it)."""

    idle_since: float | None = -math.inf
    woke: tuple = (-math.inf, 0.0)

    def outstanding_tokens(self) -> int:
        """Prompt tokens still to compute + output tokens still to generate, queued, running or routed."""
        reqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        left = sum(r.num_tokens - r.num_computed + r.options.max_new_tokens - len(r.output_ids) for r in reqs)
        return left + sum(len(ids) + opts.max_new_tokens for _, ids, opts, _ in self.inbox)

    def cached_prefix_blocks(self, prompt_ids: list) -> int:
        """Leading full blocks of ``prompt_ids`` this replica's prefix cache holds now."""
        count = 0
        for h in self.allocator.prompt_hashes(prompt_ids):
            if self.allocator.pool.lookup(h) is None:
                break
            count += 1
        return count

    def first_block_key(self, prompt_ids: list):
        """The prefix-cache hash of the prompt's first full block (None for a shorter prompt)."""
        hashes = self.allocator.prompt_hashes(prompt_ids[:self.allocator.block_size])
        return hashes[0] if hashes else None

    def has_work(self) -> bool:
        """True while requests are routed here, queued or running."""
        return bool(self.inbox or self.scheduler.waiting or self.scheduler.running)


SPREAD_SEED = 0   # every replica's stream of step-time draws starts here: a plan is deterministic


class SimReplica(ReplicaView):
    """One simulated engine. cfg: the ModelConfig (max_context); config: EngineConfig; cost: CostModel;
    spec: its Speculation (None: no speculation)."""

    def __init__(self, cfg, config, cost: CostModel, spec: Speculation | None = None):
        self.config, self.cost, self.spec, self.max_context = config, cost, spec, cfg.max_context
        self.allocator = BlockAllocator(pool_blocks(cfg, config), config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(engine_policy(config, cfg.max_context, resume_align(cfg)), self.allocator)
        self.reads_filled = reads_filled_only(cfg)   # as PagedEngine: cost in the slots filled, one table width
        self.buckets = engine_buckets(config, cfg.max_context, 64, self.reads_filled)
        self.inbox: list = []
        self.requests: list = []          # every request added, in order (finished ones included)
        self.finished_order: list = []
        self.peak_blocks = 0
        self.queue_samples: list = []
        # one draw per step (CostModel.spread_factor), correlated as the profile measured (spread_draws.py)
        self.spread_draws = SpreadDraws(cost.spread_correlation, SPREAD_SEED)

    def add(self, rid: str, ids: list, options: SamplingOptions, arrival: float) -> Request:
        """Queue a request (as PagedEngine.add_request). Raises RequestError / QueueFullError."""
        req = Request(rid, list(ids), options, arrival_time=arrival)
        self.scheduler.check_admission(req)
        self.scheduler.add(req)
        self.requests.append(req)
        return req

    def step(self, idle: float = 0.0, warming: float = 0.0) -> tuple[float, list]:
        """One engine step: (seconds it costs, [(request id, tokens generated)]). idle: seconds without work
        just before it (0 inside a busy period); warming: seconds idle before the current busy period when
        that began less than the cost model's cold_window ago, else 0."""
        sched = self.scheduler.schedule()
        draw = self.spread_draws.random()
        self.queue_samples.append(len(self.scheduler.waiting))
        self.peak_blocks = max(self.peak_blocks, self.allocator.num_used)
        c = self.cost
        seconds = c.swap_out * len(sched.swap_out) + c.swap_in * len(sched.swap_in)
        seconds += c.copy * math.ceil(len(sched.copies) / self.scheduler.policy.max_running)
        if self.spec is not None:
            verified = [ch for ch in sched.chunks if self.spec.speculates(ch, self.max_context)]
            if verified:
                seconds, counts = self._verify(sched.chunks, verified, seconds)
                return c.step_seconds(False, seconds, idle, warming, draw), self._advance_all(sched.chunks, counts)
        counts, copies = plan_decode_steps(sched.chunks, self.allocator, self.config.max_decode_steps,
                                           bool(self.scheduler.waiting))
        seconds += c.copy * math.ceil(len(copies) / self.scheduler.policy.max_running)
        if counts:  # a multi-step decode call
            for part, part_counts, B, M in decode_step_calls(sched.chunks, counts, self.buckets, self.allocator):
                reach = (max(ch.start + n for ch, n in zip(part, part_counts)) if self.reads_filled
                         else M * self.allocator.block_size)
                seconds += c.decode_cost(B, reach, max(part_counts))
            return c.step_seconds(True, seconds, idle, warming, draw), self._advance_all(sched.chunks, counts)
        counts = [1] * len(sched.chunks)
        for _, B, T in forward_calls(sched.chunks, self.buckets):
            seconds += c.forward_cost(B, T)
        return c.step_seconds(False, seconds, idle, warming, draw), self._advance_all(sched.chunks, counts)

    def _verify(self, chunks: list, verified: list, seconds: float) -> tuple[float, list]:
        """(the step's seconds, tokens per chunk) for a step whose ``verified`` decode rows run verify calls
        (one per decode-bucket group of rows) and whose other chunks run their forward_step calls. Each verified
        row takes blocks for its k + 1 written slots (a row that cannot get them emits only what its blocks
        hold) and emits 1 + its drawn accepted proposals; the switch-off rule sees each draw."""
        c, spec, alloc = self.cost, self.spec, self.allocator
        ids = {id(ch) for ch in verified}
        for _, B, T in forward_calls([ch for ch in chunks if id(ch) not in ids], self.buckets):
            seconds += c.forward_cost(B, T)
        emit, copies, width = {}, 0, self.buckets.decode[-1]
        for i in range(0, len(verified), width):
            part = verified[i:i + width]
            B = bucket(len(part), self.buckets.decode)
            seconds += c.verify_cost(B, spec.k)
            threshold = spec.min_accept(c, B)
            for ch in part:
                rid = ch.request.request_id
                n = spec.draw(rid)
                spec.record(rid, n - 1, threshold)
                grown = alloc.grow(rid, ch.start, ch.start + spec.k + 1)
                if grown is None:
                    n = max(1, min(n, len(alloc.table(rid)) * alloc.block_size - ch.start))
                else:
                    copies += len(grown)
                emit[id(ch)] = n
        seconds += c.copy * math.ceil(copies / self.scheduler.policy.max_running)
        return seconds, [emit.get(id(ch), 1) for ch in chunks]

    def _advance_all(self, chunks: list, counts: list) -> list:
        emitted = []
        for chunk, count in zip(chunks, counts):
            req, new = chunk.request, 0
            for j in range(count):
                n = chunk.num_tokens if j == 0 else 1
                if not advance(req, chunk.start + j, n, self.allocator):
                    break
                new += 1
                if finish_reason(req, 0) is not None:
                    self.scheduler.remove(req)
                    req.status, req.finish_reason = RequestStatus.FINISHED, "length"
                    self.finished_order.append(req.request_id)
                    break
            if new:
                emitted.append((req.request_id, new))
        return emitted

    def counters(self) -> dict:
        """Preemptions, prefix-cache hits and queries, peak and total KV blocks."""
        out = {"preemptions": self.scheduler.num_preemptions, "prefix_cache_hits": self.allocator.prefix_hits,
               "prefix_cache_queries": self.allocator.prefix_queries, "peak_kv_blocks": self.peak_blocks,
               "kv_blocks": self.allocator.num_blocks}
        return out if self.spec is None else dict(out, **self.spec.counters())


def options_for(req) -> SamplingOptions:
    """The SamplingOptions of a TraceRequest (no stop tokens: every request generates max_tokens)."""
    return SamplingOptions(max_new_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                           top_p=req.top_p, seed=req.seed)


def run_trace(replicas: list, router: Router, requests: list, prompts: list, slo: dict | None = None) -> dict:
    """Run ``requests`` (TraceRequest, in arrival order) with their prompt ids through ``replicas`` (objects
    with add / step / has_work / inbox and the ReplicaView queries), routing with ``router``, on a virtual
    clock. Returns the metrics dict (see metrics.summarize) with "records" (RequestRecord list) attached."""
    records = {f"r{q.index}": RequestRecord(q.index, q.arrival, q.slice) for q in requests}
    busy_until = [None] * len(replicas)
    i, now = 0, 0.0
    while True:
        ends = [(t, k) for k, t in enumerate(busy_until) if t is not None]
        t_end, k_end = min(ends) if ends else (math.inf, -1)
        if i < len(requests) and requests[i].arrival <= t_end:
            now = requests[i].arrival
            while i < len(requests) and requests[i].arrival <= now:
                q = requests[i]
                k = router.choose(replicas, prompts[i])
                records[f"r{q.index}"].replica = k
                replicas[k].inbox.append((f"r{q.index}", prompts[i], options_for(q), q.arrival))
                i += 1
        elif ends:
            now, busy_until[k_end] = t_end, None
        else:
            break
        for k, rep in enumerate(replicas):
            if busy_until[k] is None:
                busy_until[k] = _start_step(rep, now, records)
    counters = _merge_counters(replicas)
    out = summarize(list(records.values()), slo, counters)
    out["records"] = list(records.values())
    return out


def _start_step(rep, now: float, records: dict) -> float | None:
    """Take the replica's routed requests and run one step at ``now``; returns when it ends (None: idle).
    A replica that ran out of work records when (``idle_since``); its next step is told how long it waited."""
    for rid, ids, opts, arrival in rep.inbox:
        try:
            rep.add(rid, ids, opts, arrival)
        except (RequestError, QueueFullError) as err:
            records[rid].rejected = f"{type(err).__name__}: {err}"
    rep.inbox.clear()
    if not (rep.scheduler.waiting or rep.scheduler.running):
        if rep.idle_since is None:
            rep.idle_since = now
        return None
    idle = now - rep.idle_since if rep.idle_since is not None else 0.0
    if rep.idle_since is not None:
        rep.woke, rep.idle_since = (now, idle), None
    window = getattr(getattr(rep, "cost", None), "cold_window", 0.0)
    seconds, emitted = rep.step(idle=idle, warming=rep.woke[1] if now - rep.woke[0] < window else 0.0)
    end = now + seconds
    for rid, n in emitted:
        records[rid].token_times.extend([end] * n)
    return end


def _merge_counters(replicas: list) -> dict:
    total: dict = {}
    for rep in replicas:
        for key, value in rep.counters().items():
            total[key] = total.get(key, 0) + value if key != "peak_kv_blocks" else max(total.get(key, 0), value)
    samples = [s for rep in replicas for s in getattr(rep, "queue_samples", [])]
    total["queue_mean"] = float(sum(samples) / len(samples)) if samples else 0.0
    total["queue_max"] = max(samples, default=0)
    return total


def simulate(cfg, candidate, cost: CostModel, requests: list, prompts: list, slo: dict | None = None,
             num_blocks: int | None = None, spec_acceptance: float | None = None, spec_seed: int = 0) -> dict:
    """Simulate ``candidate`` (replicas, routing, engine settings, speculation) on a trace. Returns run_trace's
    dict. spec_acceptance: the acceptance rate of requests whose trace line gives none (used only when the
    candidate speculates); spec_seed: the seed of the accepted-count draws. Raises ValueError when a
    speculating candidate meets a request with no acceptance rate."""
    candidate = candidate.for_model(cfg)           # a block size of None: serve's default for the model
    config = candidate.engine_config(num_blocks)
    spec = spec_inputs(candidate, requests, spec_acceptance)
    replicas = [SimReplica(cfg, config, cost, None if spec is None else Speculation(candidate.spec_tokens, *spec,
                                                                                    seed=spec_seed))
                for _ in range(candidate.replicas)]
    return run_trace(replicas, Router(candidate.routing), requests, prompts, slo)


def spec_inputs(candidate, requests: list, default: float | None) -> tuple[dict, dict] | None:
    """({request id: acceptance rate}, {request id: trace index}) for a speculating candidate, else None.
    ValueError naming --spec-acceptance and the trace line of the first request without a rate."""
    if not getattr(candidate, "spec_tokens", 0):
        return None
    if default is not None:
        check_acceptance("--spec-acceptance", default)
    rates = {}
    for q in requests:
        rate = q.spec_acceptance if q.spec_acceptance is not None else default
        if rate is None:
            raise ValueError(f"--spec-acceptance: candidate {candidate.name!r} speculates (spec_tokens="
                             f"{candidate.spec_tokens}) but trace line {q.index + 1} has no spec_acceptance: give "
                             "--spec-acceptance A (A in [0, 1]) or spec_acceptance per trace line")
        rates[f"r{q.index}"] = rate
    return rates, {f"r{q.index}": q.index for q in requests}
