"""Prove the cache exact: cached logits equal uncached logits at every generated position.

``verify_cache`` prefills a prompt, decodes N greedy tokens one model call at a time through the static cache,
keeping every step's logits, then runs one plain causal forward (use_cache=False) over prompt + generated
tokens and compares the logits position by position: the prompt positions from prefill, and each decode step
against the reference at the same position. Shape letters: T tokens, V vocabulary.

With cache_dtype="int8" the reference is the uncached forward that round-trips every key/value row through
int8 the same way (``dantinox.kv.int8_rows``), so like is compared with like and the tolerance stays tight. Its
rows are computed by another matmul shape than the cached run's, so an element on a rounding boundary can
round to the neighbouring int8 step; the reference adopts exactly those flips (and last-bit scale
differences) from the cached run's final cache and counts them, and any other disagreement with the stored
rows is a cache fault that fails the check (``dantinox.quality.int8_reference``, ``VerifyReport.rounding_flips``).
That rule is a float32 one: with compute_dtype="bfloat16" the two runs' rows differ by bfloat16 rounding, far
beyond any boundary, so the reference is the plain uncached forward and the logits alone decide. Per-channel
int8 keys (cfg.channel_keys, ``dantinox.kv.channel_layout``) get the same treatment, their complete key
groups adopted per (group, channel) (``dantinox.quality.channel_reference``): the uncached forward runs the
same layout and read rule over the whole sequence in one call.
The report then also carries ``float_distance``, the largest |logit difference| between the int8 cached run
and a float32 cached run of the same parameters fed the same tokens (what int8 costs, not an exactness figure).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..generation.prompts import check_request, prepare_prompts
from ..kv.cache import init_cache
from ..parallel.mesh import mesh_of, mesh_scope
from ..parallel.sharding import shard_cache
from ..kv.spec import layer_specs
from ..quant.kv_dtype import with_config, with_kv_dtype
from .channel_reference import adopting_channel_layers
from .int8_reference import RoundingAudit, adopting_layers, audit


class VerifyReport(NamedTuple):
    """positions: [T] absolute positions compared; max_diff: [T] max |cached - uncached| over V per position; tokens:
    the generated ids; tolerance: [T] the difference allowed per position (see verify_cache); passed: max_diff
    <= tolerance everywhere and, for an int8 cache, no cache fault; float_distance: for an int8 cache, max |int8
    cached - float32 cached| logits over every position (None for float caches); rounding_flips: for an int8
    cache computed in float32, the RoundingAudit of what the reference adopted from the cache (rounding-boundary
    flips) and the faults it refused (None for float caches and compute_dtype="bfloat16")."""

    positions: np.ndarray
    max_diff: np.ndarray
    tokens: list
    tolerance: np.ndarray
    passed: bool
    float_distance: float | None = None
    rounding_flips: RoundingAudit | None = None

    def ranges(self, width: int = 16) -> list[tuple[int, int, float]]:
        """(first position, last position, largest difference) for consecutive ranges of ``width`` positions."""
        out = []
        for start in range(0, len(self.positions), width):
            part = slice(start, start + width)
            out.append((int(self.positions[part][0]), int(self.positions[part][-1]),
                        float(self.max_diff[part].max())))
        return out


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _step(graphdef, params, ids, cache, index):
    model = nnx.merge(graphdef, params)
    logits, cache, _ = model(ids, use_cache=True, kv_caches=cache, cache_index=index)
    return logits, cache


@partial(jax.jit, static_argnames=("graphdef",))
def _reference(graphdef, params, ids):
    model = nnx.merge(graphdef, params)
    return model(ids, use_cache=False)[0]


@partial(jax.jit, static_argnames=("graphdef",))
def _int8_reference(graphdef, params, ids, cache):
    """The uncached forward over ids [1, T] adopting the rounding-boundary flips of ``cache`` (the cached run's
    final int8 cache; ``dantinox.quality.int8_reference``). Returns (logits [1, T, V] float32, counts [5] int32)."""
    model = nnx.merge(graphdef, params)
    layers = (adopting_channel_layers(model.cfg, cache, ids.shape[1]) if model.cfg.channel_keys
              else adopting_layers(cache, ids.shape[1]))
    logits = model(ids, use_cache=True, kv_caches=layers, cache_index=0)[0]
    return logits, audit(layers)


def verify_cache(model, prompt_ids, new_tokens: int = 64, tolerance: float = 1e-4,
                 relative_tolerance: float = 0.0) -> VerifyReport:
    """Compare cached and uncached logits for one prompt and ``new_tokens`` greedy decode steps.

    prompt_ids: one prompt (sequence of ints). At each position the largest |cached - uncached| over V must be
    at most max(tolerance, relative_tolerance x the position's largest |uncached logit|): float32 rounding
    grows with the values rounded, so a model whose logits reach 20-30 (SmolLM2-135M: 1.1e-4 over 24
    positions, 1.3e-4 over 2047, from summation order alone) needs the relative term; the CLI uses 1e-5.
    Raises ValueError / CapacityError for a bad prompt or prompt_length + new_tokens > max_context, and
    ValueError for a paradigm="diffusion" model (it has no causal static cache to check).
    """
    cfg = model.cfg
    if cfg.paradigm != "ar":
        raise ValueError(f"verify checks the autoregressive static cache; this model has paradigm={cfg.paradigm!r}"
                         ": its DualCache is checked by diffusion generation with refresh='step' against "
                         "use_cache=False (dantinox generate --refresh step vs --no_cache; case K07 in the tests)")
    ids, lengths, _ = prepare_prompts(list(prompt_ids), cfg.vocab_size, cfg.max_context)
    check_request(lengths, new_tokens, cfg.max_context)
    n = int(lengths[0])
    graphdef, params = nnx.split(model)
    mesh = mesh_of(params)  # a model sharded with dantinox.parallel.sharding.shard_model is checked on its mesh
    with mesh_scope(mesh):
        cached, tokens, cache = _cached_run(graphdef, params, cfg, ids[0, :n], new_tokens, mesh=mesh)
        full = jnp.asarray(np.concatenate([ids[0, :n], tokens[:-1]]).astype(np.int32)[None])
        distance = flips = None
        if cfg.cache_dtype == "int8" and cfg.compute_dtype == "float32":
            if any(spec.ring for spec in layer_specs(cfg)):   # rings keep no position's rows for long: adopt the
                whole = cfg.replace(window_cache="full")      # flips from a full cache of the same run
                whole_graph, whole_params = nnx.split(with_config(model, whole))
                _, _, cache = _cached_run(whole_graph, whole_params, whole, ids[0, :n], new_tokens, forced=tokens,
                                          mesh=mesh)
            reference, counts = _int8_reference(graphdef, params, full, cache)
            flips = RoundingAudit(*(int(c) for c in np.asarray(counts)))
        else:
            reference = _reference(graphdef, params, full)
        if cfg.cache_dtype == "int8":
            float_graph, float_params = nnx.split(with_kv_dtype(model, "float32"))
            as_float, _, _ = _cached_run(float_graph, float_params, cfg.replace(cache_dtype="float32"),
                                         ids[0, :n], new_tokens, forced=tokens, mesh=mesh)
            distance = float(np.abs(cached - as_float).max())
        diff = np.abs(cached - np.asarray(reference[0])).max(axis=-1)
        allowed = np.maximum(tolerance, relative_tolerance * np.abs(np.asarray(reference[0])).max(axis=-1))
    passed = bool((diff <= allowed).all()) and (flips is None or flips.faults == 0)
    return VerifyReport(np.arange(len(diff)), diff, tokens, allowed, passed, distance, flips)


def _cached_run(graphdef, params, cfg, prompt: np.ndarray, new_tokens: int, forced: list | None = None,
                mesh=None):
    """Prefill ``prompt`` ([T] ids) and decode new_tokens - 1 steps through a static cache (sharded over
    ``mesh`` when given), one call each, feeding the greedy pick (or ``forced[i]`` at step i). Returns
    (logits [T + new_tokens - 1, V] float32, the greedy picks after each call, the final cache)."""
    n = len(prompt)
    cache = shard_cache(init_cache(cfg, 1), cfg, mesh)
    logits, cache = _step(graphdef, params, jnp.asarray(prompt[None], jnp.int32), cache, jnp.int32(0))
    cached = [np.asarray(logits[0])]
    tokens = [int(np.argmax(cached[-1][-1]))]
    for step in range(new_tokens - 1):
        feed = tokens[-1] if forced is None else forced[step]
        logits, cache = _step(graphdef, params, jnp.asarray([[feed]], jnp.int32), cache, jnp.int32(n + step))
        cached.append(np.asarray(logits[0]))
        tokens.append(int(np.argmax(cached[-1][-1])))
    return np.concatenate(cached, axis=0), tokens, cache
