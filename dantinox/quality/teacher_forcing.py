"""Teacher-forced scoring of a baseline and a candidate model through their caches (``dantinox eval``'s loss and
largest logit difference; ``dantinox.quality.slices`` has the walkthrough).

Windows. The token stream is cut into windows of L tokens, L = the stream's length rounded up to a power of two
(at most max_context): a stream shorter than max_context is one window, and its cache has L slots, not
max_context (on SmolLM2, 8192 slots for a 492-token slice made every step attend over 16x the slots it
needed). Longer streams are cut into windows of max_context (or of ``window`` tokens when given:
``dantinox eval --window``, a shorter context per window and quadratically less attention), each starting on
the last token of the previous one, so every token but the first is predicted exactly once; the last window
is the stream's last L tokens with the already-scored targets masked. Batches hold at most ``batch`` rows,
as evenly filled as the window count allows (11 windows at batch 8: two batches of 6), so no batch is
mostly padding.

Feeding. In a window the first P tokens are prefilled into a fresh cache, P = prefix, raised by at most
chunk - 1 so the rest (L - 1 - P tokens) divides into chunks; every chunk of ``chunk`` tokens is then fed at
its slot through the cache (one ``lax.scan`` of model calls), so a cache that stores or reads keys and values
wrongly changes the figures. chunk = 1 is one-token decode steps; a chunk of C > 1 reads the old slots from
the cache the same way and gives the same figures up to float rounding (cached and uncached runs agree to
1e-5, docs/explanation/quantization.md "Exactness"), C times fewer sequential steps.

Memory. Both models run in one compiled call that returns per-position figures (the target's -log p for each
model, [B, L - 1] float32, and the largest |logit difference| per position), never the [B, L - 1, V] logits:
on SmolLM2 (V = 49152, L = 8192) those were 1.6 GB a row and model. The caches are built inside the call
(``CacheSpec``): the model's own static cache of L slots, or the per-channel key view
(``dantinox.quality.channel_keys``) when the candidate's key_group is set.

Shape letters: B windows per batch, L window length, P prefix, C chunk, V vocabulary, N stream tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kv.cache import init_cache
from ..kv.channel_layout import init_channel_layer
from ..parallel.distributed import to_host
from ..parallel.mesh import mesh_of, mesh_scope
from .channel_keys import channel_key_cache


class CacheSpec(NamedTuple):
    """The cache a scored model runs on (static: hashable). slots: cache slots; key_group: 0 for the model's
    own static cache (``init_cache`` of cfg with max_context = slots), G > 0 for per-channel keys in groups
    of G (``channel_key_cache``)."""

    slots: int
    key_group: int = 0


def new_cache(model, batch: int, spec: CacheSpec) -> tuple:
    """A fresh cache of ``spec`` for ``model``'s config, ``batch`` rows."""
    if spec.key_group:
        return channel_key_cache(model.cfg, batch, spec.slots, spec.key_group)
    if model.cfg.channel_keys:   # the model's own key group (cfg.key_group depends on max_context): a cut cache
        return tuple(init_channel_layer(model.cfg, batch, min(spec.slots, model.cfg.max_context))
                     for _ in range(model.cfg.num_blocks))
    return init_cache(model.cfg.replace(max_context=spec.slots), batch)


def window_length(n_tokens: int, max_context: int) -> int:
    """L: n_tokens rounded up to a power of two, at most max_context."""
    return min(max_context, 1 << max(1, int(n_tokens - 1).bit_length()))


def context_cap(max_context: int, window: int | None) -> int:
    """The longest window: max_context, or ``window`` when given and smaller."""
    return max_context if window is None else min(max_context, window)


def fed_prefix(length: int, prefix: int, chunk: int) -> int:
    """P: prefix raised by at most chunk - 1 so the L - 1 - P fed tokens divide into chunks (chunk = 1: prefix)."""
    return prefix + (length - 1 - prefix) % chunk


def windows(n_tokens: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Window starts and score masks covering targets 1..N-1 exactly once.

    Returns (starts [W] int, mask [W, length - 1] bool: True where target start + t + 1 is scored here).
    Needs n_tokens >= length (the caller pads shorter streams).
    """
    starts = list(range(0, n_tokens - length + 1, length - 1))
    if starts[-1] + length < n_tokens:
        starts.append(n_tokens - length)
    mask = np.ones((len(starts), length - 1), bool)
    for w in range(1, len(starts)):
        covered = starts[w - 1] + length - starts[w]  # targets of window w already scored by window w - 1
        mask[w, :max(0, covered - 1)] = False
    return np.asarray(starts), mask


def batches(ids: np.ndarray, length: int, batch: int):
    """Yield (window ids [rows, length] int32, score mask [rows, length - 1] bool) covering the stream, rows =
    ceil(W / ceil(W / batch)) for W windows; the last batch is padded with masked rows of token 0."""
    n = len(ids)
    if n < length:  # one short window, padded with token 0 and masked
        ids = np.concatenate([ids, np.zeros(length - n, ids.dtype)])
        starts, mask = np.zeros(1, int), np.arange(length - 1)[None] < n - 1
    else:
        starts, mask = windows(n, length)
    rows = -(-len(starts) // -(-len(starts) // batch))          # ceil(W / number of batches)
    for first in range(0, len(starts), rows):
        part = np.stack([ids[s:s + length] for s in starts[first:first + rows]])
        m = mask[first:first + rows]
        pad = rows - len(part)
        yield (np.concatenate([part, np.zeros((pad, length), part.dtype)]).astype(np.int32),
               np.concatenate([m, np.zeros((pad, length - 1), bool)]))


def batch_count(n_tokens: int, max_context: int, batch: int) -> int:
    """Number of batches ``teacher_forced`` runs for a stream of n_tokens (for a progress bar)."""
    length = window_length(n_tokens, max_context)
    if n_tokens < length:
        return 1
    return -(-len(windows(n_tokens, length)[0]) // batch)


def _target_nll(logits, targets):
    """-log p(target): logits [B, T, V] float32, targets [B, T] int -> [B, T] float32."""
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


@partial(jax.jit, static_argnames=("graphdefs", "specs", "prefix", "chunk"))
def pair_figures(graphdefs, params, ids, specs, prefix: int, chunk: int):
    """Per-position figures of two models teacher-forced through their caches.

    graphdefs, params: (baseline, candidate) of ``nnx.split``; ids: [B, L] int32; specs: a CacheSpec per model;
    prefix: P (``fed_prefix``: L - 1 - P divides by chunk). Returns (nll [2, B, L - 1] float32: -log p of
    ids[:, t + 1] at row t for each model, diff [B, L - 1] float32: max over V of |candidate - baseline| logit).
    """
    models = [nnx.merge(g, p) for g, p in zip(graphdefs, params)]
    B, L = ids.shape

    def figures(logits, targets):
        return (jnp.stack([_target_nll(x, targets) for x in logits]),
                jnp.max(jnp.abs(logits[1] - logits[0]), axis=-1))

    caches, first = [], []
    for model, spec in zip(models, specs):
        out, cache, _ = model(ids[:, :prefix], use_cache=True, kv_caches=new_cache(model, B, spec), cache_index=0)
        caches.append(cache)
        first.append(out)
    head = figures(first, ids[:, 1:prefix + 1])

    def step(caches, t):
        chunk_ids = jax.lax.dynamic_slice_in_dim(ids, t, chunk, axis=1)
        index = jnp.full((B,), t, jnp.int32)
        outs = [m(chunk_ids, use_cache=True, kv_caches=c, cache_index=index)[:2] for m, c in zip(models, caches)]
        targets = jax.lax.dynamic_slice_in_dim(ids, t + 1, chunk, axis=1)
        return [c for _, c in outs], figures([o for o, _ in outs], targets)

    fed = L - 1 - prefix                                                        # n C tokens after the prefill
    _, (nll, diff) = jax.lax.scan(step, caches, jnp.arange(prefix, L - 1, chunk, dtype=jnp.int32))
    nll = jnp.moveaxis(nll, 0, 2).reshape(2, B, fed)                           # [n, 2, B, C] -> [2, B, n C]
    diff = jnp.moveaxis(diff, 0, 1).reshape(B, fed)
    return jnp.concatenate([head[0], nll], axis=2), jnp.concatenate([head[1], diff], axis=1)


def teacher_forced(baseline, candidate, ids: np.ndarray, prefix: int, batch: int, chunk: int = 1,
                   key_group: int = 0, window: int | None = None,
                   tick: Callable[[], None] = lambda: None) -> tuple[float, float, float]:
    """(baseline summed NLL, candidate summed NLL, largest |logit diff|) over the stream ids [N] (nats).
    key_group: the candidate's per-channel key group (0: its own cache); window: the longest window (None:
    max_context). Both models run on the mesh the
    baseline's parameters are on (``dantinox.parallel.mesh.mesh_of``), or on one device."""
    length = window_length(len(ids), context_cap(baseline.cfg.max_context, window))
    P = fed_prefix(length, prefix, chunk)
    specs = (CacheSpec(length - 1), CacheSpec(length - 1, key_group))
    split = [nnx.split(m) for m in (baseline, candidate)]
    graphdefs, params = tuple(g for g, _ in split), tuple(p for _, p in split)
    nll, diff = np.zeros(2), 0.0
    for rows, mask in batches(np.asarray(ids), length, batch):
        with mesh_scope(mesh_of(params[0])):
            out = pair_figures(graphdefs, params, jnp.asarray(rows), specs, P, chunk)
            per_token, per_diff = (to_host(x) for x in out)
        nll += (per_token.astype(np.float64) * mask).sum(axis=(1, 2))
        diff = max(diff, float(per_diff[mask].max(initial=0.0)))
        tick()
    return float(nll[0]), float(nll[1]), diff
