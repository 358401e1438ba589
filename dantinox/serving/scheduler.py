"""Scheduler: which requests run in the next step, how many tokens each, and who is preempted (plain Python).

Each step (iteration-level scheduling, no separate prefill and decode phases):
  1. Running requests, decoding ones first, then the ones still prefilling, each in admission order. A
     decoding request gets 1 token; a prefilling one gets a chunk of at most the remaining prefill budget
     (``max_batched_tokens`` per step), shrunk to the blocks free if need be. When a request cannot get even
     one block, the most recently admitted running request is preempted (possibly itself), and so on
     until it fits: ``recompute`` frees its blocks and later re-prefills prompt + generated tokens,
     ``swap`` copies its blocks to host memory first and later copies them back.
  2. Only if nobody was preempted in this step: waiting requests in order (preempted ones first, at the head
     of the queue) are admitted while there are free running slots, budget and blocks. A request with a
     ``prompt_parent`` (choice i > 0 of an n > 1 completion) is held until the parent's prompt is computed,
     so its full prompt blocks come from the prefix cache instead of being computed n times.
  3. With ``lookahead`` k > 0 (speculative decoding), each decode chunk then takes up to k more positions from
     the free blocks, never by preemption (``reserve_lookahead``): admission goes first.
Copy-on-write copies arise only when an admitted request's prompt is wholly cached (step 2), after every
preemption of the step, so a preempted request never has a pending copy.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from ..kv.allocator import BlockAllocator
from .request import CONTEXT_LENGTH_EXCEEDED, QueueFullError, Request, RequestError, RequestStatus

log = logging.getLogger("dantinox.serving")

PREEMPTION_POLICIES = ("recompute", "swap")


@dataclass(frozen=True)
class ContextPolicy:
    """Admission and eviction bounds (token counts are tokens, not bytes).

    max_prompt_tokens: longest prompt accepted.  max_total_tokens: prompt + max_new_tokens bound (at most
    max_context).  max_running: sequences holding blocks at once.  max_queued: waiting requests (beyond it,
    QueueFullError).  max_batched_tokens: prefill tokens per step (chunked prefill budget).
    preemption: "recompute" or "swap".  swap_space_blocks: host blocks for swapped requests (beyond it a
    swap preemption falls back to recompute).
    """

    max_prompt_tokens: int
    max_total_tokens: int
    max_running: int = 16
    max_queued: int = 256
    max_batched_tokens: int = 64
    preemption: str = "recompute"
    swap_space_blocks: int = 1 << 20
    resume_align: int = 1

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_total_tokens", "max_running", "max_queued",
                     "max_batched_tokens", "swap_space_blocks", "resume_align"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ContextPolicy.{name}={value!r} is not allowed: a positive integer")
        if self.preemption not in PREEMPTION_POLICIES:
            raise ValueError(f"ContextPolicy.preemption={self.preemption!r} is not allowed: one of "
                             f"{PREEMPTION_POLICIES}")


@dataclass
class Chunk:
    request: Request
    start: int                  # first position fed (= num_computed)
    num_tokens: int             # tokens fed this step
    copies: list = field(default_factory=list)   # copy-on-write (source, destination) blocks


@dataclass
class Schedule:
    chunks: list = field(default_factory=list)      # Chunk, one per scheduled request
    swap_out: list = field(default_factory=list)    # (request, blocks to read before anything is written)
    swap_in: list = field(default_factory=list)     # (request, new blocks to fill from its host copy)
    preempted: list = field(default_factory=list)

    @property
    def copies(self) -> list:
        return [pair for chunk in self.chunks for pair in chunk.copies]


class Scheduler:
    """Waiting queue + running list over a BlockAllocator, under a ContextPolicy."""

    def __init__(self, policy: ContextPolicy, allocator: BlockAllocator, lookahead: int = 0):
        self.policy = policy
        self.lookahead = lookahead
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.swapped_blocks = 0

    def check_admission(self, req: Request) -> None:
        """Raise RequestError for a request that can never run, QueueFullError when the queue is full."""
        self.check_fits(len(req.prompt_ids), req.options.max_new_tokens)
        if len(self.waiting) >= self.policy.max_queued:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_queued="
                                 f"{self.policy.max_queued}); retry later")

    def check_fits(self, p: int, n: int) -> None:
        """RequestError when a prompt of p tokens plus max_tokens n exceeds the policy's bounds or the whole
        pool; reads fixed sizes only, so any thread may call it."""
        if p > self.policy.max_prompt_tokens:
            raise RequestError("prompt", f"prompt has {p} tokens; the limit is max_prompt_tokens="
                               f"{self.policy.max_prompt_tokens}", CONTEXT_LENGTH_EXCEEDED)
        if p + n > self.policy.max_total_tokens:
            raise RequestError("max_tokens", f"prompt of {p} tokens + max_tokens={n} = {p + n} exceeds the "
                               f"context limit of {self.policy.max_total_tokens} tokens; use max_tokens <= "
                               f"{max(self.policy.max_total_tokens - p, 0)} or a shorter prompt",
                               CONTEXT_LENGTH_EXCEEDED)
        need = self.allocator.blocks_for(p + n)
        if need > self.allocator.num_blocks:
            raise RequestError("max_tokens", f"prompt + max_tokens = {p + n} tokens need {need} KV blocks; "
                               f"the whole cache has {self.allocator.num_blocks}", CONTEXT_LENGTH_EXCEEDED)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues and free its blocks (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.status is RequestStatus.SWAPPED:
            self.swapped_blocks -= self.allocator.blocks_for(req.num_computed)
        req.swap_data = None
        self.allocator.free(req.request_id)

    # One step -------------------------------------------------------------------------------------
    def schedule(self, budget: int | None = None) -> Schedule:
        """The next step: its chunks, preemptions and admissions (module docstring). budget: the prefill tokens
        it may carry (default the policy's max_batched_tokens; the engine's TokenBudget under a TPOT target)."""
        out = Schedule()
        budget = self.policy.max_batched_tokens if budget is None else int(budget)
        decoding = [r for r in self.running if r.remaining == 1]
        prefilling = [r for r in self.running if r.remaining > 1]
        for req in decoding + prefilling:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            want = 1 if req.remaining == 1 else min(req.remaining, budget)
            if want == 0:
                continue
            n, copies = self._fit(req, want, out)
            if n:
                out.chunks.append(Chunk(req, req.num_computed, n, copies))
                budget -= n if want > 1 else 0
        if not out.preempted:
            self._admit(out, budget)
        if self.lookahead:
            self.reserve_lookahead(out)
        return out

    def reserve_lookahead(self, out: Schedule) -> None:
        """Give each decode chunk of ``out`` blocks for up to ``lookahead`` positions past its token (the slots
        a verify call writes), bounded by the tokens its request may still generate and by the free blocks;
        copy-on-write copies join the chunk's. Never preempts."""
        alloc = self.allocator
        for chunk in out.chunks:
            req = chunk.request
            if chunk.num_tokens != 1 or req.remaining != 1:
                continue
            extra = min(self.lookahead, req.options.max_new_tokens - len(req.output_ids) - 1)
            held = len(alloc.table(req.request_id)) * alloc.block_size - chunk.start
            n = min(1 + extra, held + alloc.num_free * alloc.block_size)
            copies = alloc.grow(req.request_id, chunk.start, chunk.start + n) if n > held else []
            chunk.copies += copies or []

    def _fit(self, req: Request, want: int, out: Schedule) -> tuple[int, list]:
        """Reserve blocks for up to ``want`` tokens of ``req`` (fewer if only fewer fit); when not even one
        token fits, preempt the most recently admitted running request and retry. Returns (tokens, copies);
        (0, []) when ``req`` itself was preempted."""
        alloc, start = self.allocator, req.num_computed
        while True:
            held = len(alloc.table(req.request_id)) * alloc.block_size - start
            n = min(want, held + alloc.num_free * alloc.block_size)
            copies = alloc.grow(req.request_id, start, start + n) if n > 0 else None
            if copies is not None:
                return n, copies
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return 0, []

    def _admit(self, out: Schedule, budget: int) -> None:
        alloc = self.allocator
        while self.waiting and len(self.running) < self.policy.max_running:
            req = self.waiting[0]
            if _waits_for_parent(req):
                return
            req.prompt_parent = None
            swapped = req.status is RequestStatus.SWAPPED
            if swapped:
                blocks = alloc.allocate_blocks(req.request_id, alloc.blocks_for(req.num_computed))
                if blocks is None:
                    return
            else:
                req.num_cached_tokens = alloc.match_prefix(req.request_id, req.prompt_ids)
                align = self.policy.resume_align
                req.num_computed = min(req.num_cached_tokens, req.num_tokens - 1) // align * align
                if not req.num_preemptions:   # the figure a client is told (usage.cached_tokens)
                    req.num_prompt_cached = req.num_computed
            n = 1 if req.remaining == 1 else min(req.remaining, budget)
            copies = alloc.grow(req.request_id, req.num_computed, req.num_computed + n) if n else None
            if copies is None:
                alloc.free(req.request_id)
                if not swapped:
                    req.num_computed = 0
                return
            self.waiting.popleft()
            if swapped:
                out.swap_in.append((req, list(blocks)))
                self.swapped_blocks -= len(blocks)
                req.events.append(("swap_in", req.num_computed))
            elif req.num_preemptions:
                req.events.append(("resume", req.num_computed))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(Chunk(req, req.num_computed, n, copies))
            budget -= n if n > 1 else 0

    def _preempt(self, victim: Request, out: Schedule) -> None:
        """Evict ``victim`` (running): unschedule it, free its blocks, put it at the head of the queue."""
        self.running.remove(victim)
        assert not any(c.copies for c in out.chunks if c.request is victim), "preempted with a pending copy"
        out.chunks = [c for c in out.chunks if c.request is not victim]
        self.num_preemptions += 1
        victim.num_preemptions += 1
        computed = self.allocator.blocks_for(victim.num_computed)
        policy = self.policy.preemption
        if policy == "swap" and self.swapped_blocks + computed > self.policy.swap_space_blocks:
            policy = "recompute"
            log.warning("swap space full (%d blocks): preempting %s with recompute", self.swapped_blocks,
                        victim.request_id)
        if policy == "swap" and computed:
            out.swap_out.append((victim, self.allocator.table(victim.request_id)[:computed]))
            victim.status = RequestStatus.SWAPPED
            self.swapped_blocks += computed
        else:
            victim.num_computed = 0
            victim.status = RequestStatus.WAITING
        victim.events.append(("preempt", policy, len(victim.output_ids)))
        log.info("preempted %s (%s): %d tokens computed, %d generated; preemptions so far: %d",
                 victim.request_id, policy, victim.num_computed, len(victim.output_ids), self.num_preemptions)
        self.allocator.free(victim.request_id)
        out.preempted.append(victim)
        self.waiting.appendleft(victim)


def _waits_for_parent(req: Request) -> bool:
    """True while ``req.prompt_parent`` is running and still computing the shared prompt (admitting ``req``
    now would compute the same prompt blocks a second time instead of taking them from the prefix cache)."""
    parent = req.prompt_parent
    return (parent is not None and parent.status is RequestStatus.RUNNING
            and parent.num_computed < len(parent.prompt_ids))
