"""Device side of the engine's speculative decoding: propose by prompt lookup and verify in one compiled call.

One ``verify_step`` call serves every speculating decode row of a step: for row b it looks up an n-gram
proposal of k tokens in the row's own tokens (``dantinox.generation.ngram.propose_ngram``), runs the target
over [last token, d_1 .. d_k] ([B, k + 1] new tokens) on the paged pool at the row's positions
start .. start + k, and applies ``dantinox.generation.speculative.accept_proposals`` with one PRNG key per row
(``fold_in(key(seed), tokens generated)``, the stream of ``runner.sample_rows``): greedy rows accept the
longest prefix equal to the target's argmax, sampled rows follow the rejection rule of Leviathan et al. 2023
(section 2.3) / Chen et al. 2023 (algorithm 2) with a point-mass proposal; either way the call emits the
accepted proposals and then the target's own token.

Keys and values are written for the first ``num_new[b] = limit[b] + 1`` positions only (the rest is padding
the pool drops), so a row needs blocks for limit + 1 slots, not k + 1. Slots of rejected proposals are simply
overwritten by the row's next call (attention reads only slots below a query's position). A row with no
n-gram match, or with limit 0, emits one token drawn from the whole distribution at its last token: a plain
decode step inside the same program.

k, the n-gram bounds, the batch bucket B and the block-table width M are static; everything else is traced,
so one program serves every request of a (B, M) bucket.

Shapes: B batch, k proposals, M block-table entries, P block size, W = M * P token slots of ``seq``, V vocabulary.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..generation.ngram import propose_ngram
from ..generation.sampling import SamplingParams
from ..generation.speculative import accept_proposals
from ..parallel.sharding import constrain_pool
from ..kv.paged import BlockTables, PagedPool, paged_views
from .request import MAX_LOGPROBS
from .runner import StaticGraph, StepLogprobs, token_logprobs


class VerifyOut(NamedTuple):
    """What one verify call returns per row. tokens: [B, k + 1] int32, the first accepted + 1 are the row's
    new tokens; accepted: [B] int32 proposals accepted (0..limit); proposed: [B] int32 proposals the row
    verified (limit where a match was found, else 0); logprobs: StepLogprobs over [B, k + 1] (chosen
    [B, k + 1], top_ids / top [B, k + 1, min(MAX_LOGPROBS, V)]), zeros unless asked for."""

    tokens: jax.Array
    accepted: jax.Array
    proposed: jax.Array
    logprobs: StepLogprobs


def verify_logprobs(logits, tokens, with_logprobs) -> StepLogprobs:
    """``token_logprobs`` at every one of the k + 1 positions (the raw distribution), or zeros when no row
    asked. logits [B, T, V], tokens [B, T]."""
    B, T, V = logits.shape
    n = min(MAX_LOGPROBS, V)

    def compute():
        lp = token_logprobs(logits.reshape(B * T, V), tokens.reshape(B * T))
        return StepLogprobs(lp.chosen.reshape(B, T), lp.top_ids.reshape(B, T, n), lp.top.reshape(B, T, n))

    skipped = StepLogprobs(jnp.zeros((B, T), jnp.float32), jnp.zeros((B, T, n), jnp.int32),
                           jnp.zeros((B, T, n), jnp.float32))
    return jax.lax.cond(with_logprobs, compute, lambda: skipped)


@partial(jax.jit, static_argnames=("graph", "k", "ngram_max", "ngram_min"), donate_argnames=("pool",))
def verify_step(graph: StaticGraph, params, pool: PagedPool, seq, start, limit, tables: BlockTables, seeds, steps,
                sampling: SamplingParams, with_logprobs, *, k: int, ngram_max: int,
                ngram_min: int) -> tuple[VerifyOut, PagedPool]:
    """Propose k tokens per row by prompt lookup and verify them in one forward over the paged pool.

    seq: [B, W] int32 each row's tokens (prompt + generated), valid at 0..start[b]; start: [B] int32 the
    position of the row's last token (not yet cached; = tokens cached); limit: [B] int32 in 0..k, the
    proposals row b may have accepted (bounded by its remaining max_tokens, the context and the blocks it holds;
    -1 marks an unused padding row, which writes nothing); tables: BlockTables (``dantinox.kv.paged``) whose
    block tables [B, M] cover positions start .. start + limit; seeds: [B] uint32; steps: [B] int32 tokens generated
    so far (row b draws with
    ``fold_in(key(seeds[b]), steps[b])``); sampling: per-row settings [B]; with_logprobs: bool scalar (traced);
    k, ngram_max, ngram_min: static.
    Returns (VerifyOut, the updated pool).
    """
    model = nnx.merge(graph.graphdef, params)
    rows = jnp.arange(seq.shape[0])
    proposals, found = propose_ngram(seq, start, k, ngram_max, ngram_min)
    limit = jnp.where(found, limit, jnp.minimum(limit, 0))
    inputs = jnp.concatenate([seq[rows, start][:, None], proposals], axis=1)          # [B, k + 1]
    num_new = limit + 1                                                              # 0 for padding rows
    views = paged_views(pool, tables, num_new)
    logits, views, _ = model(inputs, use_cache=True, kv_caches=views, cache_index=start)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seeds, steps)
    tokens, accepted = accept_proposals(logits, proposals, keys, sampling, limit=jnp.maximum(limit, 0))
    out = VerifyOut(tokens, accepted, jnp.maximum(limit, 0), verify_logprobs(logits, tokens, with_logprobs))
    return out, constrain_pool(tuple(view.pool for view in views))
