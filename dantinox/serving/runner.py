"""Device side of the engine: compiled functions over the paged pool (forward + sample, block copies, swap).

Every function has static shapes chosen by the caller (a batch bucket B and a chunk bucket T for the forward;
fixed-length, padded index lists for the copies), so each compiles once per bucket. The pool is donated, so
XLA updates it in place. Letters: see ``dantinox.serving.paged_cache``.

The model's graph is a static argument. Hashing an nnx GraphDef walks the whole graph, on every call (its
measured cost: docs/performance.md, "Costs behind choices in the code"), so the engine passes a
``StaticGraph``: one interned wrapper per distinct graph, hashed once and compared by identity.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..generation.sampling import GREEDY_TEMPERATURE, SamplingParams, apply_token_mask, greedy_argmax, sample_next
from ..parallel.sharding import constrain_pool
from ..program_store import stored_jit
from .paged_channel_keys import PagedChannelKV
from .paged_cache import BLOCK_FIELDS, SINK_FIELDS, PagedPool, block_fields, paged_views, sink_fields, with_sinks
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
def forward_step(graph: StaticGraph, params, pool: PagedPool, ids, start, num_new, block_table, seeds, steps,
                 sampling: SamplingParams, with_logprobs, token_mask, sink_slot, residual_slot=None):
    """Run T new tokens per row through the model over the paged pool and sample each row's next token.

    ids: [B, T] int32 (row b's tokens in ids[b, :num_new[b]], the rest padding); start: [B] int32 tokens
    already cached per row (the RoPE position of ids[b, 0]); num_new: [B] int32 (0 for an unused row);
    block_table: [B, M] int32; seeds: [B] uint32; steps: [B] int32; sampling: per-row settings [B];
    with_logprobs: bool scalar (traced, so either value runs the same compiled step): compute the
    log-probabilities (``token_logprobs``), else return zeros and skip the work; token_mask: [B, W] int32
    packed bits of the tokens each row may sample (structured outputs; all ones for a free row, whose logits
    it leaves unchanged): tokens and log-probabilities come from the masked logits; sink_slot: [B] int32 each
    row's sink slot of an int8 pool (``dantinox.serving.sink_slots``; R for an unused row); residual_slot: [B]
    int32 each row's residual slot of a per-channel key pool (``dantinox.serving.residual_slots``; Q for an
    unused row; None for other pools).
    Returns (tokens [B] int32 sampled from each row's last valid position, StepLogprobs, the updated pool).
    """
    model = nnx.merge(graph.graphdef, params)
    views = paged_views(pool, block_table, num_new, sink_slot, residual_slot)
    logits, views, _ = model(ids, use_cache=True, kv_caches=views, cache_index=start,
                             logits_at=jnp.maximum(num_new - 1, 0))
    last = apply_token_mask(logits[:, 0], token_mask)
    tokens = sample_rows(last, seeds, steps, sampling)
    B, k = tokens.shape[0], min(MAX_LOGPROBS, last.shape[-1])
    skipped = StepLogprobs(jnp.zeros(B, jnp.float32), jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k), jnp.float32))
    logprobs = jax.lax.cond(with_logprobs, lambda: token_logprobs(last, tokens), lambda: skipped)
    return tokens, logprobs, constrain_pool(tuple(view.pool for view in views))  # on a mesh: same layout


@stored_jit(static_argnames=("graph", "max_steps"), donate_argnames=("pool",))
def decode_steps(graph: StaticGraph, params, pool: PagedPool, tokens, start, num_steps, block_table, seeds, steps,
                 sampling: SamplingParams, sink_slot, residual_slot=None, *, max_steps: int):
    """Up to ``max_steps`` decode steps for every row in one compiled loop (multi-step decoding).

    tokens: [B] int32 each row's last token, not yet cached, at position start [B] int32; num_steps: [B] int32
    steps to run for row b (0 for an unused row; at most max_steps; its blocks must cover positions
    start .. start + num_steps - 1); block_table: [B, M] int32; seeds: [B] uint32; steps: [B] int32 tokens
    generated so far; sampling: per-row settings [B]; sink_slot, residual_slot: [B] int32 (as in forward_step).
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
        views = paged_views(pool, block_table, active, sink_slot, residual_slot)
        logits, views, _ = model(token[:, None], use_cache=True, kv_caches=views, cache_index=start + j)
        token = sample_rows(logits[:, 0], seeds, steps + j, sampling)
        out = jax.lax.dynamic_update_slice(out, token[:, None], (0, j))
        return token, out, tuple(view.pool for view in views)

    _, out, pool = jax.lax.fori_loop(0, jnp.minimum(jnp.max(num_steps), max_steps), body, (tokens, out, pool))
    return out, constrain_pool(pool)


# The block moves work on every block array of every layer alike (k and v [N, P, K, D], or for MLA c_kv [N, P, C]
# and k_rope [N, P, R], and the int8 scales): the first BLOCK_FIELDS fields of each layer NamedTuple have the
# block axis first. The int8 sinks (the next SINK_FIELDS fields, [R, A, ...]) are per sequence: read_sinks /
# write_sinks; so is the per-channel keys' residual (the last field, [Q, 2 G, K, D]): read_residual / write_residual.

def _with_blocks(layer, blocks) -> tuple:
    """The layer with its block arrays replaced by ``blocks`` and its other arrays kept."""
    return type(layer)(*blocks, *layer[BLOCK_FIELDS:])


@partial(jax.jit, donate_argnames=("pool",))
def copy_blocks(pool: PagedPool, src, dst) -> PagedPool:
    """pool[dst[i]] = pool[src[i]] in every layer. src, dst: [C] int32; dst = N marks padding (dropped)."""
    return constrain_pool(tuple(_with_blocks(layer, (a.at[dst].set(a[src], mode="drop") for a in block_fields(layer)))
                                for layer in pool))


@jax.jit
def read_blocks(pool: PagedPool, blocks):
    """Contents of ``blocks`` ([M] int32) in every layer: per layer a tuple of its block arrays ([M, P, K, D]
    each for k and v, or [M, P, C] and [M, P, R] for MLA, then the int8 scales)."""
    return tuple(tuple(a[blocks] for a in block_fields(layer)) for layer in pool)


@partial(jax.jit, donate_argnames=("pool",))
def write_blocks(pool: PagedPool, blocks, data) -> PagedPool:
    """pool[blocks[i]] = data[i] in every layer. blocks: [M] int32 (N = padding, dropped); data: as returned
    by ``read_blocks``."""
    return constrain_pool(tuple(_with_blocks(layer, (a.at[blocks].set(d, mode="drop")
                                                     for a, d in zip(block_fields(layer), new)))
                                for layer, new in zip(pool, data)))


@jax.jit
def read_sinks(pool: PagedPool, slot):
    """One sink slot's rows (``slot``, int32 scalar) in every layer: per layer a tuple of its sink arrays
    ([A, K, D] each, or [A, C] and [A, R] for MLA; empty for a float pool)."""
    return tuple(tuple(a[slot] for a in sink_fields(layer)) for layer in pool)


@partial(jax.jit, donate_argnames=("pool",))
def write_sinks(pool: PagedPool, slot, data) -> PagedPool:
    """pool's sink slot ``slot`` (int32 scalar) set to ``data`` (as returned by ``read_sinks``) in every
    layer."""
    return constrain_pool(tuple(with_sinks(layer, [a.at[slot].set(d) for a, d in zip(sink_fields(layer), new)])
                                for layer, new in zip(pool, data)))


@partial(jax.jit, donate_argnames=("pool",))
def copy_sinks(pool: PagedPool, src, dst) -> PagedPool:
    """pool's sink slot dst = sink slot src (int32 scalars) in every layer."""
    return constrain_pool(tuple(with_sinks(layer, [a.at[dst].set(a[src]) for a in sink_fields(layer)])
                                for layer in pool))


_RESIDUAL = BLOCK_FIELDS + SINK_FIELDS  # the per-channel key pool's residual field


@jax.jit
def read_residual(pool: PagedPool, slot):
    """One residual slot (``slot``, int32 scalar) of a per-channel key pool: per layer its [2 G, K, D] float32
    residual ring (``dantinox.serving.paged_channel_keys``); an empty tuple for a layer without one (a draft
    model's float layers beside per-channel target layers)."""
    return tuple(layer[_RESIDUAL][slot] if isinstance(layer, PagedChannelKV) else () for layer in pool)


@partial(jax.jit, donate_argnames=("pool",))
def write_residual(pool: PagedPool, slot, data) -> PagedPool:
    """The per-channel key pool's residual slot ``slot`` (int32 scalar) set to ``data`` (as returned by
    ``read_residual``) in every layer."""
    return constrain_pool(tuple(layer._replace(k_resid=layer.k_resid.at[slot].set(d))
                                if isinstance(layer, PagedChannelKV) else layer for layer, d in zip(pool, data)))
