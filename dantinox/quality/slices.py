"""Quality of a model variant on one text slice, measured through the cache path under test.

``slice_quality(baseline, candidate, ids, ...)`` returns, for one slice's token ids, the three figures of
``dantinox eval`` for the baseline and the candidate model (same tokenizer, same shape; the candidate may hold a
quantized cache or quantized weights):

  loss            teacher-forced cross-entropy in nats per character. The token stream is cut into windows of
                  S = max_context tokens, each starting on the last token of the previous one, so every token
                  but the first is predicted exactly once. In a window the first ``prefix`` tokens are
                  prefilled into a fresh cache; every later token is fed one at a time through the cache
                  (one ``lax.scan`` of single-token model calls), so a cache that stores or reads keys and
                  values wrongly changes the loss. Windows run in batches of ``batch`` rows; the last
                  window is the stream's last S tokens with the already-scored targets masked, and missing rows
                  are masked padding, so the whole slice compiles once.
  agreement       greedy continuation agreement with the baseline: ``prompts`` prompts of ``prompt_tokens``
                  tokens taken at evenly spaced offsets of the stream (deterministic), ``continuation`` greedy
                  tokens each from both models; the score of a prompt is the number of tokens equal before the
                  first divergence over ``continuation``; the figure is the mean over prompts (1.0 = identical).
  max_logit_diff  the largest |candidate logit - baseline logit| over every teacher-forced position and
                  vocabulary entry (float32 logits).

A model whose parameters are on a mesh (``dantinox.parallel.sharding.shard_model``) is measured on that mesh: its
teacher-forced calls run with the mesh in scope, so the cache is split as ``dantinox.parallel.sharding.cache_specs``
says, and the greedy prompts run through ``generate_result``, which does the same.

Shape letters: B windows per batch, S window length (max_context), P prefix, V vocabulary, N stream tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..generation.decode import generate_result
from ..model.cache import init_cache
from ..parallel.distributed import to_host
from ..parallel.mesh import mesh_of, mesh_scope


class SliceQuality(NamedTuple):
    """Figures of one slice. loss: (baseline, candidate) nats/char; agreement: candidate's mean agreement
    with the baseline in [0, 1]; max_logit_diff: float; tokens: scored tokens; chars: characters they encode."""

    loss: tuple
    agreement: float
    max_logit_diff: float
    tokens: int
    chars: int


@partial(jax.jit, static_argnames=("graphdef", "prefix"))
def teacher_forced_logits(graphdef, params, ids, prefix: int):
    """Logits predicting ids[:, 1:], prefill of ``prefix`` tokens then one cached step per token.

    ids: [B, S] int32 with P = prefix < S. Returns [B, S - 1, V] float32: row t predicts ids[:, t + 1].
    """
    model = nnx.merge(graphdef, params)
    B, S = ids.shape
    cache = init_cache(model.cfg, B)
    logits, cache, _ = model(ids[:, :prefix], use_cache=True, kv_caches=cache, cache_index=0)

    def step(cache, t):
        token = jax.lax.dynamic_slice_in_dim(ids, t, 1, axis=1)
        out, cache, _ = model(token, use_cache=True, kv_caches=cache, cache_index=jnp.full((B,), t, jnp.int32))
        return cache, out[:, 0]

    _, rest = jax.lax.scan(step, cache, jnp.arange(prefix, S - 1, dtype=jnp.int32))
    return jnp.concatenate([logits, jnp.moveaxis(rest, 0, 1)], axis=1)


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


def _batches(ids: np.ndarray, length: int, batch: int):
    """Yield (window ids [batch, length] int32, score mask [batch, length - 1] bool) covering the stream."""
    n = len(ids)
    if n < length:  # one short window, padded with token 0 and masked
        ids = np.concatenate([ids, np.zeros(length - n, ids.dtype)])
        starts, mask = np.zeros(1, int), np.arange(length - 1)[None] < n - 1
    else:
        starts, mask = windows(n, length)
    for first in range(0, len(starts), batch):
        rows = np.stack([ids[s:s + length] for s in starts[first:first + batch]])
        m = mask[first:first + batch]
        pad = batch - len(rows)
        yield (np.concatenate([rows, np.zeros((pad, length), rows.dtype)]).astype(np.int32),
               np.concatenate([m, np.zeros((pad, length - 1), bool)]))


def batch_count(n_tokens: int, length: int, batch: int) -> int:
    """Number of batches ``slice_quality`` runs for a stream of n_tokens (for a progress bar)."""
    return 1 if n_tokens < length else -(-len(windows(n_tokens, length)[0]) // batch)


def _nll(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """Summed -log p(target) over masked positions. logits [B, S-1, V], targets/mask [B, S-1]."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(((logz - picked) * mask).sum())


def teacher_forced(baseline, candidate, ids: np.ndarray, prefix: int, batch: int,
                   tick: Callable[[], None] = lambda: None) -> tuple[float, float, float]:
    """(baseline summed NLL, candidate summed NLL, largest |logit diff|) over the stream ids [N] (nats).
    Each model runs on the mesh its parameters are on (``dantinox.parallel.mesh.mesh_of``), or on one device."""
    S = baseline.cfg.max_context
    split = [nnx.split(m) for m in (baseline, candidate)]
    nll = [0.0, 0.0]
    diff = 0.0
    for rows, mask in _batches(np.asarray(ids), S, batch):
        outs = [_logits_on_mesh(g, p, rows, prefix) for g, p in split]
        for i, out in enumerate(outs):
            nll[i] += _nll(out, rows[:, 1:], mask)
        diff = max(diff, float(np.abs(outs[0] - outs[1]).max(-1)[mask].max(initial=0.0)))
        tick()
    return nll[0], nll[1], diff


def _logits_on_mesh(graphdef, params, rows: np.ndarray, prefix: int) -> np.ndarray:
    """:func:`teacher_forced_logits` with the parameters' mesh in scope (none: one device), gathered
    to this host (``dantinox.parallel.distributed.to_host``: other processes' shards too)."""
    with mesh_scope(mesh_of(params)):
        return to_host(teacher_forced_logits(graphdef, params, jnp.asarray(rows), prefix))


def greedy_agreement(baseline, candidate, ids: np.ndarray, prompts: int, prompt_tokens: int,
                     continuation: int) -> float:
    """Mean over ``prompts`` evenly spaced prompts of (tokens equal before the first divergence) / continuation.

    ids: [N] stream; prompts start at offsets linspace(0, N - prompt_tokens, prompts) (deterministic).
    """
    offsets = np.linspace(0, len(ids) - prompt_tokens, prompts).astype(int)
    rows = np.stack([ids[o:o + prompt_tokens] for o in offsets]).astype(np.int32)
    out = [generate_result(m, rows, continuation, temperature=0.0).tokens for m in (baseline, candidate)]
    same = out[0] == out[1]
    prefix_equal = np.where(same.all(1), continuation, np.argmin(same, axis=1))
    return float(np.mean(prefix_equal / continuation))


def slice_quality(baseline, candidate, ids, chars: int, *, prefix: int = 64, batch: int = 8, prompts: int = 8,
                  prompt_tokens: int = 32, continuation: int = 32,
                  tick: Callable[[], None] = lambda: None) -> SliceQuality:
    """All figures of one slice (see the module docstring). ids: [N] int token stream; chars: characters of the
    scored text (the slice minus its first token). Raises ValueError when N < prefix + 2 or the prompts and
    continuation do not fit max_context."""
    ids = np.asarray(ids, np.int64)
    S = baseline.cfg.max_context
    if not 1 <= prefix < S - 1:
        raise ValueError(f"prefix={prefix} is not allowed: an integer in [1, max_context - 1 = {S - 1})")
    if len(ids) < prefix + 2:
        raise ValueError(f"the slice has {len(ids)} tokens, fewer than prefix + 2 = {prefix + 2}")
    if prompt_tokens + continuation > S:
        raise ValueError(f"prompt_tokens + continuation = {prompt_tokens + continuation} exceeds max_context={S}")
    nll_base, nll_cand, diff = teacher_forced(baseline, candidate, ids, prefix, batch, tick)
    agreement = greedy_agreement(baseline, candidate, ids, prompts, min(prompt_tokens, len(ids)), continuation)
    return SliceQuality((nll_base / chars, nll_cand / chars), agreement, diff, len(ids) - 1, chars)
