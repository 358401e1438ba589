"""Device side of the engine: compiled functions over the paged pool (forward + sample, multi-step decode).

Every function has static shapes chosen by the caller (a batch bucket B and a chunk bucket T for the forward;
fixed-length, padded index lists for the copies), so each compiles once per bucket. The pool is donated, so
XLA updates it in place. Letters: see ``dantinox.kv.paged``.

The model's graph is a static argument. Hashing an nnx GraphDef walks the whole graph, on every call (its
measured cost: docs/explanation/performance.md, "Costs behind choices in the code"), so the engine passes a
``StaticGraph``: one interned wrapper per distinct graph, hashed once and compared by identity.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..generation.sampling import GREEDY_TEMPERATURE, SamplingParams, apply_token_mask, greedy_argmax, sample_next
from ..parallel.sharding import constrain_pool
from ..programs.store import stored_jit
from ..kv.paged import BlockTables, PagedPool, paged_views
from .request import MAX_LOGPROBS


class StaticGraph:
    """A hashable handle on an nnx GraphDef whose hash is computed once; get one with ``static_graph``."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self.graphdef == other.graphdef)


_INTERNED: dict = {}


def static_graph(graphdef) -> StaticGraph:
    """The one StaticGraph for graphs equal to ``graphdef`` (so engines of one model share compilations)."""
    return _INTERNED.setdefault(graphdef, StaticGraph(graphdef))


def sample_rows(logits: jax.Array, seeds: jax.Array, steps: jax.Array, sampling: SamplingParams) -> jax.Array:
    """One token per row with each row's own PRNG stream. logits: [B, V] float32; seeds: [B] uint32;
    steps: [B] int32 (tokens the row has generated so far). Returns [B] int32.

    Row b draws with ``fold_in(key(seeds[b]), steps[b])``: the key ``dantinox.generation.decode`` uses for a batch-1
    request with that seed, so a sampled request gets the same tokens here as alone. All-greedy batches
    skip the draw.
    """
    def one(row, seed, step, temperature, top_k, top_p):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return sample_next(row[None], key, SamplingParams(temperature[None], top_k[None], top_p[None]))[0]

    greedy = greedy_argmax(logits)
    draw = lambda: jax.vmap(one)(logits, seeds, steps, *sampling)  # noqa: E731
    return jax.lax.cond(jnp.all(sampling.temperature <= GREEDY_TEMPERATURE), lambda: greedy, draw)


class StepLogprobs(NamedTuple):
    """Log-probabilities at each row's sampled position, k = min(MAX_LOGPROBS, V) alternatives.

    chosen: [B] float32, log p(sampled token); top_ids: [B, k] int32 and top: [B, k] float32, the k most
    likely tokens and their log-probabilities, most likely first (ties to the lower id).
    """

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> StepLogprobs:
    """log_softmax of the model's raw logits (before temperature, top-k and top-p: the model's own
    distribution, not the one a sampled token was drawn from), at the chosen tokens and the top k.

    logits: [B, V] float32; tokens: [B] int32.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]
    top, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logits.shape[-1]))
    return StepLogprobs(chosen, top_ids.astype(jnp.int32), top)


@stored_jit(static_argnames=("graph",), donate_argnames=("pool",))
def forward_step(graph: StaticGraph, params, pool: PagedPool, ids, start, num_new, tables: BlockTables, seeds, steps,
                 sampling: SamplingParams, with_logprobs, token_mask, bias_ids, bias_values):
    """Run T new tokens per row through the model over the paged pool and sample each row's next token.

    ids: [B, T] int32 (row b's tokens in ids[b, :num_new[b]], the rest padding); start: [B] int32 tokens
    already cached per row (the RoPE position of ids[b, 0]); num_new: [B] int32 (0 for an unused row);
    tables: the rows' BlockTables (block tables [B, M], sink and residual slots; ``dantinox.kv.paged``);
    seeds: [B] uint32; steps: [B] int32; sampling: per-row settings [B];
    with_logprobs: bool scalar (traced, so either value runs the same compiled step): compute the
    log-probabilities (``token_logprobs``), else return zeros and skip the work; token_mask: [B, W] int32
    packed bits of the tokens each row may sample (structured outputs; all ones for a free row, whose logits
    it leaves unchanged): tokens and log-probabilities come from the masked logits; bias_ids [B, L] int32 and
    bias_values [B, L] float32: each row's logit biases (OpenAI's logit_bias; id V, out of range, pads a row),
    added to its logits before the mask.
    Returns (tokens [B] int32 sampled from each row's last valid position, StepLogprobs, the updated pool).
    """
    model = nnx.merge(graph.graphdef, params)
    views = paged_views(pool, tables, num_new)
    logits, views, _ = model(ids, use_cache=True, kv_caches=views, cache_index=start,
                             logits_at=jnp.maximum(num_new - 1, 0))
    rows = jnp.arange(ids.shape[0])[:, None]
    last = logits[:, 0].at[rows, bias_ids].add(bias_values, mode="drop")
    last = apply_token_mask(last, token_mask)
    tokens = sample_rows(last, seeds, steps, sampling)
    B, k = tokens.shape[0], min(MAX_LOGPROBS, last.shape[-1])
    skipped = StepLogprobs(jnp.zeros(B, jnp.float32), jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k), jnp.float32))
    logprobs = jax.lax.cond(with_logprobs, lambda: token_logprobs(last, tokens), lambda: skipped)
    return tokens, logprobs, constrain_pool(tuple(view.pool for view in views))  # on a mesh: same layout


@stored_jit(static_argnames=("graph", "max_steps"), donate_argnames=("pool",))
def decode_steps(graph: StaticGraph, params, pool: PagedPool, tokens, start, num_steps, tables: BlockTables, seeds,
                 steps, sampling: SamplingParams, *, max_steps: int):
    """Up to ``max_steps`` decode steps for every row in one compiled loop (multi-step decoding).

    tokens: [B] int32 each row's last token, not yet cached, at position start [B] int32; num_steps: [B] int32
    steps to run for row b (0 for an unused row; at most max_steps; its blocks must cover positions
    start .. start + num_steps - 1); tables: BlockTables (as in forward_step, tables of M entries); seeds: [B]
    uint32; steps: [B] int32 tokens generated so far; sampling: per-row settings [B].
    Step j of row b feeds its previous token at position start + j and samples with
    ``fold_in(key(seed), steps + j)``: exactly what j + 1 calls of ``forward_step`` would do. A row stops
    writing after its num_steps (its later keys are never written). Returns (out [B, max_steps] int32, row
    b's first num_steps[b] entries valid; the updated pool). The loop runs max(num_steps) iterations (a traced
    bound: one compile per (B, max_steps)).
    """
    model = nnx.merge(graph.graphdef, params)
    out = jnp.zeros((tokens.shape[0], max_steps), jnp.int32)

    def body(j, carry):
        token, out, pool = carry
        active = (j < num_steps).astype(jnp.int32)
        views = paged_views(pool, tables, active)
        logits, views, _ = model(token[:, None], use_cache=True, kv_caches=views, cache_index=start + j)
        token = sample_rows(logits[:, 0], seeds, steps + j, sampling)
        out = jax.lax.dynamic_update_slice(out, token[:, None], (0, j))
        return token, out, tuple(view.pool for view in views)

    _, out, pool = jax.lax.fori_loop(0, jnp.minimum(jnp.max(num_steps), max_steps), body, (tokens, out, pool))
    return out, constrain_pool(pool)
