"""The engine: a narrow interface (add a request, step, abort, stats) and its paged, continuously batched
JAX implementation.

``PagedEngine.step()`` is one iteration of continuous batching:
  1. the Scheduler decides the step's chunks (one decode token per running request plus prefill chunks
     under the token budget), its preemptions and its admissions;
  2. block contents move: swapped-out requests' blocks are read to host memory, swapped-in requests'
     blocks are written back, copy-on-write copies are made;
  3. the chunks run through the model over the paged pool in at most a few compiled calls: decode rows
     ([B, 1]) and prefill rows ([B, T]), with B and T rounded up to fixed buckets so no step recompiles
     after ``warmup()``;
     With ``EngineConfig.speculative``, the decode rows may instead go through one verify call ([B, k + 1]:
     prompt-lookup proposals checked by the target, ``verify_step``, or a draft model's, ``draft_verify``),
     when the switch-off rule says it pays (``speculation``); each row then emits its accepted proposals and
     the target's own token. With a draft model every call also runs the draft over the same tokens into its
     own layers of the pool, under the same block tables (``draft_model``);
  4. each request advances by the tokens it fed; a request whose last token was fed gets the sampled
     token (with its raw log-probabilities if it asked for logprobs), and finishes on a stop token or at
     max_new_tokens.
Every admitted request ends with finish reason "stop", "length", "abort" or "error": never dropped.

Not thread-safe: one thread drives an engine (the server runs it in a background thread).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque

import jax
import numpy as np
from flax import nnx

from ..generation.sampling import SamplingParams
from ..kv.channel_keys import check_spec_group
from ..runs.interrupts import deferred_interrupts
from ..xla import CompileCounter
from .draft_model import TargetWithDraft, pair_block_bytes
from .grammar_rows import grammar_finish, step_mask
from ..kv.manager import CacheManager
from ..kv.paged import reads_filled_only
from ..kv.pool import pool_nbytes
from ..kv.tiers import with_model_digest
from .engine_api import Engine, EngineConfig
from .request import (MAX_LOGIT_BIAS, Request, RequestError, RequestOutput, RequestStatus, SamplingOptions,
                      TokenLogprobs)
from .runner import StepLogprobs, decode_steps, forward_step, static_graph
from .scheduler import Chunk, Schedule, Scheduler
from .engine_speculation import SpeculationCalls, row_logprobs
from .step_plan import (advance, decode_step_calls, engine_buckets, engine_policy, finish_reason, forward_calls,
                        default_block_size, plan_decode_steps, pool_size, resume_align)
from .token_budget import TokenBudget
from .verify_cost import VerifyCostMeter
from .warmup import WarmupItem

log = logging.getLogger("dantinox.serving")

MIN_TABLE_TOKENS = 64  # the narrowest block-table width of a multi-step decode call, in tokens


class PagedEngine(SpeculationCalls, Engine):
    """Continuous batching over a paged KV cache for a dantinox Transformer (MHA / GQA / MQA, or MLA with a
    latent pool).

    Args: model: a Transformer; config: EngineConfig; draft: the draft Transformer of a SpecConfig with
    proposer "draft" (same vocabulary, autoregressive, max_context at least the model's; its pool is float and
    shares the target's block tables: ``draft_model``), else None. Raises ValueError for invalid sizes (field
    named), for a paradigm="diffusion" model, and for a draft given without proposer "draft" or missing with it.
    """

    def __init__(self, model, config: EngineConfig = EngineConfig(), draft=None):  # noqa: B008 (frozen)
        cfg = model.cfg
        if cfg.paradigm != "ar":
            raise ValueError(f"the serving engine decodes autoregressive models; this model has paradigm="
                             f"{cfg.paradigm!r} (masked diffusion is served by dantinox generate, not serve)")
        if config.speculative is not None:   # per-channel keys: k + 1 tokens must fit one key group
            check_spec_group(cfg, config.speculative.spec_tokens)
        drafting = config.speculative is not None and config.speculative.proposer == "draft"
        if drafting != (draft is not None):
            raise ValueError("draft: a draft model goes with speculative=SpecConfig(proposer='draft'), and that "
                             "proposer needs one (dantinox serve --speculative draft:RUN)")
        if config.block_size is None:
            config = dataclasses.replace(config, block_size=default_block_size(cfg))
        self.cfg, self.config = cfg, config
        self.vocab_size, self.max_context = cfg.vocab_size, cfg.max_context
        if draft is not None:   # one module and one pool for both models (draft_model)
            model = TargetWithDraft(model, draft)
        self.draft_cfg = model.draft.cfg if draft is not None else None
        graphdef, self.params = nnx.split(model)
        self.graph = static_graph(graphdef)
        P = config.block_size
        self.pool_size = pool_size(cfg, config, self._budget_block_bytes(cfg), self._budget_sink_bytes(cfg),
                                   self._budget_residual_bytes(cfg))
        # the pool, the allocator with its prefix cache, sink and residual slots, swap and copy-on-write
        self.cache = CacheManager(cfg, self.pool_size.blocks, P, self.pool_size.sink_slots,
                                  self.pool_size.residual_slots, config.enable_prefix_caching, config.max_running,
                                  self.draft_cfg, self._place_pool, with_model_digest(config.kv_tiers, self.params))
        self.policy = engine_policy(config, cfg.max_context, resume_align(cfg))
        self.speculative = config.speculative
        self.verify_meter = VerifyCostMeter()  # c(B) from timed calls when SpecConfig.verify_costs is empty
        self.token_budget = TokenBudget(config.tpot_slo, config.max_batched_tokens, config.min_prefill_chunk)
        self.scheduler = Scheduler(self.policy, self.allocator,
                                   self.speculative.spec_tokens if self.speculative else 0)
        self.table_width = self.cache.table_width  # M
        # Block-table widths of the multi-step decode call: it gathers only the blocks the batch's longest
        # row reaches, rounded up to a power of two of at least 64 tokens (the gather is most of a decode
        # step's attention cost on the CPU).
        self.reads_filled = self._tables_read_filled()   # attention reads only the filled blocks
        self.buckets = engine_buckets(config, cfg.max_context, MIN_TABLE_TOKENS, self.reads_filled)
        self.table_buckets, self.decode_buckets = self.buckets.table, self.buckets.decode
        self.prefill_buckets, self.chunk_buckets = self.buckets.prefill, self.buckets.chunk
        widest = min(config.max_batched_tokens, cfg.max_context)
        if self.chunk_buckets[-1] < widest:
            raise ValueError(f"chunk_buckets={self.chunk_buckets} is not allowed: the largest must be >= "
                             f"min(max_batched_tokens, max_context) = {widest}")
        self.requests: dict[str, Request] = {}
        self.finished: deque[Request] = deque(maxlen=1024)  # most recent finished requests, for inspection
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        if not isinstance(config.max_decode_steps, int) or not 1 <= config.max_decode_steps <= 64:
            raise ValueError(f"max_decode_steps={config.max_decode_steps!r} is not allowed: an integer in [1, 64]")
        # The device work of the last step, for the capacity planner's calibration: ("forward", B, T),
        # ("decode", B, S attended slots, n iterations), ("swap_out",), ("swap_in",), ("copy",) per call.
        self.step_calls: list[tuple] = []
        self.counters = dict(steps=0, forward_calls=0, multi_step_calls=0, computed_tokens=0, generated_tokens=0,
                             finished=0, aborted=0, errors=0, spec_verify_calls=0, spec_proposed_tokens=0,
                             spec_accepted_tokens=0)

    # Interface ------------------------------------------------------------------------------------
    def check_request(self, prompt_ids, options: SamplingOptions) -> None:
        _check_prompt(prompt_ids, self.vocab_size)
        options.validate(self.vocab_size)
        self.scheduler.check_fits(len(prompt_ids), options.max_new_tokens)

    def add_request(self, prompt_ids, options: SamplingOptions = SamplingOptions(),  # noqa: B008 (frozen)
                    request_id: str | None = None, share_prompt_with: str | None = None) -> str:
        ids = _check_prompt(prompt_ids, self.vocab_size)
        options.validate(self.vocab_size)
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError("request_id", f"request_id={rid!r} is already in use")
        req = Request(rid, ids, options)
        parent = self.requests.get(share_prompt_with) if share_prompt_with is not None else None
        if parent is not None and parent.prompt_ids == ids and self.allocator.enable_prefix_caching:
            req.prompt_parent = parent
        self.scheduler.check_admission(req)
        self.scheduler.add(req)
        self.requests[rid] = req
        return rid

    def step(self) -> list[RequestOutput]:
        self.step_calls = []
        decoding = sum(r.remaining == 1 for r in self.scheduler.running)
        sched = self.scheduler.schedule(self.token_budget.budget(decoding))
        for req in sched.preempted:  # its matcher is rebuilt from its tokens when it samples again
            req.matcher = None
        outputs, self._pending = self._pending, []
        started = time.perf_counter()
        try:
            self._move_blocks(sched)
            sampled = self._run(sched.chunks)
        except Exception as err:  # a device failure: the pool may be gone; fail what it held, keep serving
            log.exception("engine step failed")
            return outputs + self._fail_running(f"engine step failed: {err!r}")
        self._book_step(sched.chunks, sampled, time.perf_counter() - started)
        for chunk, (tokens, logprobs, verified) in zip(sched.chunks, sampled):
            before = len(chunk.request.output_ids)
            outs = self._advance(chunk, tokens[0], logprobs[0] if logprobs else None)
            for j, token in enumerate(tokens[1:], 1):  # further tokens of a multi-step decode or verify call
                lp = logprobs[j] if logprobs else None
                outs += self._advance(Chunk(chunk.request, chunk.start + j, 1), token, lp)
            if verified is not None:
                self._record_verify(chunk.request, verified, len(chunk.request.output_ids) - before, outs)
            outputs.extend(outs)
        self.counters["steps"] += 1
        return outputs

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        if reason not in ("abort", "stop"):
            raise ValueError(f"reason={reason!r} is not allowed: 'abort' or 'stop'")
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, reason)
        self._pending.append(self._output(req, []))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._pending)

    def stats(self) -> dict:
        sched, alloc = self.scheduler, self.allocator
        swapped = sum(r.status is RequestStatus.SWAPPED for r in sched.waiting)
        return dict(waiting=len(sched.waiting) - swapped, swapped=swapped, running=len(sched.running),
                    blocks_total=alloc.num_blocks, blocks_used=alloc.num_used, blocks_free=alloc.num_free,
                    block_size=alloc.block_size, kv_cache_bytes=pool_nbytes(self.pool),
                    preemptions=sched.num_preemptions, prefix_cache_queries=alloc.prefix_queries,
                    prefix_cache_hits=alloc.prefix_hits, cow_copies=alloc.cow_copies, **self.counters,
                    kv_tiers=self.cache.tier_stats(),
                    **({"spec_proposer": self.speculative.proposer} if self.speculative else {}))

    def _budget_block_bytes(self, cfg) -> int | None:
        """Bytes one block takes out of kv_memory_bytes (None: the whole block, on one device); with a draft
        model its float rows of the block count too (``draft_model.pair_block_bytes``)."""
        if self.draft_cfg is None:
            return None
        return pair_block_bytes(cfg, self.draft_cfg, self.config.block_size)

    def _budget_sink_bytes(self, cfg) -> int | None:
        """Bytes one int8 sink slot takes out of kv_memory_bytes (None: the whole slot, on one device)."""
        return None

    def _budget_residual_bytes(self, cfg) -> int | None:
        """Bytes one residual slot of per-channel keys takes out of kv_memory_bytes (None: the whole slot)."""
        return None

    def _book_step(self, chunks: list[Chunk], sampled: list, seconds: float) -> None:
        """Tell the token budget what the step cost: its prefill tokens, decode rows and decode iterations."""
        prefill = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        rows = sum(c.num_tokens == 1 for c in chunks)
        iterations = max((len(tokens) for tokens, _, _ in sampled), default=1)
        self.token_budget.observe(prefill, rows, seconds, 1 if prefill else iterations)

    def _tables_read_filled(self) -> bool:
        """Whether the pool's attention reads only the filled blocks whatever the table's width (``dantinox.kv.
        paged.reads_filled_only``), so multi-step decode needs one table width; the sharded engine says False."""
        return reads_filled_only(self.cfg) and (self.draft_cfg is None or reads_filled_only(self.draft_cfg))

    def _place_pool(self, pool):
        """Where a freshly allocated pool goes: committed to the default device, as every compiled call returns
        it, so the block moves compiled at warm-up on this pool are the ones the steps call (K14: uncommitted,
        their programs missed jit's cache after the first stored forward call). The sharded engine places it on
        its mesh."""
        return jax.device_put(pool, jax.devices()[0])

    # The cache manager's parts, as the planner and the tests read them --------------------------------------
    @property
    def pool(self):
        """The paged pool (``CacheManager.pool``)."""
        return self.cache.pool

    @pool.setter
    def pool(self, pool) -> None:
        self.cache.pool = pool

    @property
    def allocator(self):
        """The block allocator with its prefix cache (``CacheManager.allocator``)."""
        return self.cache.allocator

    @property
    def sinks(self):
        """The int8 pool's sink slots, or None (``CacheManager.sinks``)."""
        return self.cache.sinks

    @property
    def residuals(self):
        """The per-channel key pool's residual slots, or None (``CacheManager.residuals``)."""
        return self.cache.residuals

    # Warm-up --------------------------------------------------------------------------------------
    def warmup(self) -> CompileCounter:
        """Compile every bucket (decode, prefill x chunk, multi-step decode x table width) and the block moves
        with empty batches (nothing is written), in the order of ``warmup_items``. Returns the CompileCounter
        of the warm-up; later steps compile nothing. (``dantinox serve`` runs the same items in the background
        instead: ``dantinox.serving.warmup``.)

        Ctrl-C (``dantinox.runs.interrupts``): the compilation under way finishes and KeyboardInterrupt is
        raised here, between two compilations (raised by Python wherever the signal lands, it can fall inside
        a callback of JAX's compile path and be lost, and the server would then start anyway)."""
        with CompileCounter() as counted, deferred_interrupts() as interrupt:
            for item in self.warmup_items():
                if interrupt.requested:
                    raise KeyboardInterrupt
                item.run()
            if interrupt.requested:
                raise KeyboardInterrupt
        return counted

    def warmup_items(self) -> list[WarmupItem]:
        """Every program a step can run, as WarmupItems, most likely first: ordered by the sum of the batch
        bucket's rank and the size bucket's rank, so one request's programs (B = 1) come first and the largest
        batches over the widest tables last. Size ranks: prefill chunks largest first (a chat prompt, and every
        chunk of a prompt longer than max_batched_tokens, runs in the largest), multi-step decode tables
        narrowest first; the one-token forward (decode beside a prefill, logprobs, structured outputs) and the
        block moves (copy-on-write, swap) at rank 1."""
        last = len(self.chunk_buckets) - 1
        ranked = [((i + last - j, i), f"forward B={B} T={T}", lambda B=B, T=T: self._warm_forward(B, T))
                  for i, B in enumerate(self.prefill_buckets) for j, T in enumerate(self.chunk_buckets)]
        if self.config.max_decode_steps > 1:
            ranked += [((i + j, i), f"decode_steps B={B} M={M}", lambda B=B, M=M: self._warm_decode_steps(B, M))
                       for i, B in enumerate(self.decode_buckets) for j, M in enumerate(self.table_buckets)]
        ranked += [((i + 1, i), f"forward B={B} T=1", lambda B=B: self._warm_forward(B, 1))
                   for i, B in enumerate(self.decode_buckets)]
        if self.speculative:
            ranked += [((i + j, i), f"verify B={B} M={M}", lambda B=B, M=M: self._warm_verify(B, M))
                       for i, B in enumerate(self.decode_buckets) for j, M in enumerate(self.table_buckets)]
        ranked.append(((1, 1), "block moves", self._warm_block_moves))
        ranked.sort(key=lambda item: item[0])  # stable: within a rank, the order above
        return [WarmupItem(label, run) for _, label, run in ranked]

    def _warm_forward(self, B: int, T: int) -> None:
        """Make forward_step's program for bucket (B, T) ready without running it (``StoredFunction.prepare``:
        loaded as the bucket's first step will call it, so that step compiles nothing)."""
        forward_step.prepare(*self._forward_args([], B, T))

    def _warm_block_moves(self) -> None:
        """Compile the block and sink moves (copy-on-write, swap out and in) without running them."""
        self.cache.warm_block_moves()

    # Internals ------------------------------------------------------------------------------------
    def _move_blocks(self, sched: Schedule) -> None:
        """The step's block work, done by the cache manager (swap, slots, copy-on-write)."""
        self.cache.apply(sched, self.scheduler.running)
        self.step_calls += ([("swap_out",)] * len(sched.swap_out) + [("swap_in",)] * len(sched.swap_in)
                            + [("copy",)] * -(-len(sched.copies) // self.policy.max_running))

    def _copy_blocks(self, pairs: list) -> None:
        """Perform copy-on-write block copies [(source, destination)] (``CacheManager.copy_blocks``)."""
        self.step_calls += [("copy",)] * self.cache.copy_blocks(pairs)

    def _read_host(self, blocks: list) -> tuple:
        return self.cache.read_host(blocks)

    def _write_host(self, blocks: list, data: tuple) -> None:
        self.cache.write_host(blocks, data)

    def _run(self, chunks: list[Chunk]) -> list[tuple[list[int], list | None, tuple | None]]:
        """Run the chunks in bucketed calls; returns per chunk (its sampled tokens: one, or several from a
        multi-step decode or verify call; if its request asked for logprobs, one TokenLogprobs per token, else
        None (meaningful for chunks that reach their request's last token); for a verified chunk (limit,
        proposed), else None)."""
        limits = self._plan_speculation(chunks)
        if limits is None:
            counts = self._plan_decode_steps(chunks)
            if counts:
                return [(tokens, None, None) for tokens in self._run_decode_steps(chunks, counts)]
            limits = {}
        sampled: dict[int, tuple] = {}
        verified = [c for c in chunks if id(c) in limits]
        started = time.perf_counter()
        # every call is dispatched before any result is fetched, so host work overlaps the device's
        plan = self._verify_calls(verified, limits)
        checks = [(part, self._call_verify(part, [limits[id(c)] for c in part], B, M)) for part, B, M in plan]
        rest = [c for c in chunks if id(c) not in limits]
        shapes = forward_calls(rest, self.buckets)
        calls = [(part, self._call_forward(part, B, T)) for part, B, T in shapes]
        for part, (out, logprobs) in calls:
            tokens = np.asarray(out)
            logprobs = None if logprobs is None else jax.device_get(logprobs)
            for b, chunk in enumerate(part):
                lp = row_logprobs(chunk, int(tokens[b]), logprobs, b)
                sampled[id(chunk)] = ([int(tokens[b])], None if lp is None else [lp], None)
        for part, out in checks:
            sampled.update(self._verified_rows(part, limits, out))
        self._time_call(plan, shapes, chunks, time.perf_counter() - started)
        return [sampled[id(c)] for c in chunks]

    def _plan_decode_steps(self, chunks: list[Chunk]) -> list[int] | None:
        """Decode steps per chunk for a multi-step call, or None for an ordinary step.

        Only a step of decode chunks alone (no prefill, no logprobs asked, no constrained request) qualifies.
        Row b runs up to min(max_decode_steps, tokens it may still generate); while requests wait, every row
        runs the fewest any row may still generate. Blocks for the extra positions are taken now (copy-on-write copies
        done); a row that cannot get them runs only as far as the blocks it holds.
        """
        counts, copies = plan_decode_steps(chunks, self.allocator, self.config.max_decode_steps,
                                           bool(self.scheduler.waiting))
        self._copy_blocks(copies)
        return counts

    def _run_decode_steps(self, chunks: list[Chunk], counts: list[int]) -> list[list[int]]:
        """Run the multi-step decode call(s); returns each chunk's counts[i] sampled tokens."""
        out = []
        for part, part_counts, B, M in decode_step_calls(chunks, counts, self.buckets, self.allocator):
            started = time.perf_counter()
            tokens = self._call_decode_steps(part, part_counts, B, M)
            if self.speculative:   # a plain decode step's time, for the verify-cost meter
                self.verify_meter.plain(B, M, time.perf_counter() - started, max(part_counts))
            out += [tokens[b, :n].tolist() for b, n in enumerate(part_counts)]
        return out

    def _warm_decode_steps(self, B: int, M: int) -> None:
        """Compile the multi-step decode loop for bucket (B, M) without running it (as ``_warm_forward``)."""
        z = np.zeros(B, np.int32)
        sampling = SamplingParams(np.zeros(B, np.float32), z, np.ones(B, np.float32))
        decode_steps.prepare(self.graph, self.params, self.pool, z, z, z, self.cache.tables([], B, M),
                             np.zeros(B, np.uint32), z, sampling, max_steps=self.config.max_decode_steps)

    def _call_decode_steps(self, part: list[Chunk], counts: list[int], B: int, M: int) -> np.ndarray:
        """One decode_steps call for ``part`` padded to B rows, over block tables cut to M entries."""
        tokens, num_steps = np.zeros(B, np.int32), np.zeros(B, np.int32)
        for b, (chunk, count) in enumerate(zip(part, counts)):
            tokens[b], num_steps[b] = chunk.request.all_tokens[chunk.start], count
        start, tables, seeds, steps, sampling = self._row_inputs(part, B, M)
        out, self.pool = decode_steps(self.graph, self.params, self.pool, tokens, start, num_steps, tables, seeds,
                                      steps, sampling, max_steps=self.config.max_decode_steps)
        self.counters["forward_calls"] += bool(part)
        self.counters["multi_step_calls"] += bool(part)
        reach = int((start + num_steps).max()) if self.reads_filled else M * self.allocator.block_size
        self.step_calls.append(("decode", B, reach, int(num_steps.max())))   # slots attended at most
        return jax.device_get(out)

    def _row_inputs(self, part: list[Chunk], B: int, M: int) -> tuple:
        """Per-row inputs of a compiled call for ``part`` padded to B rows: (start [B] int32, the rows'
        BlockTables cut to M entries (``CacheManager.tables``), seeds [B] uint32, steps [B] int32 tokens generated
        so far, the rows' SamplingParams); padding rows are zeros (greedy)."""
        start, steps, top_k = (np.zeros(B, np.int32) for _ in range(3))
        seeds = np.zeros(B, np.uint32)
        temperature, top_p = np.zeros(B, np.float32), np.ones(B, np.float32)
        for b, chunk in enumerate(part):
            req, opts = chunk.request, chunk.request.options
            start[b], steps[b] = chunk.start, len(req.output_ids)
            seeds[b], temperature[b], top_p[b] = opts.seed, opts.temperature, opts.top_p
            top_k[b] = min(opts.top_k, self.vocab_size)
        tables = self.cache.tables([c.request.request_id for c in part], B, M)
        return start, tables, seeds, steps, SamplingParams(temperature, top_k, top_p)

    def _forward_args(self, part: list[Chunk], B: int, T: int) -> tuple:
        """forward_step's arguments for ``part`` padded to B rows of T tokens (the engine's pool included)."""
        ids, num_new = np.zeros((B, T), np.int32), np.zeros(B, np.int32)
        for b, chunk in enumerate(part):
            ids[b, :chunk.num_tokens] = chunk.request.all_tokens[chunk.start:chunk.start + chunk.num_tokens]
            num_new[b] = chunk.num_tokens
        start, tables, seeds, steps, sampling = self._row_inputs(part, B, self.table_width)
        with_logprobs = np.bool_(any(c.request.options.logprobs is not None for c in part))
        token_mask = step_mask(part, B, self.vocab_size)  # structured outputs (grammar_rows)
        bias_ids = np.full((B, MAX_LOGIT_BIAS), self.vocab_size, np.int32)   # V: no bias (dropped)
        bias_values = np.zeros((B, MAX_LOGIT_BIAS), np.float32)
        for b, chunk in enumerate(part):
            for j, (token, bias) in enumerate(chunk.request.options.logit_bias):
                bias_ids[b, j], bias_values[b, j] = token, bias
        return (self.graph, self.params, self.pool, ids, start, num_new, tables, seeds, steps, sampling,
                with_logprobs, token_mask, bias_ids, bias_values)

    def _call_forward(self, part: list[Chunk], B: int, T: int) -> tuple[jax.Array, StepLogprobs | None]:
        """Dispatch one forward_step for ``part`` padded to B rows of T tokens; returns the device arrays
        (tokens [B], and the StepLogprobs when a row asked for them, else None) without waiting for them."""
        args = self._forward_args(part, B, T)
        out, logprobs, self.pool = forward_step(*args)
        self.counters["forward_calls"] += bool(part)
        self.step_calls.append(("forward", B, T))
        return out, (logprobs if args[10] else None)  # nobody asked: three transfers of zeros skipped

    def _advance(self, chunk: Chunk, token: int, logprobs: TokenLogprobs | None = None) -> list[RequestOutput]:
        req = chunk.request
        if req.finished:  # aborted while its step ran
            return []
        self.counters["computed_tokens"] += chunk.num_tokens
        if not advance(req, chunk.start, chunk.num_tokens, self.allocator):
            return []  # a prefill chunk that has not reached the last token yet
        now = time.perf_counter()
        reason, error = finish_reason(req, token), None
        if reason is None:
            reason, error = grammar_finish(req, token)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        self.counters["generated_tokens"] += 1
        if reason is not None:
            self._finish(req, reason, error)
        return [self._output(req, [token], None if logprobs is None else [logprobs])]

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.remove(req)
        self.cache.release(req.request_id)
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        del self.requests[req.request_id]
        self.finished.append(req)
        self.counters[{"abort": "aborted", "error": "errors"}.get(reason, "finished")] += 1

    def _output(self, req: Request, new_tokens: list, logprobs: list | None = None) -> RequestOutput:
        spec = None if req.spec is None else (req.spec.proposed, req.spec.accepted)
        return RequestOutput(req.request_id, new_tokens, req.finished, req.finish_reason, req.error,
                             len(req.prompt_ids), len(req.output_ids), logprobs, spec, req.num_prompt_cached)

    def _fail_running(self, message: str) -> list[RequestOutput]:
        """After a failed device step: end every request whose keys and values may be lost (running, or
        swapped out without a host copy) with an error, and rebuild the pool."""
        lost = [r for r in self.scheduler.waiting
                if r.status is RequestStatus.SWAPPED and r.swap_data is None]
        failed = list(self.scheduler.running) + lost
        for req in failed:
            self._finish(req, "error", message)
        self.cache.reset()   # a fresh pool, no cached prefixes (they pointed into the old one)
        return [self._output(req, []) for req in failed]


def _check_prompt(prompt_ids, vocab_size: int) -> list:
    """Token ids as a list of ints; RequestError("prompt", ...) for an empty, non-integer or out-of-range
    prompt."""
    if isinstance(prompt_ids, (str, bytes)):
        raise RequestError("prompt", "prompt_ids must be token ids, not text: encode the text first")
    ids = list(prompt_ids)
    if not ids:
        raise RequestError("prompt", "prompt is empty: give at least one token")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab_size:
            raise RequestError("prompt", f"prompt token {i} = {token!r} is not allowed: an integer id in "
                               f"[0, {vocab_size})")
    return [int(t) for t in ids]
