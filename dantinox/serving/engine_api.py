"""The engine's interface: what the server (and the tests' mock engines) need from an engine, and its sizes.

``Engine`` is the narrow contract the HTTP layer depends on (add a request, step, abort, stats; after
JetStream's ``engine_api.py``); ``EngineConfig`` the sizes of the paged implementation
(``dantinox.serving.engine.PagedEngine``): pool, batching buckets, context policy, speculation.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from ..kv.tiers import TierConfig
from .request import RequestOutput, SamplingOptions
from .speculation import SpecConfig


class Engine(abc.ABC):
    """What the server (and tests) need from an engine. One thread calls it; nothing here blocks for long."""

    vocab_size: int
    max_context: int

    @abc.abstractmethod
    def add_request(self, prompt_ids, options: SamplingOptions, request_id: str | None = None,
                    share_prompt_with: str | None = None) -> str:
        """Queue a request; returns its id. Raises RequestError (invalid, or can never fit; ``field``
        names the input) or QueueFullError (queue at its bound).

        share_prompt_with: the id of a queued or running request with the same prompt (the first of n
        choices); this one then waits until that one's prompt is computed and takes its full prompt blocks
        from the prefix cache instead of computing them again. An engine may ignore it."""

    def check_request(self, prompt_ids, options: SamplingOptions) -> None:
        """Raise the RequestError ``add_request`` would raise for a request that is invalid or can never fit,
        from fixed sizes only (no queue state), so any thread may call it: the server answers such a request
        at once, even while the engine thread compiles a warm-up program. The default checks nothing."""
        return None

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got a token or finished."""

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request and free its blocks; its final output comes from the next step() with finish reason
        ``reason``: "abort" (the client left) or "stop" (the server ended it on a stop string, which the
        engine does not see; counted as finished in ``stats``, as /metrics counts it). Returns False if the id
        is unknown or already finished."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Counters and gauges: waiting, running, swapped, blocks_total/used/free, preemptions, ..."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is queued, running or has an unreported final output."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. Pool: num_blocks blocks of block_size tokens; or with kv_memory_bytes (bytes) as many as
    fit, but at most the max_running x ceil(max_context / block_size) blocks the running sequences can hold
    (kv_memory_all=True takes every block that fits, e.g. to keep more finished prompts in the prefix
    cache); or by default exactly those max_running full-context sequences (``step_plan.pool_size``). See
    ContextPolicy for the bounds.
    max_decode_steps: when a step would only decode, run up to this many decode steps in one compiled call
    (multi-step decoding; 1 turns it off). With requests waiting, it runs only as many steps as the running
    request closest to its max_new_tokens needs, so no slot sits finished while a request waits.
    decode_buckets / prefill_buckets: batch sizes of the compiled calls (default: powers of two up to
    max_running, and (1, 2, 4)), cut after the first that holds max_running rows (``step_plan.batch_buckets``:
    max_running 1 compiles no prefill at B = 2 or 4); chunk_buckets: prefill chunk lengths (default:
    ``step_plan.chunk_ladder(min(max_batched_tokens, max_context))``, powers of two from 8 to 512 then x4 steps).
    speculative: None (plain decoding) or a ``speculation.SpecConfig``: speculative decoding of the decode rows
    with n-gram (prompt lookup) or draft-model proposals (the greedy output is unchanged; sampled output keeps
    the target's distribution).
    tpot_slo: seconds per output token the running streams should keep: each step's prefill budget is derived
    from it and the measured step costs, between min_prefill_chunk and max_batched_tokens
    (``token_budget.TokenBudget``; None: always max_batched_tokens).
    block_size: tokens per KV block; None (the default) takes ``step_plan.default_block_size`` of the model:
    16, or the key group G with per-channel int8 keys (a block size must then be a multiple of G).
    kv_tiers: a ``dantinox.kv.tiers.TierConfig``: host-memory and disk tiers under the prefix cache (None: the
    prefix cache lives in the pool alone)."""

    block_size: int | None = None
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    kv_memory_all: bool = False
    max_running: int = 16
    max_queued: int = 256
    max_batched_tokens: int = 64
    max_prompt_tokens: int | None = None
    max_total_tokens: int | None = None
    preemption: str = "recompute"
    enable_prefix_caching: bool = True
    swap_space_blocks: int | None = None
    decode_buckets: tuple | None = None
    prefill_buckets: tuple = (1, 2, 4)
    chunk_buckets: tuple | None = None
    max_decode_steps: int = 8
    speculative: SpecConfig | None = None
    tpot_slo: float | None = None
    min_prefill_chunk: int = 32
    kv_tiers: TierConfig | None = None
