"""Autoregressive generation through the static KV cache: prefill, a compiled decode loop, streaming.

Design:
  1. Prompts of different lengths are right-padded to a length bucket (a power of two >= 16, at most
     max_context), so prefill compiles once per (batch size, bucket). Each row keeps its own length, which is
     its first free cache slot; the padding written past it is never attended to and is overwritten by decode.
  2. ``prefill`` runs the model over the padded prompts at cache_index 0 and samples the first new token from
     each row's last real position. The cache it fills is made outside the call (``new_cache``) and donated,
     so its pages become resident only where slots are written (a long context costs what it holds).
  3. ``decode`` is one ``jax.jit`` holding a ``lax.while_loop`` per attention window (128, 256, ... slots
     for MLA, and for GQA / MQA batches; one window of S otherwise; see ``decode_windows``):
     it feeds each row's last token at that row's own slot, samples the next, attends over the first L
     slots of the cache while every row fits in them, and stops when every row has met EOS or the step
     bound is reached. The step bound, sampling settings, seed and EOS id are traced values, so changing
     them compiles nothing new; the decode loop compiles once per (batch size, model shape, dtype). The
     loop state (with the cache) is donated, so XLA updates it in place.
  4. Streaming calls the same compiled ``decode`` with a step bound a chunk further each time, pulling only the
     new tokens to the host between chunks.
  5. ``use_cache=False`` recomputes the whole sequence with the plain causal forward for every new token,
     over a window bucket that covers the current length (one compile per bucket used). It samples with the
     same per-step keys, so greedy output equals the cached path's.
Capacity: every row needs prompt_length + max_new_tokens <= max_context; this is checked before anything runs
(JAX would otherwise clamp an out-of-range cache write onto the last slot silently).
Shape letters: B batch, T prompt bucket, S max_context, V vocabulary.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kv.decode_kernel import kernel_available
from ..kv.spec import layer_specs
from ..kv.static import KVCache, first_slots
from ..kv.cache import init_cache
from ..kv.zero_pages import pages_available
from ..parallel.distributed import to_host
from ..parallel.mesh import mesh_of, mesh_scope
from ..parallel.sharding import shard_model
from ..programs.store import stored_jit
from .prompts import bucket_length, check_request, eos_array, is_eos, prepare_prompts
from .sampling import SamplingParams, make_sampling_params, sample_next


class DecodeState(NamedTuple):
    """Loop state of the compiled decode loop (a pytree carried by ``lax.while_loop``)."""

    step: jax.Array    # [] int32: tokens generated so far; out[:, :step] is filled
    token: jax.Array   # [B] int32: last generated token, not yet written to the cache
    index: jax.Array   # [B] int32: cache slot where `token` will be written
    done: jax.Array    # [B] bool: the row has produced its EOS
    out: jax.Array     # [B, S] int32: generated tokens; `fill` after a row's EOS
    cache: KVCache     # per layer cache pytree, see dantinox.kv.static


class GenerationResult(NamedTuple):
    """tokens: [B, N] int32 new tokens (after a row's EOS: eos_id); lengths: [B] tokens generated per row,
    EOS included; finish_reasons: "stop" (EOS) or "length" per row."""

    tokens: np.ndarray
    lengths: np.ndarray
    finish_reasons: list


@stored_jit(static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill(graphdef, params, ids, lengths, key, sampling: SamplingParams, eos_id, fill, cache=None):
    """Fill the static cache with the right-padded prompts and sample each row's first token.

    ids: [B, T] int32; lengths: [B] int32 real prompt lengths; key: PRNG key; eos_id: [] or [E] int32 stop
    ids (-1 = none; see ``is_eos``); fill: [] int32. cache: the empty static cache (``new_cache``: ``init_cache(cfg,
    B)``, [B, K, S, D] per layer), donated and written in place, so only the pages of the slots written become
    resident (SmolLM2, 8,192 slots, a 40-token prompt: 421 MiB resident after the prefill instead of 744, and
    the prefill 143-181 ms instead of 222-282, docs/explanation/performance.md "Host memory"); None allocates it inside
    this call, zero-filled (what ``new_cache`` gives on a mesh and where pages cannot be left to the OS).
    Returns the initial DecodeState (step 1).
    """
    model = nnx.merge(graphdef, params)
    if cache is None:
        cache = init_cache(model.cfg, ids.shape[0])
    logits, cache, _ = model(ids, use_cache=True, kv_caches=cache, cache_index=0, logits_at=lengths - 1,
                             valid_tokens=lengths)
    last = logits[:, 0]
    first = sample_next(last, jax.random.fold_in(key, 0), sampling)
    out = jnp.full((ids.shape[0], model.cfg.max_context), fill, jnp.int32).at[:, 0].set(first)
    return DecodeState(jnp.int32(1), first, lengths, is_eos(first, eos_id), out, cache)


def new_cache(cfg, batch_size: int, params) -> KVCache | None:
    """The empty static cache ``prefill`` fills for a batch of ``batch_size`` rows of the model whose
    parameters are ``params``: ``init_cache(cfg, B)`` allocated outside the call with its pages left to the
    operating system (``dantinox.kv.zero_pages``). None where that cannot be done, so prefill allocates the
    cache inside its call as before (zero-filled in one program instead of one dispatch per array): parameters
    on a mesh (the cache then takes the mesh's layout), no CPU backend or no compiled extension. With a
    bfloat16 cache XLA:CPU still rewrites the whole cache in the prefill (it widens each layer's cache to
    float32 around the update), so only float32 and int8 caches keep their unwritten pages. Raises ValueError
    for a batch size that is not a positive integer."""
    return init_cache(cfg, batch_size) if _cache_outside(params) else None


def cache_shapes(cfg, batch_size: int, params):
    """What ``new_cache`` returns, as jax.ShapeDtypeStructs (nothing allocated), for a warm-up; None where
    new_cache gives None."""
    return jax.eval_shape(partial(init_cache, cfg, batch_size)) if _cache_outside(params) else None


def _cache_outside(params) -> bool:
    """Whether prefill's cache is made outside the call (``new_cache``): one device and pages the OS provides."""
    return mesh_of(params) is None and pages_available()


_SPLITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def split_model(model):
    """``nnx.split(model)``, cached per model: (graphdef, state).

    nnx.split walks the whole module graph on every call, so the split is cached: it is reused while every
    parameter still holds the same array, which a check over the model's variables (far cheaper than the
    split) confirms; after any update (training, loading) it is redone. Measured costs: docs/explanation/performance.md,
    "Costs behind choices in the code".
    """
    entry = _SPLITS.get(model)
    if entry is not None and all(var.get_value() is value for var, value in entry[2]):
        return entry[0], entry[1]
    graphdef, state = nnx.split(model)
    variables = [(node, node.get_value()) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)]
    _SPLITS[model] = (graphdef, state, variables)
    return graphdef, state


WINDOW_STEP = 128
SINGLE_ROW_WINDOW = 512   # the smallest window of a one-row loop bounded by its request


def decode_windows(cfg, batch_size: int, bound: int | None = None) -> tuple[int, ...]:
    """Attention windows (tokens) of the decode loop for a ModelConfig, batch size B and the request's bound
    (the largest prompt length + max_new_tokens, in slots; None: unknown).

    The last window ("top") is max_context S when the bound is unknown or S <= 512, else the smallest of 512,
    1024, 2048, ... that holds ``bound`` slots (at most S): a short request on a long-context model (SmolLM2:
    S = 8192) never touches the cache past it, at the cost of one program per top used.
    B >= 2, or attention="mla": multiples of 128 up to 512, then doubling, ending at top, e.g. (128, 256, 384,
    512) for S = 512 (and (S,) for S <= 128). Each window's loop attends over the first L slots only, skipping
    the empty tail of the cache; ``decode`` cuts the window's slots out once when it begins (so windows past the
    bound, which no step would use, would cost a cut and a write-back of the cache's slots each: for SmolLM2 at
    B = 8 and S = 8192 up to 1.5 GB per window, which dominated a 256-token generation before the bound applied
    to batches).
    B = 1 (not MLA): the one window top, because each window is one more loop body to compile and a single row
    gains little from early windows. Any B when decode attention runs in the compiled kernel
    (``reads_only_filled_slots``): it reads each row's filled slots only, so early windows would save nothing.
    The measurements behind the rule are in docs/explanation/performance.md ("Attention windows");
    ``benchmarks/bench_decode.py --windows-ab`` repeats them on the reference shape.
    """
    S = cfg.max_context
    top = S
    if bound is not None and S > SINGLE_ROW_WINDOW:
        top = SINGLE_ROW_WINDOW
        while top < min(bound, S):
            top *= 2
        top = min(top, S)
    if cfg.attention != "mla" and (batch_size < 2 or reads_only_filled_slots(cfg)):
        return (top,)
    windows, width = [], WINDOW_STEP
    while width < top:
        windows.append(width)
        width = width + WINDOW_STEP if width < 4 * WINDOW_STEP else 2 * width
    return (*windows, top)


def reads_only_filled_slots(cfg) -> bool:
    """True when a decode step of this ModelConfig attends in the compiled kernel on this process
    (``dantinox.kv.decode_kernel``: MHA / GQA / MQA, float32 cache and compute, CPU, extension built),
    which reads each row's filled slots only. Under a mesh the kernel steps aside and XLA's attention reads
    the whole window."""
    return (cfg.attention != "mla" and cfg.cache_dtype == "float32" and cfg.compute_dtype == "float32"
            and kernel_available())


def one_row_windows(cfg) -> list[tuple[int, ...]]:
    """Every window tuple ``decode_windows(cfg, 1, bound)`` can return, smallest first: what a warm-up
    compiles so that no one-row request compiles a decode program afterwards."""
    bounds, width = [None], SINGLE_ROW_WINDOW
    while width < cfg.max_context:
        bounds.append(width)
        width *= 2
    return sorted({decode_windows(cfg, 1, bound) for bound in bounds}, key=lambda w: w[-1])


def warm_prefill(model, prompt_length: int) -> None:
    """Make the one-row prefill program of ``prompt_length``'s bucket ready without running it
    (``StoredFunction.prepare``: loaded from the program store, or compiled), so a later one-row request of
    that bucket compiles nothing (sampling settings and seed are traced)."""
    req = _prepare(model, [0] * prompt_length, 1, 1.0, 0, 1.0, 0, None)
    graphdef, params = split_model(model)
    with mesh_scope(mesh_of(params)):
        prefill.prepare(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill,
                        new_cache(model.cfg, 1, params))   # real (no page is written): its zeros' program is ready too


def warm_decode(model, windows: tuple[int, ...], prompt_length: int = 1) -> None:
    """Make the one-row decode loop over ``windows`` ready without running it, behind the prefill of
    ``prompt_length`` tokens (its output shapes, read off its program), so every later one-row request of that
    window compiles nothing (sampling settings, seed and step bound are traced). The prefill's shapes come
    from its stored file when there is one (``generator.warm_up`` prepares that bucket), else from tracing it
    abstractly; the prefill program itself is not made ready here."""
    req = _prepare(model, [0] * prompt_length, 2, 1.0, 0, 1.0, 0, None)
    graphdef, params = split_model(model)
    with mesh_scope(mesh_of(params)):
        state = prefill.output_shapes(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id,
                                      req.fill, cache_shapes(model.cfg, 1, params))
        decode.prepare(graphdef, params, state, jnp.int32(2), req.key, req.sampling, req.eos_id, req.fill,
                       windows=windows)

@stored_jit(static_argnames=("graphdef", "windows"), donate_argnames=("state",))
def decode(graphdef, params, state: DecodeState, stop_step, key, sampling: SamplingParams, eos_id, fill,
           windows: tuple[int, ...] | None = None):
    """Run decode steps until ``state.step == stop_step`` or every row is done; one compiled program.

    stop_step, eos_id, fill: [] int32 (traced). windows: static attention windows (default
    ``decode_windows(cfg, B)``; ValueError unless increasing and at most max_context): the program is one
    ``lax.while_loop`` per window L, in increasing order, each running while every row's next slot is < L
    (<= S for the last) over a cache of the first L slots only, so early steps do not read the empty tail of
    the cache (../shared/PERFORMANCE.md, item 3). The window's slots are cut out of the full cache once when
    the window begins and written back once when it ends (every row's written slots are below L while it
    runs), not every step: a per-step cut would copy every layer's keys and values each step (what that cost
    is in docs/explanation/performance.md, "Attention windows"). When the last window is below max_context the loop also
    stops when a row's next slot reaches it: the caller bounds the request (``decode_windows(cfg, B, bound)``
    with bound >= every row's prompt length + stop_step).
    Returns the advanced DecodeState (the input is donated).
    """
    model = nnx.merge(graphdef, params)
    windows = windows or decode_windows(model.cfg, state.token.shape[0])
    S = model.cfg.max_context
    if list(windows) != sorted(set(windows)) or windows[-1] > S or windows[0] < 1:
        raise ValueError(f"windows={windows!r} is not allowed: increasing slot counts, at most max_context={S}")

    def step(s: DecodeState):
        logits, cache, _ = model(s.token[:, None], use_cache=True, kv_caches=s.cache, cache_index=s.index)
        token = sample_next(logits[:, 0], jax.random.fold_in(key, s.step), sampling)
        token = jnp.where(s.done, fill, token)
        out = jax.lax.dynamic_update_slice(s.out, token[:, None], (0, s.step))
        return DecodeState(s.step + 1, token, s.index + 1, s.done | is_eos(token, eos_id), out, cache)

    full = state.cache
    for width in windows:
        def cond(s: DecodeState, width=width):
            below = jnp.max(s.index) <= S if width == S else jnp.max(s.index) < width
            return (s.step < stop_step) & ~jnp.all(s.done) & below

        state = jax.lax.while_loop(cond, step, state._replace(cache=cache_window(full, width, model.cfg)))
        full = state.cache if width == S else put_window(full, state.cache)
    return state._replace(cache=full)


def cache_window(cache, width: int, cfg):
    """The first ``width`` slots of every full-length layer cache of ``cfg`` (a copy; the S axis is -2 in every
    layout: [B, K, S, D], [B, S, C], [B, S, R] and the int8 scales [..., S, 1]; per-channel key scales keep the
    groups that cover the width and the key residual stays whole, ``dantinox.kv.static.first_slots``); a
    sliding layer's ring (``dantinox.kv.ring``) stays whole. The cache itself when width covers it."""
    if width >= cfg.max_context:
        return cache
    return tuple(layer if spec.ring else first_slots(layer, width) for layer, spec in zip(cache, layer_specs(cfg)))


def put_window(cache, window):
    """``cache`` with its first slots replaced by ``window`` (as cut by cache_window)."""
    return tuple(type(layer)(*(a.at[..., :w.shape[-2], :].set(w) for a, w in zip(layer, part)))
                 for layer, part in zip(cache, window))


class _Request(NamedTuple):
    ids: np.ndarray
    lengths: np.ndarray
    single: bool
    sampling: SamplingParams
    key: jax.Array
    eos_id: jax.Array
    fill: jax.Array
    max_new_tokens: int


def _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id) -> _Request:
    cfg = model.cfg
    if cfg.paradigm != "ar":
        raise ValueError(f"this function decodes autoregressive models; the model has paradigm={cfg.paradigm!r}"
                         ": use dantinox.generate or dantinox.diffusion_generate")
    ids, lengths, single = prepare_prompts(prompt_ids, cfg.vocab_size, cfg.max_context)
    check_request(lengths, max_new_tokens, cfg.max_context)
    sampling = make_sampling_params(len(ids), temperature, top_k, top_p, cfg.vocab_size)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} is not allowed: an integer in [0, 2**32)")
    eos = eos_array(eos_id, cfg.vocab_size)
    return _Request(ids, lengths, single, sampling, jax.random.key(np.uint32(seed)), jnp.asarray(eos),
                    jnp.int32(max(int(eos[0]), 0)), int(max_new_tokens))


def _finish(out: np.ndarray, req: _Request) -> GenerationResult:
    tokens = np.asarray(out)[:, : req.max_new_tokens]
    eos = [int(e) for e in np.asarray(req.eos_id) if e >= 0]
    lengths, reasons = [], []
    for row in tokens:
        hits = np.flatnonzero(np.isin(row, eos))
        lengths.append(int(hits[0]) + 1 if len(hits) else len(row))
        reasons.append("stop" if len(hits) else "length")
    return GenerationResult(tokens, np.array(lengths, np.int32), reasons)


def generate_result(model, prompt_ids, max_new_tokens: int = 64, *, use_cache: bool = True,
                    temperature=0.0, top_k=0, top_p=1.0, seed: int = 0, eos_id=None,
                    mesh=None) -> GenerationResult:
    """Like :func:`dantinox.generate` but always batched ([B, N] tokens) and with per-row lengths and finish reasons."""
    place_on_mesh(model, mesh)
    return _run(_prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id), model,
                use_cache)


def place_on_mesh(model, mesh) -> None:
    """Shard ``model``'s parameters over ``mesh`` (dantinox.parallel.sharding.shard_model) unless None or already there.
    Raises dantinox.parallel.mesh.MeshError when the model does not divide over the mesh."""
    if mesh is not None and mesh_of(split_model(model)[1]) != mesh:
        shard_model(model, mesh)


def _run(req: _Request, model, use_cache: bool) -> GenerationResult:
    graphdef, params = split_model(model)
    with mesh_scope(mesh_of(params)):  # parameters on a mesh: run there (dantinox.parallel.mesh)
        return _run_split(req, graphdef, params, model.cfg, use_cache)


def _run_split(req: _Request, graphdef, params, cfg, use_cache: bool) -> GenerationResult:
    if not use_cache:
        return _finish(_recompute_all(graphdef, params, req, cfg.max_context), req)
    state = prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill,
                    new_cache(cfg, len(req.ids), params))
    if req.max_new_tokens > 1:  # prefill already sampled the first token
        state = decode(graphdef, params, state, jnp.int32(req.max_new_tokens), req.key, req.sampling,
                       req.eos_id, req.fill, windows=_windows(req, cfg))
    return _finish(to_host(state.out), req)  # gathers across processes (dantinox.parallel.distributed)


def _windows(req: _Request, cfg) -> tuple[int, ...]:
    """decode_windows for this request: every row's slots stay below its prompt length + max_new_tokens."""
    return decode_windows(cfg, len(req.ids), int(req.lengths.max()) + req.max_new_tokens)


def stream_tokens(model, prompt_ids, max_new_tokens: int = 64, *, chunk_size: int = 8, temperature=0.0,
                  top_k=0, top_p=1.0, seed: int = 0, eos_id=None, mesh=None) -> Iterator[np.ndarray]:
    """Yield new tokens as they are produced: the prefill's token first ([B, 1], as soon as the prefill is done),
    then chunk_size decode steps at a time: arrays [B, n] int32 (n <= chunk_size). Rows past their EOS yield
    eos_id.
    Same arguments, errors and tokens as :func:`dantinox.generate` with use_cache=True."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} is not allowed: an integer >= 1")
    req = _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    place_on_mesh(model, mesh)
    graphdef, params = split_model(model)
    on = mesh_of(params)
    with mesh_scope(on):
        state = prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill,
                        new_cache(model.cfg, len(req.ids), params))
    yield np.asarray(state.out)[:, :1]   # the prefill's token at once: the time to the first token is the prefill's
    if req.max_new_tokens <= 1 or bool(np.all(np.asarray(state.done))):
        return
    sent, windows = 1, _windows(req, model.cfg)
    while True:
        stop = min(sent + chunk_size, req.max_new_tokens)
        with mesh_scope(on):
            state = decode(graphdef, params, state, jnp.int32(stop), req.key, req.sampling, req.eos_id,
                           req.fill, windows=windows)
        step, done = int(state.step), bool(np.all(np.asarray(state.done)))
        if step < stop and not done:   # cannot happen while _windows bounds the request; never loop idle
            raise RuntimeError(f"decode stopped at step {step} of {stop}: its attention window is too small")
        if step > sent:
            yield np.asarray(state.out)[:, sent:step]
            sent = step
        if done or step >= req.max_new_tokens:
            return


class RecomputeState(NamedTuple):
    """Loop state of the no-cache path."""

    step: jax.Array   # [] int32
    seq: jax.Array    # [B, S] int32: prompt + generated tokens so far
    done: jax.Array   # [B] bool
    out: jax.Array    # [B, S] int32


@partial(jax.jit, static_argnames=("graphdef", "window"))
def recompute_segment(graphdef, params, state: RecomputeState, lengths, stop_step, key, sampling, eos_id, fill,
                      window: int):
    """No-cache decoding while every row fits in the first ``window`` positions: each step runs the full causal
    forward over seq[:, :window] and samples at each row's last position. Returns the advanced state."""
    model = nnx.merge(graphdef, params)
    rows = jnp.arange(state.seq.shape[0])

    def cond(s: RecomputeState):
        return (s.step < stop_step) & ~jnp.all(s.done) & (jnp.max(lengths) + s.step <= window)

    def body(s: RecomputeState):
        logits, _, _ = model(s.seq[:, :window], use_cache=False, logits_at=lengths + s.step - 1)
        last = logits[:, 0]
        token = jnp.where(s.done, fill, sample_next(last, jax.random.fold_in(key, s.step), sampling))
        seq = s.seq.at[rows, lengths + s.step].set(token, mode="drop")
        out = jax.lax.dynamic_update_slice(s.out, token[:, None], (0, s.step))
        return RecomputeState(s.step + 1, seq, s.done | is_eos(token, eos_id), out)

    return jax.lax.while_loop(cond, body, state)


def _recompute_all(graphdef, params, req: _Request, max_context: int) -> np.ndarray:
    B = len(req.ids)
    seq = np.zeros((B, max_context), np.int32)
    seq[:, : req.ids.shape[1]] = req.ids
    state = RecomputeState(jnp.int32(0), jnp.asarray(seq), jnp.zeros((B,), bool),
                           jnp.full((B, max_context), req.fill, jnp.int32))
    window = bucket_length(int(req.lengths.max()), max_context)
    while True:
        state = recompute_segment(graphdef, params, state, req.lengths, jnp.int32(req.max_new_tokens),
                                  req.key, req.sampling, req.eos_id, req.fill, window=window)
        if int(state.step) >= req.max_new_tokens or bool(np.all(np.asarray(state.done))):
            return jax.device_get(state.out)
        window = bucket_length(window + 1, max_context)

