"""Device side of the engine's draft speculation: the draft proposes k tokens and the target verifies them, in
one compiled call over the paged pool of a ``draft_model.TargetWithDraft`` (target layers, then draft layers).

For row b with last token t at position s = start[b] (cached in neither model; the draft's pool holds exactly
the positions the target's does, ``draft_model``):
  1. draft: a ``lax.scan`` of k one-token steps feeds t, d_1 .. d_{k-1} at s .. s + k - 1 over the draft's
     layers; step j gives q_{j+1}, the draft's distribution after the row's temperature, top-k and top-p
     (``sampling.filtered_probs``; a greedy row's is the point mass on the draft's argmax), and draws d_{j+1}
     from it with the row's draft key;
  2. target: one forward over [t, d_1 .. d_k] ([B, k + 1]) at s .. s + k over the target's layers;
  3. ``speculative.accept_proposals`` with the row's key and q: greedy rows accept the longest prefix equal
     to the target's argmax, sampled rows follow the rejection rule of Leviathan et al. 2023 (section 2.3)
     with the draft's q; the row emits its a accepted proposals and the target's own token;
  4. a row that accepted all k feeds d_k to the draft at s + k (skipped when no row did), so the draft's pool
     again holds positions 0 .. s + a, as the target's.
Both models write only positions up to s + limit[b] (the blocks the row holds); slots of rejected proposals
are overwritten by the row's next call, as in ``verify_step``. A row with limit 0 emits one token drawn from
the target's whole distribution at t (a plain decode step; the draft still writes t).

PRNG: the accept draws use ``fold_in(key(seed), steps)`` (the stream of ``runner.sample_rows``, as
``verify_step``); the draft's draws use a stream of their own, ``fold_in(fold_in(key(seed), DRAFT_STREAM),
steps)`` split into k keys, so proposals are independent of the acceptance uniforms.

k, the batch bucket B, the block-table width M and L are static; everything else is traced, so one program
serves every request of a (B, M) bucket.

Shapes: B batch, k proposals, M block-table entries, P block size, V vocabulary, L target layers.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from ..generation.sampling import GREEDY_TEMPERATURE, SamplingParams, filtered_probs, greedy_argmax
from ..generation.speculative import accept_proposals
from ..parallel.sharding import constrain_pool
from ..kv.paged import BlockTables, PagedPool, paged_views
from .runner import StaticGraph
from .verify_step import VerifyOut, verify_logprobs

DRAFT_STREAM = 2**31 - 1   # the draft's PRNG stream: a fold_in no request's step count reaches


def _draw_rows(probs, keys, sampling: SamplingParams):
    """One token per row from probs [B, V] float32 with keys [B] (one per row): the argmax for greedy rows.
    Returns [B] int32."""
    greedy = greedy_argmax(probs)
    scores = jnp.where(probs > 0, jnp.log(probs), -1e30)
    draw = lambda: jax.vmap(jax.random.categorical)(keys, scores).astype(jnp.int32)  # noqa: E731
    is_greedy = sampling.temperature <= GREEDY_TEMPERATURE
    return jax.lax.cond(jnp.all(is_greedy), lambda: greedy, lambda: jnp.where(is_greedy, greedy, draw()))


def _draft_forward(draft, pool: PagedPool, tokens, position, write, block_table):
    """The draft over one token per row: tokens [B] int32 at position [B] int32, written where write [B] bool.
    Returns (logits [B, V] float32, the draft's updated pool)."""
    views = paged_views(pool, block_table, write.astype(jnp.int32))
    logits, views, _ = draft(tokens[:, None], use_cache=True, kv_caches=views, cache_index=position)
    return logits[:, 0].astype(jnp.float32), tuple(view.pool for view in views)


def propose(draft, pool: PagedPool, tokens, start, limit, block_table, keys, sampling: SamplingParams, k: int):
    """k draft proposals per row (module docstring, step 1).

    pool: the draft's layers; tokens: [B] int32 last tokens; start: [B] int32 their positions; limit: [B] int32
    (step j writes where j <= limit; -1 for a padding row: nothing); keys: [B, k] PRNG keys; k: static >= 1.
    Returns (proposals [B, k] int32, q [B, k, V] float32, the draft's pool with s .. s + min(k - 1, limit)
    written)."""
    def step(carry, xs):
        token, pool = carry
        j, step_keys = xs
        logits, pool = _draft_forward(draft, pool, token, start + j, j <= limit, block_table)
        q = filtered_probs(logits, sampling)
        drafted = _draw_rows(q, step_keys, sampling)
        return (drafted, pool), (drafted, q)

    (_, pool), (ds, qs) = jax.lax.scan(step, (tokens, pool), (jnp.arange(k), jnp.moveaxis(keys, 0, 1)))
    return jnp.moveaxis(ds, 0, 1), jnp.moveaxis(qs, 0, 1), pool


@partial(jax.jit, static_argnames=("graph", "k", "target_layers"), donate_argnames=("pool",))
def draft_verify_step(graph: StaticGraph, params, pool: PagedPool, tokens, start, limit, tables: BlockTables, seeds,
                      steps, sampling: SamplingParams, with_logprobs, *, k: int,
                      target_layers: int) -> tuple[VerifyOut, PagedPool]:
    """Draft k tokens per row and verify them with the target in one call (module docstring).

    graph / params: a ``TargetWithDraft``; pool: its L target layers then the draft's; tokens: [B] int32 each
    row's last token (not yet cached), at position start [B] int32; limit: [B] int32 in 0..k, the proposals row
    b may have accepted (bounded by its remaining max_tokens and the blocks it holds; -1 marks an unused padding
    row, which writes nothing); tables: BlockTables whose block tables [B, M] cover start .. start + limit (its
    sink and residual slots are the target's); seeds: [B] uint32; steps: [B] int32 tokens generated so far;
    sampling: per-row settings [B]; with_logprobs: bool scalar (traced); k, target_layers (L): static. Returns
    (VerifyOut: proposed is limit for every live row, the updated pool)."""
    pair = nnx.merge(graph.graphdef, params)
    L, block_table = target_layers, tables.table
    live_limit = jnp.maximum(limit, 0)
    draft_keys = jax.vmap(lambda seed, step: jax.random.split(jax.random.fold_in(
        jax.random.fold_in(jax.random.key(seed), DRAFT_STREAM), step), k))(seeds, steps)          # [B, k]
    proposals, q, draft_pool = propose(pair.draft, pool[L:], tokens, start, limit, block_table, draft_keys,
                                       sampling, k)
    inputs = jnp.concatenate([tokens[:, None], proposals], axis=1)                              # [B, k + 1]
    views = paged_views(pool[:L], tables, limit + 1)
    logits, views, _ = pair.target(inputs, use_cache=True, kv_caches=views, cache_index=start)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seeds, steps)
    out_tokens, accepted = accept_proposals(logits, proposals, keys, sampling, limit=live_limit, q=q)
    full = (accepted == k) & (limit >= 0)

    def catch_up(draft_pool):   # step 4: the draft writes d_k where all k were accepted
        return _draft_forward(pair.draft, draft_pool, proposals[:, -1], start + k, full, block_table)[1]

    draft_pool = jax.lax.cond(jnp.any(full), catch_up, lambda p: p, draft_pool)
    out = VerifyOut(out_tokens, accepted, live_limit, verify_logprobs(logits, out_tokens, with_logprobs))
    return out, constrain_pool(tuple(view.pool for view in views) + tuple(draft_pool))
