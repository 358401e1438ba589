"""Prove the cache exact: cached logits equal uncached logits at every generated position.

``verify_cache`` prefills a prompt, decodes N greedy tokens one model call at a time through the static cache,
keeping every step's logits, then runs one plain causal forward (use_cache=False) over prompt + generated
tokens and compares the logits position by position: the prompt positions from prefill, and each decode step
against the reference at the same position. Shape letters: T tokens, V vocabulary.

With cache_dtype="int8" the reference is the uncached forward that round-trips every key/value row through
int8 the same way (``dantinox.kv_quant``), so like is compared with like and the tolerance stays tight; the
report then also carries ``float_distance``, the largest |logit difference| between the int8 cached run and a
float32 cached run of the same parameters fed the same tokens (what int8 costs, not an exactness figure).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .cache import init_cache
from .generate import check_request, prepare_prompts
from .kv_dtype import with_kv_dtype


class VerifyReport(NamedTuple):
    """positions: [T] absolute positions compared; max_diff: [T] max |cached - uncached| over V per position;
    tokens: the generated ids; tolerance; passed; float_distance: for an int8 cache, max |int8 cached -
    float32 cached| logits over every position (None for float caches)."""

    positions: np.ndarray
    max_diff: np.ndarray
    tokens: list
    tolerance: float
    passed: bool
    float_distance: float | None = None

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


def verify_cache(model, prompt_ids, new_tokens: int = 64, tolerance: float = 1e-4) -> VerifyReport:
    """Compare cached and uncached logits for one prompt and ``new_tokens`` greedy decode steps.

    prompt_ids: one prompt (sequence of ints). tolerance: max |diff| allowed (float32 logits).
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
    cached, tokens = _cached_run(graphdef, params, cfg, ids[0, :n], new_tokens)
    full = np.concatenate([ids[0, :n], tokens[:-1]]).astype(np.int32)[None]
    reference = np.asarray(_reference(graphdef, params, jnp.asarray(full))[0])
    diff = np.abs(cached - reference).max(axis=-1)
    distance = None
    if cfg.cache_dtype == "int8":
        float_graph, float_params = nnx.split(with_kv_dtype(model, "float32"))
        as_float, _ = _cached_run(float_graph, float_params, cfg.replace(cache_dtype="float32"), ids[0, :n],
                                  new_tokens, forced=tokens)
        distance = float(np.abs(cached - as_float).max())
    return VerifyReport(np.arange(len(diff)), diff, tokens, tolerance, bool(diff.max() <= tolerance), distance)


def _cached_run(graphdef, params, cfg, prompt: np.ndarray, new_tokens: int, forced: list | None = None):
    """Prefill ``prompt`` ([T] ids) and decode new_tokens - 1 steps through a static cache, one call each,
    feeding the greedy pick (or ``forced[i]`` at step i). Returns (logits [T + new_tokens - 1, V] float32,
    the greedy picks after each call)."""
    n = len(prompt)
    logits, cache = _step(graphdef, params, jnp.asarray(prompt[None], jnp.int32), init_cache(cfg, 1),
                          jnp.int32(0))
    cached = [np.asarray(logits[0])]
    tokens = [int(np.argmax(cached[-1][-1]))]
    for step in range(new_tokens - 1):
        feed = tokens[-1] if forced is None else forced[step]
        logits, cache = _step(graphdef, params, jnp.asarray([[feed]], jnp.int32), cache, jnp.int32(n + step))
        cached.append(np.asarray(logits[0]))
        tokens.append(int(np.argmax(cached[-1][-1])))
    return np.concatenate(cached, axis=0), tokens
