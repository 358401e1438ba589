"""The host-side arithmetic of one engine step, shared by ``PagedEngine`` and the capacity planner's simulator.

Plain Python, no device. After the Scheduler has chosen a step's chunks, the engine decides which compiled
calls run them (batch bucket B, chunk bucket T, or for a multi-step decode call the block-table width M and
the steps per row) and, once the calls return, advances each request. ``dantinox.plan.simulate`` runs the same
functions with a virtual clock, so a simulated step makes the same calls and the same bookkeeping as a real
one; only the time a call takes comes from a profile instead of the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kv.allocator import BlockAllocator
from ..kv.sizes import residual_slot_bytes
from ..kv.sizes import blocks_for_memory, sink_slot_bytes
from .request import Request
from .scheduler import ContextPolicy
from ..kv.sink_slots import slots_for


def powers_of_two(first: int, last: int) -> tuple:
    """(first, 2 first, 4 first, ..., last): bucket sizes, the last one clipped to ``last``."""
    out = [first]
    while out[-1] < last:
        out.append(min(out[-1] * 2, last))
    return tuple(out)


def bucket(n: int, buckets: tuple) -> int:
    """The smallest bucket >= n (StopIteration if none: callers size buckets to cover every n)."""
    return next(b for b in buckets if b >= n)


@dataclass(frozen=True)
class Buckets:
    """Static shapes of the compiled calls. decode: batch sizes B of decode calls; prefill: batch sizes of
    prefill calls; chunk: chunk lengths T of prefill calls (tokens); table: block-table widths M of multi-step
    decode calls (blocks)."""

    decode: tuple
    prefill: tuple
    chunk: tuple
    table: tuple


def batch_buckets(sizes, max_running: int) -> tuple:
    """``sizes`` (batch buckets) sorted, without those above the first one that holds max_running rows: a step
    has at most max_running decode or prefill rows (one per running request), so a larger bucket would never
    run, and each compiled program of the unrolled model keeps tens of MiB resident (docs/explanation/performance.md,
    "Host memory"). (1, 2, 4) -> (1,) for max_running 1, (1, 2, 4) for 3; all of them if none holds
    max_running (the calls are then split at the largest)."""
    ordered = tuple(sorted(sizes))
    holding = [i for i, b in enumerate(ordered) if b >= max_running]
    return ordered[:holding[0] + 1] if holding else ordered


def chunk_ladder(max_tokens: int) -> tuple:
    """Default prefill chunk lengths up to ``max_tokens``: powers of two from 8 to 512, then x4 steps (2,048,
    8,192, ...), the last one clipped to max_tokens: (8, 16, 32, 64) for 64, (8, 16, ..., 256, 512) for 512.
    A chunk pads to the next length, so a prompt pays at most twice its tokens up to 512 (a 128-token prompt
    alone: 0.47 s to its first token when it padded to 256, 0.23 s at 128, on SmolLM2 on a 2-core Zen 4,
    benchmarks/results/2026-12-07-serve-vs-llamacpp.md) while a long prompt's chunks run at the largest;
    every length is one compiled program per prefill batch size, hence the sparser steps above 512."""
    first = min(8, max_tokens)
    out = list(powers_of_two(first, min(512, max_tokens)))
    while out[-1] < max_tokens:
        out.append(min(out[-1] * 4, max_tokens))
    return tuple(out)


def engine_buckets(config, max_context: int, min_table_tokens: int = 64, full_tables: bool = False) -> Buckets:
    """The buckets an EngineConfig gives for a model of ``max_context`` tokens (see EngineConfig);
    min_table_tokens: the narrowest multi-step block-table width, in tokens; full_tables: the pool's attention
    reads only the filled blocks whatever the table's width (the compiled paged kernel), so multi-step decode
    needs one width, the whole table (fewer programs), instead of widths that cut what is read. Batch buckets
    above what max_running rows need are dropped (``batch_buckets``)."""
    P = config.block_size
    width = -(-max_context // P)
    table = (width,) if full_tables else powers_of_two(min(width, max(1, min_table_tokens // P)), width)
    decode = batch_buckets(config.decode_buckets or powers_of_two(1, config.max_running), config.max_running)
    chunk = tuple(sorted(config.chunk_buckets or chunk_ladder(min(config.max_batched_tokens, max_context))))
    return Buckets(decode, batch_buckets(config.prefill_buckets, config.max_running), chunk, table)


DEFAULT_BLOCK_SIZE = 16   # tokens per KV block when none is given and the keys are not per channel


def default_block_size(cfg) -> int:
    """The block size P when none is given (EngineConfig.block_size None, serve without --block-size, the
    planner's default candidates): DEFAULT_BLOCK_SIZE, or with per-channel int8 keys (``cfg.channel_keys``,
    the int8 default on MHA / GQA / MQA) the key group G = cfg.key_group, which a block size must be a multiple
    of (``paged_channel_keys.check_channel_block_size``), raised to the first multiple of G that holds the
    cfg.sink_slots sink tokens (a sequence's sinks lie in its first block)."""
    if not cfg.channel_keys:
        return DEFAULT_BLOCK_SIZE
    G = cfg.key_group
    return G * max(1, -(-cfg.sink_slots // G))


def resume_align(cfg) -> int:
    """Where a prefix-cache hit may resume for model config ``cfg``: the key group G with per-channel int8 keys
    (``cfg.channel_keys``; a filling group's float32 keys are never in a cached block), else 1."""
    return cfg.key_group if cfg.channel_keys else 1


def engine_policy(config, max_context: int, resume_align: int = 1) -> ContextPolicy:
    """The ContextPolicy of an EngineConfig for a model of ``max_context`` tokens (prompts of at most
    max_context - 1 tokens, prompt + output of at most max_context); resume_align: see ContextPolicy (the key
    group G with per-channel keys). Raises ValueError naming a bad field."""
    return ContextPolicy(
        max_prompt_tokens=min(config.max_prompt_tokens or max_context - 1, max_context - 1),
        max_total_tokens=min(config.max_total_tokens or max_context, max_context),
        max_running=config.max_running, max_queued=config.max_queued,
        max_batched_tokens=config.max_batched_tokens, preemption=config.preemption,
        swap_space_blocks=config.swap_space_blocks or 1 << 20, resume_align=resume_align)


@dataclass(frozen=True)
class PoolSize:
    """How the KV pool was sized (blocks of ``block_size`` tokens).

    blocks: N, the blocks allocated; usable: max_running x blocks per sequence at max_context, the most that
    the running sequences can ever hold at once; budget: the blocks ``kv_memory_bytes`` would hold (None
    without a byte budget); capped: True when the pool holds ``usable`` blocks although the budget holds more
    (``kv_memory_all`` off); per_sequence: blocks of one max_context sequence; sink_slots: R, the int8 pool's
    per-sequence sink slots (``sink_slots.slots_for(max_running)``; their bytes come out of kv_memory_bytes
    before the blocks; 1, unused, for a float pool); residual_slots: Q, the per-channel key pool's residual
    slots (max_running, their bytes also paid before the blocks; 1, unused, for other pools)."""

    blocks: int
    usable: int
    budget: int | None
    capped: bool
    per_sequence: int
    sink_slots: int = 1
    residual_slots: int = 1


def pool_size(cfg, config, block_bytes: int | None = None, sink_bytes: int | None = None,
              residual_bytes: int | None = None) -> PoolSize:
    """The pool of an EngineConfig for model config ``cfg``: config.num_blocks when given; else with
    config.kv_memory_bytes, as many blocks as fit beside the int8 sink slots (and the per-channel keys'
    residual slots), but no more than max_running sequences of max_context tokens can use (all that fit with
    config.kv_memory_all); else exactly that usable count.

    block_bytes / sink_bytes / residual_bytes: bytes one block / one sink slot / one residual slot takes out of
    kv_memory_bytes (default the whole block, ``paged_cache.block_bytes``, slot, ``paged_cache.sink_set_bytes``,
    and residual, ``paged_cache.residual_set_bytes``; the sharded engine passes one device's share). Raises
    ValueError if not even one block fits in kv_memory_bytes. A config.block_size of None is
    ``default_block_size(cfg)``."""
    if config.block_size is None:
        config = dataclasses.replace(config, block_size=default_block_size(cfg))
    per_sequence = -(-cfg.max_context // config.block_size)
    usable = config.max_running * per_sequence
    slot_bytes = sink_slot_bytes(cfg) if sink_bytes is None else int(sink_bytes)
    slots = slots_for(config.max_running) if slot_bytes else 1
    resid_bytes = residual_slot_bytes(cfg) if residual_bytes is None else int(residual_bytes)
    residuals = config.max_running if resid_bytes else 1
    sized = dict(per_sequence=per_sequence, sink_slots=slots, residual_slots=residuals)
    if config.num_blocks is not None:
        return PoolSize(config.num_blocks, usable, None, False, **sized)
    if config.kv_memory_bytes is None:
        return PoolSize(usable, usable, None, False, **sized)
    fixed = (slots * slot_bytes if slot_bytes else 0) + (residuals * resid_bytes if resid_bytes else 0)
    if block_bytes is None:
        budget = blocks_for_memory(cfg, config.kv_memory_bytes, config.block_size, slots if slot_bytes else 0,
                                       residuals if resid_bytes else 0)
    else:
        budget = (int(config.kv_memory_bytes) - fixed) // int(block_bytes)
        if budget < 1:
            raise ValueError(f"kv memory {int(config.kv_memory_bytes)} bytes holds no block: one block of "
                             f"{config.block_size} tokens takes {int(block_bytes)} bytes per device for this model")
    if config.kv_memory_all or budget <= usable:
        return PoolSize(budget, usable, budget, False, **sized)
    return PoolSize(usable, usable, budget, True, **sized)


def pool_blocks(cfg, config) -> int:
    """N, the blocks of the KV pool (:func:`pool_size`). Raises ValueError if not even one block fits."""
    return pool_size(cfg, config).blocks


def forward_calls(chunks: list, buckets: Buckets) -> list[tuple[list, int, int]]:
    """The forward_step calls of an ordinary step: [(chunks of the call, B, T)], decode calls ([B, 1]) first,
    then prefill calls ([B, T]), each at most the largest batch bucket."""
    calls = []
    decode = [c for c in chunks if c.num_tokens == 1]
    prefill = [c for c in chunks if c.num_tokens > 1]
    for group, sizes in ((decode, buckets.decode), (prefill, buckets.prefill)):
        for i in range(0, len(group), sizes[-1]):
            part = group[i:i + sizes[-1]]
            T = 1 if group is decode else bucket(max(c.num_tokens for c in part), buckets.chunk)
            calls.append((part, bucket(len(part), sizes), T))
    return calls


def plan_decode_steps(chunks: list, allocator: BlockAllocator, max_decode_steps: int,
                      requests_waiting: bool) -> tuple[list[int] | None, list]:
    """Decode steps per chunk for a multi-step call, or None for an ordinary step; and the copy-on-write
    copies [(source, destination)] the engine must make before the call.

    Only a step of decode chunks alone (no prefill, no logprobs asked, no constrained request: its mask needs
    the host after every token; no logit bias: only the single-step call applies it) qualifies. Row b runs up
    to min(max_decode_steps, tokens it may still generate); while requests wait, every row runs the fewest any
    row may still generate. Blocks for the extra
    positions are taken now; a row that cannot get them runs only as far as the blocks it holds.
    """
    K = max_decode_steps
    if K == 1 or not chunks or any(c.num_tokens != 1 or c.request.options.logprobs is not None
                                   or c.request.options.constraint is not None or c.request.options.logit_bias
                                   for c in chunks):
        return None, []
    left = [c.request.options.max_new_tokens - len(c.request.output_ids) for c in chunks]
    counts = [min(K, n) for n in left]
    if requests_waiting:
        counts = [min(counts)] * len(chunks)
    if max(counts) == 1:
        return None, []
    copies = []
    for i, chunk in enumerate(chunks):
        grown = allocator.grow(chunk.request.request_id, chunk.start, chunk.start + counts[i])
        if grown is None:
            held = len(allocator.table(chunk.request.request_id)) * allocator.block_size - chunk.start
            counts[i] = max(1, min(counts[i], held))
        else:
            copies += grown
    return counts, copies


def decode_step_calls(chunks: list, counts: list[int], buckets: Buckets,
                      allocator: BlockAllocator) -> list[tuple[list, list, int, int]]:
    """The decode_steps calls of a multi-step step: [(chunks, their counts, B, M)], B at most the largest
    decode bucket, M the table bucket covering the furthest position the call writes."""
    calls, width = [], buckets.decode[-1]
    for i in range(0, len(chunks), width):
        part, part_counts = chunks[i:i + width], counts[i:i + width]
        reach = max(c.start + n for c, n in zip(part, part_counts))  # positions written: < reach
        M = bucket(allocator.blocks_for(reach), buckets.table)
        calls.append((part, part_counts, bucket(len(part), buckets.decode), M))
    return calls


def advance(req: Request, start: int, num_tokens: int, allocator: BlockAllocator) -> bool:
    """Record that ``num_tokens`` tokens of ``req`` from position ``start`` are computed; register its newly
    full prompt blocks in the prefix cache. Returns True when the chunk reached the last token (the step's
    token then belongs to ``req``), False for a prefill chunk that has not."""
    req.events.append(("chunk", start, num_tokens))
    req.num_computed += num_tokens
    if start < len(req.prompt_ids):
        allocator.commit(req.request_id, req.prompt_ids, req.num_computed)
    return req.num_computed >= req.num_tokens


def finish_reason(req: Request, token: int) -> str | None:
    """Append ``token`` to ``req``'s output; returns "stop", "length" or None (not finished)."""
    req.output_ids.append(token)
    req.events.append(("token", token))
    if token in req.options.stop_token_ids:
        return "stop"
    if len(req.output_ids) >= req.options.max_new_tokens:
        return "length"
    return None
