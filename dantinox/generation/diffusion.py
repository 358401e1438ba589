"""Masked-diffusion generation (LLaDA) with a DualCache and threshold parallel decoding (Fast-dLLM).

Method: LLaDA (Nie et al. 2025, "Large Language Diffusion Models", section 2.4: block-wise semi-autoregressive
sampling with low-confidence remasking), with the DualCache and confidence-threshold parallel decoding of
Fast-dLLM (Wu et al. 2025, "Fast-dLLM", sections 3.2 and 3.3). The model is the ordinary
:class:`dantinox.Transformer` with ``paradigm="diffusion"`` (bidirectional attention); this module only calls
its forward, passing the cache context as per-layer objects with an ``attend_and_write`` hook (see
``dantinox.model.attention.Attention``), never its blocks.

Shape letters (new ones; the others are those of ``dantinox.model.layers``): P prompt slots (the longest prompt,
bucketed), M generated tokens (gen_len), W block size, N = P + M sequence slots.

Walkthrough of :func:`diffusion_generate`:
  1. Layout. Every row is ``[left padding | prompt | M x MASK]`` of N slots: prompts are left-padded to P so
     all rows' generation regions share slots P .. N-1. ``key_start[b] = P - len_b`` padding slots are never
     attended to and RoPE positions start at 0 at each row's first prompt token, so a row's output does not
     depend on the other rows (K07 (a)).
  2. Blocks of W slots are decoded left to right. Each denoising step predicts every MASK of the current
     block (greedy, or Gumbel-max sampling at ``temperature``), scores it by the probability of its
     prediction, and commits the most confident ones (low-confidence remasking): W // steps_per_block per
     step, or, with ``threshold``, every MASK whose confidence exceeds it and always at least the most
     confident one (the block then ends when it holds no MASK, after at most W steps). With
     ``cfg.shifted_prediction`` (models adapted from an AR model) slot i is predicted by the output at slot
     i - 1, so a cached step runs the block's W slots and the one before them.
  3. Cache. ``DualCache(prefix_kvs, suffix_kvs)`` holds per layer the keys and values of the prompt slots
     ([B, K, P, D]) and of the generation region ([B, K, M, D]: decoded blocks and the MASK suffix). Within a
     block only the block's W positions run through the model; they attend to the cached prefix, to the
     cached generation region except the block's own slots, and to their own fresh keys and values (one key
     set: the steps work on a copy of the cache joined to [B, K, N, D] at the block's start, whose block
     slots each step overwrites with the fresh keys and values, in place; see StepView). The DualCache is
     not written during the steps of a block. Refresh policies, at the start of each block:
       - ``"block"``: one forward over all N slots recomputes prefix and suffix (Fast-dLLM's reference code);
         a committed block's KV is therefore never stale;
       - ``"prompt_once"``: the prompt's KV is computed once per generation (the first block's full forward)
         and kept; later blocks run only the M generation slots, attending to the kept prompt KV, to refresh
         decoded blocks and the suffix (the seeds' description; faster, slightly approximate because in a
         bidirectional model the prompt's KV would change as the generation region is filled in);
       - ``"step"``: like "block" but before every step; its output equals ``use_cache=False`` (K07 (b)) and
         it exists to verify the cache path, not for speed.
     ``use_cache=False`` runs the full N-slot forward at every step.
  4. Compilation: the per-block functions take the block start, sampling settings and step bounds as traced
     values, so nothing recompiles across blocks, steps, or prompts of the same bucket (and batch size).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kv.attend import NEG_INF
from ..kv.scores import grouped_scores, grouped_values
from ..kv.sizes import cache_bytes
from ..kv.static import CapacityError, LayerKV
from .prompts import bucket_length, prepare_prompts
from .sampling import temperature_problem

REFRESH_POLICIES = ("block", "prompt_once", "step")


class DualCache(NamedTuple):
    """The two-part diffusion cache (a pytree). Per layer LayerKV(k, v) in cfg.cache_dtype:

    prefix_kvs: tuple of [B, K, P, D]: the prompt slots (computed once under refresh="prompt_once").
    suffix_kvs: tuple of [B, K, M, D]: the generation region (decoded blocks and remaining MASK tokens),
      refreshed at the start of every block.
    """

    prefix_kvs: tuple
    suffix_kvs: tuple


class DiffusionResult(NamedTuple):
    """tokens: [B, M] int32 generated tokens; forward_calls: model forwards run (all kinds);
    prefix_computations: forwards that (re)computed the prompt's KV; steps: denoising steps per block [n]."""

    tokens: np.ndarray
    forward_calls: int
    prefix_computations: int
    steps: list


def dual_cache_shapes(cfg, batch_size: int, prompt_slots: int, gen_len: int):
    """(prefix [B, K, P, D], suffix [B, K, M, D]) array shapes of one layer's keys (values alike)."""
    return ((batch_size, cfg.kv_heads, prompt_slots, cfg.head_size),
            (batch_size, cfg.kv_heads, gen_len, cfg.head_size))


def init_dual_cache(cfg, batch_size: int, prompt_slots: int, gen_len: int) -> DualCache:
    """Allocate a DualCache of zeros in cfg.cache_dtype (see DualCache for the shapes)."""
    pre, suf = dual_cache_shapes(cfg, batch_size, prompt_slots, gen_len)
    z = lambda shape: jnp.zeros(shape, cfg.jnp_cache_dtype)  # noqa: E731
    n = cfg.num_blocks
    return DualCache(tuple(LayerKV(z(pre), z(pre)) for _ in range(n)),
                     tuple(LayerKV(z(suf), z(suf)) for _ in range(n)))


@jax.tree_util.register_pytree_node_class
class DualView:
    """One layer's DualCache as the model's attention sees it (the ``attend_and_write`` hook).

    mode (static): "full" (the call covers all N slots: attend among them, store their KV as prefix and
    suffix), "suffix" (the call covers the M generation slots: attend to the prefix and to themselves,
    store their KV as suffix). The denoising steps of a block use :class:`StepView` instead.
    """

    def __init__(self, prefix: LayerKV, suffix: LayerKV, mode: str):
        self.prefix, self.suffix, self.mode = prefix, suffix, mode

    def tree_flatten(self):
        return (self.prefix, self.suffix), self.mode

    @classmethod
    def tree_unflatten(cls, mode, children):
        return cls(*children, mode)

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None):
        """q: [B, K, G, T, D] (scaled); k, v: [B, K, T, D]; cache_index, key_start: [B] int32.
        Returns (y [B, K, G, T, D] float32, the updated DualView)."""
        P, T = self.prefix.k.shape[2], k.shape[2]
        ks = key_start[:, None, None]
        if self.mode == "full":
            y = _attend_segments(q, [(k, v, jnp.arange(T)[None, None] >= ks)])
            dt = self.prefix.k.dtype
            return y, DualView(LayerKV(k[:, :, :P].astype(dt), v[:, :, :P].astype(dt)),
                               LayerKV(k[:, :, P:].astype(dt), v[:, :, P:].astype(dt)), self.mode)
        prefix_ok = jnp.arange(P)[None, None] >= ks                                    # [B, 1, P]
        y = _attend_segments(q, [(self.prefix.k, self.prefix.v, prefix_ok), (k, v, jnp.ones((1, 1, T), bool))])
        dt = self.suffix.k.dtype
        return y, DualView(self.prefix, LayerKV(k.astype(dt), v.astype(dt)), self.mode)


@jax.tree_util.register_pytree_node_class
class StepView:
    """One layer's cache during the denoising steps of a block (the ``attend_and_write`` hook).

    kv: LayerKV of [B, K, N, D], the DualCache's prefix and suffix joined into one key set (built once per
    block). A step's call covers T slots at cache_index (the block and, with shifted_prediction, the slot
    before it; every row shares that start): their fresh keys and values overwrite those slots, then the
    queries attend to all N slots except left padding, one softmax over one key set. The overwrite happens
    in the loop-carried copy, in place; those slots are rewritten by every step before being read, and the
    DualCache itself is never written during the steps.
    """

    def __init__(self, kv: LayerKV):
        self.kv = kv

    def tree_flatten(self):
        return (self.kv,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None):
        """q: [B, K, G, T, D] (scaled); k, v: [B, K, T, D]; cache_index, key_start: [B] int32.
        Returns (y [B, K, G, T, D] float32, the StepView with the T slots overwritten)."""
        dt, start = self.kv.k.dtype, cache_index[0]
        keys = jax.lax.dynamic_update_slice_in_dim(self.kv.k, k.astype(dt), start, axis=2)
        values = jax.lax.dynamic_update_slice_in_dim(self.kv.v, v.astype(dt), start, axis=2)
        visible = jnp.arange(keys.shape[2])[None, None] >= key_start[:, None, None]      # [B, 1, N]
        return _attend_segments(q, [(keys, values, visible)]), StepView(LayerKV(keys, values))


def _attend_segments(q, segments):
    """Softmax attention of q [B, K, G, T, D] over the concatenation of key segments, in float32.

    segments: list of (k [B, K, S_i, D], v [B, K, S_i, D], visible [B or 1, 1 or T, S_i] bool).
    Returns [B, K, G, T, D] float32.
    """
    scores = [jnp.where(ok[:, None, None], grouped_scores(q, k.astype(q.dtype)), NEG_INF)
              for k, _, ok in segments]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    y, offset = 0.0, 0
    for k, v, _ in segments:
        S = k.shape[2]
        y = y + grouped_values(probs[..., offset:offset + S], v.astype(jnp.float32))
        offset += S
    return y


def _views(cache: DualCache, mode: str) -> tuple:
    return tuple(DualView(p, s, mode) for p, s in zip(cache.prefix_kvs, cache.suffix_kvs))


def _dual(views) -> DualCache:
    return DualCache(tuple(v.prefix for v in views), tuple(v.suffix for v in views))


def _joined(cache: DualCache) -> tuple:
    """Per layer StepView(LayerKV [B, K, N, D]): prefix and suffix slots as one key set."""
    return tuple(StepView(LayerKV(jnp.concatenate([p.k, s.k], axis=2), jnp.concatenate([p.v, s.v], axis=2)))
                 for p, s in zip(cache.prefix_kvs, cache.suffix_kvs))


# Forwards (each one call of the model's own __call__) ------------------------------------------------------

def _full_forward(model, x, cache, key_start):
    """All N slots; returns (logits [B, N, V], DualCache with fresh prefix and suffix)."""
    logits, views, _ = model(x, use_cache=True, kv_caches=_views(cache, "full"), cache_index=0,
                             key_start=key_start)
    return logits, _dual(views)


def _suffix_forward(model, x, cache, key_start):
    """The M generation slots over the kept prefix; returns (logits [B, M, V], DualCache with a new suffix)."""
    P = cache.prefix_kvs[0].k.shape[2]
    logits, views, _ = model(x[:, P:], use_cache=True, kv_caches=_views(cache, "suffix"), cache_index=P,
                             key_start=key_start)
    return logits, _dual(views)


def _shift(model) -> int:
    """1 when token i is predicted at position i - 1 (cfg.shifted_prediction), else 0."""
    return int(model.cfg.shifted_prediction)


def _block_forward(model, x, views, start, key_start, W: int):
    """The W block slots at `start` (and, with a shift, the slot before) over the joined cache (StepViews);
    returns (the block's logits [B, W, V], the StepViews with those slots overwritten)."""
    s = _shift(model)
    ids = jax.lax.dynamic_slice_in_dim(x, start - s, W + s, axis=1)
    logits, views, _ = model(ids, use_cache=True, kv_caches=views, cache_index=start - s, key_start=key_start)
    return logits[:, :W], views


def _nocache_forward(model, x, start, key_start, W: int):
    """The plain bidirectional forward over all N slots; returns the block's logits [B, W, V]."""
    logits, _, _ = model(x, use_cache=False, key_start=key_start)
    return jax.lax.dynamic_slice_in_dim(logits, start - _shift(model), W, axis=1)


@partial(jax.jit, static_argnames=("graphdef", "block_size", "full"))
def _refresh(graphdef, params, x, cache, start, key_start, *, block_size: int, full: bool):
    """Block-start refresh: (block logits [B, W, V], refreshed DualCache). full: prefix too (else suffix)."""
    model = nnx.merge(graphdef, params)
    first = start - _shift(model)  # the output slot that predicts the block's first token
    if full:
        logits, cache = _full_forward(model, x, cache, key_start)
        return jax.lax.dynamic_slice_in_dim(logits, first, block_size, axis=1), cache
    logits, cache = _suffix_forward(model, x, cache, key_start)  # only after block 0, so first >= P
    P = cache.prefix_kvs[0].k.shape[2]
    return jax.lax.dynamic_slice_in_dim(logits, first - P, block_size, axis=1), cache


@partial(jax.jit, static_argnames=("graphdef", "block_size"))
def _first_logits_nocache(graphdef, params, x, start, key_start, *, block_size: int):
    return _nocache_forward(nnx.merge(graphdef, params), x, start, key_start, block_size)


THRESHOLD_TOLERANCE = 1e-6  # float32 rounding allowance at the confidence threshold (the K09 class)


# One denoising step -----------------------------------------------------------------------------------------

def _commit(x, logits, start, settings: "_Settings", key):
    """Low-confidence remasking on the block at `start`: commit the most confident predictions.

    x: [B, N] int32; logits: [B, W, V] float32. Returns the new x.
    """
    B, W, V = logits.shape
    block = jax.lax.dynamic_slice_in_dim(x, start, W, axis=1)                        # [B, W]
    masked = block == settings.mask_id
    logits = jnp.where(jnp.arange(V) == settings.mask_id, NEG_INF, logits)          # never predict MASK

    def sample(logits):  # Gumbel-max; drawn only when sampling (the noise costs as much as the rest)
        noisy = logits / jnp.maximum(settings.temperature, 1e-6) + jax.random.gumbel(key, logits.shape)
        return jnp.argmax(noisy, -1)

    pred = jax.lax.cond(settings.temperature > 0, sample, lambda lg: jnp.argmax(lg, -1), logits)
    conf = jnp.exp(jnp.take_along_axis(logits, pred[..., None], -1)[..., 0] - jax.nn.logsumexp(logits, -1))
    conf = jnp.where(masked, conf, -1.0)
    rank = jnp.argsort(jnp.argsort(-conf, axis=-1, stable=True), axis=-1, stable=True)  # 0 = most confident
    # strictly above the threshold, with a float32 allowance so a confidence equal to it never rounds over
    commit = masked & ((rank < settings.per_step) | (conf > settings.threshold + THRESHOLD_TOLERANCE))
    return jax.lax.dynamic_update_slice_in_dim(x, jnp.where(commit, pred, block), start, axis=1)


class _Settings(NamedTuple):
    """Traced per-call settings (changing them compiles nothing)."""

    mask_id: jax.Array      # [] int32
    per_step: jax.Array     # [] int32: tokens committed per step (1 with a threshold: "at least one")
    threshold: jax.Array    # [] float32: confidence threshold (2.0 = off)
    temperature: jax.Array  # [] float32: 0 = greedy
    max_steps: jax.Array    # [] int32: step bound per block


class _BlockState(NamedTuple):
    step: jax.Array      # [] int32: steps run in this block
    x: jax.Array         # [B, N] int32: the sequence
    logits: jax.Array    # [B, W, V] float32: block logits for the current x
    views: tuple         # per layer StepView (None without a cache): the block-start cache joined
    calls: jax.Array     # [] int32: model forwards run in this block
    prefix: jax.Array    # [] int32: forwards that recomputed the prompt's KV


@partial(jax.jit, static_argnames=("graphdef", "mode"))
def _denoise_block(graphdef, params, x, cache, logits, start, key_start, settings: _Settings, key, *, mode: str):
    """Run the denoising steps of one block (a lax.while_loop); returns the final _BlockState.

    mode: "nocache" (full forward per step), "dual" (block forward over the DualCache), "step" (full refresh,
    then the block forward over it). x: [B, N]; logits: [B, W, V] for the block of x at `start`.
    """
    model = nnx.merge(graphdef, params)
    W = logits.shape[1]

    def any_masked(x):
        return jnp.any(jax.lax.dynamic_slice_in_dim(x, start, W, axis=1) == settings.mask_id)

    def next_logits(x, views):
        one, zero = jnp.int32(1), jnp.int32(0)
        if mode == "nocache":
            return _nocache_forward(model, x, start, key_start, W), views, one, zero
        if mode == "step":
            views = _joined(_full_forward(model, x, cache, key_start)[1])
            return *_block_forward(model, x, views, start, key_start, W), 2 * one, one
        return *_block_forward(model, x, views, start, key_start, W), one, zero

    def body(s: _BlockState):
        x = _commit(s.x, s.logits, start, settings, jax.random.fold_in(key, s.step))
        logits, views, calls, prefix = jax.lax.cond(
            any_masked(x), next_logits, lambda x, v: (s.logits, v, jnp.int32(0), jnp.int32(0)), x, s.views)
        return _BlockState(s.step + 1, x, logits, views, s.calls + calls, s.prefix + prefix)

    def cond(s: _BlockState):
        return (s.step < settings.max_steps) & any_masked(s.x)

    zero = jnp.int32(0)
    views = None if mode == "nocache" else _joined(cache)
    return jax.lax.while_loop(cond, body, _BlockState(zero, x, logits, views, zero, zero))


# The host driver ----------------------------------------------------------------------------------------------

def check_diffusion_request(cfg, longest_prompt: int, gen_len, block_size, steps_per_block, threshold,
                            temperature, refresh) -> None:
    """Raise ValueError (or CapacityError for the length) naming the argument, its value and what is allowed."""
    if cfg.paradigm != "diffusion":
        raise ValueError(f"diffusion generation needs a model with paradigm='diffusion'; this one has "
                         f"paradigm={cfg.paradigm!r} (use dantinox.generate)")
    if cfg.mask_token_id is None:
        raise ValueError("ModelConfig.mask_token_id is None: the model has no MASK token (train it with "
                         "`dantinox train`, which appends <mask> to the tokenizer and sets it)")
    for name, value in (("gen_len", gen_len), ("block_size", block_size), ("steps_per_block", steps_per_block)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: an integer >= 1")
    if gen_len % block_size:
        raise ValueError(f"gen_len={gen_len} is not allowed: a multiple of block_size={block_size}")
    if block_size % steps_per_block:
        raise ValueError(f"steps_per_block={steps_per_block} is not allowed: a divisor of block_size="
                         f"{block_size}")
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 < threshold <= 1.0):
        raise ValueError(f"threshold={threshold!r} is not allowed: None or a number in (0, 1]")
    problem = temperature_problem(temperature)
    if problem is not None:
        raise ValueError(f"temperature={temperature!r} is not allowed: {problem}")
    if refresh not in REFRESH_POLICIES:
        raise ValueError(f"refresh={refresh!r} is not allowed: one of {REFRESH_POLICIES}")
    if longest_prompt + gen_len > cfg.max_context:
        raise CapacityError(f"prompt of {longest_prompt} tokens + gen_len={gen_len} = {longest_prompt + gen_len}"
                            f" exceeds max_context={cfg.max_context}")


def layout(prompt_ids, cfg, gen_len: int):
    """Left-pad prompts to P slots and append M MASK tokens.

    Returns (x [B, N] int32, key_start [B] int32 (padding slots per row), P, was_single_prompt).
    P = the prompt bucket (dantinox.generation.prompts.bucket_length), capped so that P + M <= max_context.
    """
    ids, lengths, single = prepare_prompts(prompt_ids, cfg.vocab_size, cfg.max_context)
    longest = int(lengths.max())
    P = min(bucket_length(longest, cfg.max_context), cfg.max_context - gen_len)
    x = np.full((len(ids), P + gen_len), cfg.mask_token_id, np.int32)
    x[:, :P] = 0
    for b, n in enumerate(lengths):
        x[b, P - n:P] = ids[b, :n]
    return x, (P - lengths).astype(np.int32), P, single


def diffusion_generate_result(model, prompt_ids, gen_len: int = 64, block_size: int = 32,
                              steps_per_block: int | None = None, *, threshold: float | None = None,
                              temperature: float = 0.0, use_cache: bool = True, refresh: str = "block",
                              seed: int = 0, on_block: Callable | None = None) -> DiffusionResult:
    """Like :func:`diffusion_generate` but always batched, with forward counts.

    on_block: optional callback ``on_block(n, x [B, N], cache)`` called after block n's refresh, before its
      steps (cache is None without use_cache); for inspection in tests.
    """
    cfg = model.cfg
    steps_per_block = block_size if steps_per_block is None else steps_per_block
    lengths = prepare_prompts(prompt_ids, cfg.vocab_size, cfg.max_context)[1]
    check_diffusion_request(cfg, int(lengths.max()), gen_len, block_size, steps_per_block, threshold,
                            temperature, refresh)
    x, key_start, P, _ = layout(prompt_ids, cfg, gen_len)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} is not allowed: an integer in [0, 2**32)")
    settings = _Settings(jnp.int32(cfg.mask_token_id),
                         jnp.int32(block_size // steps_per_block if threshold is None else 1),
                         jnp.float32(2.0 if threshold is None else threshold), jnp.float32(temperature),
                         jnp.int32(steps_per_block if threshold is None else block_size))
    graphdef, params = nnx.split(model)
    x, key_start = jnp.asarray(x), jnp.asarray(key_start)
    cache = init_dual_cache(cfg, x.shape[0], P, gen_len) if use_cache else None
    mode = "nocache" if not use_cache else ("step" if refresh == "step" else "dual")
    key = jax.random.key(np.uint32(seed))
    calls = prefix = 0
    steps = []
    for n in range(gen_len // block_size):
        start = jnp.int32(P + n * block_size)
        if not use_cache:
            logits = _first_logits_nocache(graphdef, params, x, start, key_start, block_size=block_size)
        else:
            full = refresh != "prompt_once" or n == 0
            logits, cache = _refresh(graphdef, params, x, cache, start, key_start, block_size=block_size,
                                     full=full)
            prefix += int(full)
        calls += 1
        if on_block is not None:
            on_block(n, x, cache)
        state = _denoise_block(graphdef, params, x, cache, logits, start, key_start, settings,
                               jax.random.fold_in(key, n), mode=mode)
        x = state.x
        calls, prefix = calls + int(state.calls), prefix + int(state.prefix)
        steps.append(int(state.step))
    return DiffusionResult(np.asarray(x)[:, P:], calls, prefix, steps)


def diffusion_generate(model, prompt_ids, gen_len: int = 64, block_size: int = 32,
                       steps_per_block: int | None = None, *, threshold: float | None = None,
                       temperature: float = 0.0, use_cache: bool = True, refresh: str = "block",
                       seed: int = 0) -> np.ndarray:
    """Generate gen_len tokens after each prompt with a masked-diffusion model (see the module docstring).

    Args:
      model: a Transformer with paradigm="diffusion" and a resolved mask_token_id.
      prompt_ids: one prompt (sequence of token ids) or a batch (list of sequences of any lengths, or [B, T]).
      gen_len: M new tokens per row, a multiple of block_size; longest prompt + M <= max_context.
      block_size: W tokens per block, decoded left to right.
      steps_per_block: denoising steps per block, dividing W (default W: one token per step); each step
        commits W // steps_per_block tokens. Ignored with ``threshold`` (then a block runs until it holds no
        MASK, at most W steps).
      threshold: None, or a confidence in (0, 1]: each step commits every MASK whose predicted token has
        probability above it, and at least the most confident one (Fast-dLLM section 3.3).
      temperature: 0 = greedy (ties to the lowest id); > 0 samples each prediction with Gumbel-max at that
        temperature (rows draw different noise, so sampled rows depend on their batch index).
      use_cache: True uses the DualCache; False recomputes all N slots at every step.
      refresh: "block" (recompute prompt, decoded blocks and suffix KV at every block), "prompt_once"
        (prompt KV once per generation), or "step" (recompute before every step; equals use_cache=False).
      seed: integer in [0, 2**32) for sampling.
    Returns:
      int32 array of new tokens: [M] for a single prompt, [B, M] for a batch.
    Raises:
      ValueError: an argument outside its allowed values (named with the value and what is allowed), an AR
        model, a model without mask_token_id, bad prompts (see dantinox.generation.prompts.prepare_prompts).
      CapacityError: longest prompt + gen_len > max_context.
    """
    result = diffusion_generate_result(model, prompt_ids, gen_len, block_size, steps_per_block,
                                       threshold=threshold, temperature=temperature, use_cache=use_cache,
                                       refresh=refresh, seed=seed)
    single = prepare_prompts(prompt_ids, model.cfg.vocab_size, model.cfg.max_context)[2]
    return result.tokens[0] if single else result.tokens


# Memory accounting -------------------------------------------------------------------------------------------

def prompt_slots(cfg, prompt_len: int, gen_len: int) -> int:
    """P, the prompt slots a generation allocates: the prompt bucket, capped so that P + gen_len <= S."""
    return min(bucket_length(prompt_len, cfg.max_context), cfg.max_context - gen_len)


def dual_cache_bytes(cfg, prompt_len: int, gen_len: int, batch_size: int = 1) -> int:
    """Bytes of the DualCache that :func:`diffusion_generate` allocates (and holds at its peak) for prompts of
    up to prompt_len tokens: the float cache of B sequences of P + M slots (prefix and suffix;
    ``dantinox.kv.sizes.cache_bytes``), P = prompt_slots(...).

    The transient keys and values of the W block positions inside one forward are activations, not counted.
    Raises CapacityError if prompt_len + gen_len > max_context.
    """
    if prompt_len + gen_len > cfg.max_context:
        raise CapacityError(f"prompt_len={prompt_len} + gen_len={gen_len} exceeds max_context={cfg.max_context}")
    P = prompt_slots(cfg, prompt_len, gen_len)
    return cache_bytes(cfg, batch_size, P + gen_len)
