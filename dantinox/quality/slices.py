"""Quality of a model variant on one text slice, measured through the cache path under test.

``slice_quality(baseline, candidate, ids, ...)`` returns, for one slice's token ids, the three figures of
``dantinox eval`` for the baseline and the candidate model (same tokenizer, same shape; the candidate may hold a
quantized cache or quantized weights):

  loss            teacher-forced cross-entropy in nats per character, every token but the first predicted
                  exactly once, through the cache: windows of the stream's length rounded up to a power of two
                  (at most max_context), a prefill of ``prefix`` tokens, then chunks of ``chunk`` tokens fed at
                  their slots (``dantinox.quality.teacher_forcing`` has the details and why).
  agreement       greedy continuation agreement with the baseline: ``prompts`` prompts of ``prompt_tokens``
                  tokens taken at evenly spaced offsets of the stream (deterministic), ``continuation`` greedy
                  tokens each from both models; the score of a prompt is the number of tokens equal before the
                  first divergence over ``continuation``; the figure is the mean over prompts (1.0 = identical).
  max_logit_diff  the largest |candidate logit - baseline logit| over every teacher-forced position and
                  vocabulary entry (float32 logits).

A model whose parameters are on a mesh (``dantinox.parallel.sharding.shard_model``) is measured on that mesh: its
teacher-forced calls run with the mesh in scope, so the cache is split as ``dantinox.parallel.sharding.cache_specs``
says, and the greedy prompts decode through a cache of prompt + continuation slots on the same mesh.

The candidate runs on its own cache (its config's cache dtype and sinks), or with key_group > 0 on per-channel
int8 keys (KIVI, ``dantinox.quality.channel_keys``).

Shape letters: B rows, T prompt tokens, V vocabulary, N stream tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..parallel.distributed import to_host
from ..parallel.mesh import mesh_of, mesh_scope
from .teacher_forcing import CacheSpec, batch_count, context_cap, new_cache, teacher_forced, windows

__all__ = ["SliceQuality", "batch_count", "greedy_agreement", "slice_quality", "teacher_forced", "windows"]


class SliceQuality(NamedTuple):
    """Figures of one slice. loss: (baseline, candidate) nats/char; agreement: candidate's mean agreement
    with the baseline in [0, 1]; max_logit_diff: float; tokens: scored tokens; chars: characters they encode."""

    loss: tuple
    agreement: float
    max_logit_diff: float
    tokens: int
    chars: int


@partial(jax.jit, static_argnames=("graphdef", "spec", "steps"))
def greedy_tokens(graphdef, params, prompts, spec: CacheSpec, steps: int):
    """``steps`` greedy tokens per prompt through a fresh cache of ``spec``: prompts [B, T] int32 -> [B, steps]
    int32 (argmax of each step's logits; the first from the prompt's last position)."""
    model = nnx.merge(graphdef, params)
    B, T = prompts.shape
    logits, cache, _ = model(prompts, use_cache=True, kv_caches=new_cache(model, B, spec), cache_index=0)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def step(carry, t):
        cache, token = carry
        out, cache, _ = model(token[:, None], use_cache=True, kv_caches=cache, cache_index=jnp.full((B,), t))
        token = jnp.argmax(out[:, 0], axis=-1).astype(jnp.int32)
        return (cache, token), token

    _, rest = jax.lax.scan(step, (cache, first), jnp.arange(T, T + steps - 1, dtype=jnp.int32))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def greedy_agreement(baseline, candidate, ids: np.ndarray, prompts: int, prompt_tokens: int,
                     continuation: int, key_group: int = 0) -> float:
    """Mean over ``prompts`` evenly spaced prompts of (tokens equal before the first divergence) / continuation.

    ids: [N] stream; prompts start at offsets linspace(0, N - prompt_tokens, prompts) (deterministic). Both
    models decode through caches of prompt_tokens + continuation - 1 slots (the candidate's per-channel key
    view when key_group > 0), on the mesh of their parameters.
    """
    offsets = np.linspace(0, len(ids) - prompt_tokens, prompts).astype(int)
    rows = jnp.asarray(np.stack([ids[o:o + prompt_tokens] for o in offsets]).astype(np.int32))
    out = []
    for model, group in ((baseline, 0), (candidate, key_group)):
        graphdef, params = nnx.split(model)
        spec = CacheSpec(prompt_tokens + continuation - 1, group)
        with mesh_scope(mesh_of(params)):
            out.append(to_host(greedy_tokens(graphdef, params, rows, spec, continuation)))
    same = out[0] == out[1]
    prefix_equal = np.where(same.all(1), continuation, np.argmin(same, axis=1))
    return float(np.mean(prefix_equal / continuation))


def slice_quality(baseline, candidate, ids, chars: int, *, prefix: int = 64, batch: int = 8, prompts: int = 8,
                  prompt_tokens: int = 32, continuation: int = 32, chunk: int = 1, key_group: int = 0,
                  window: int | None = None, tick: Callable[[], None] = lambda: None) -> SliceQuality:
    """All figures of one slice (see the module docstring). ids: [N] int token stream; chars: characters of the
    scored text (the slice minus its first token); chunk: tokens per cached call after the prefix
    (``dantinox.quality.teacher_forcing``); key_group: G > 0 runs the candidate on per-channel int8 keys in groups
    of G (``dantinox.quality.channel_keys``); window: the longest teacher-forced window (None: max_context).
    Raises ValueError when N < prefix + 2, chunk < 1 or the prompts and
    continuation do not fit max_context."""
    ids = np.asarray(ids, np.int64)
    S = baseline.cfg.max_context
    S = context_cap(S, window)
    if not 1 <= prefix < S - 1:
        raise ValueError(f"prefix={prefix} is not allowed: an integer in [1, window - 1 = {S - 1}) "
                         "(window: max_context or --window)")
    if len(ids) < prefix + 2:
        raise ValueError(f"the slice has {len(ids)} tokens, fewer than prefix + 2 = {prefix + 2}")
    if prompt_tokens + continuation > S:
        raise ValueError(f"prompt_tokens + continuation = {prompt_tokens + continuation} exceeds max_context={S}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is not allowed: an integer >= 1")
    nll_base, nll_cand, diff = teacher_forced(baseline, candidate, ids, prefix, batch, chunk, key_group, window, tick)
    agreement = greedy_agreement(baseline, candidate, ids, prompts, min(prompt_tokens, len(ids)), continuation,
                                 key_group)
    return SliceQuality((nll_base / chars, nll_cand / chars), agreement, diff, len(ids) - 1, chars)
