"""Shared fixtures: tiny configs from ../shared/cases/ACCEPTANCE.md (vocab 128, dim 64, 2 layers, 8 heads x 8,
max_context 32) and an independent reference forward."""

import os
import shutil
import tempfile

# Each pytest run gets its own fresh persistent compilation cache (a temporary directory, removed when the run
# ends), so a run never depends on what earlier runs left on the machine (~/.cache/jax_xla/dantinox is not used),
# while the modules of one run share what they compiled: the module-scoped jax.clear_caches() below drops the
# executables from memory, and the next module that needs the same program loads it from this directory instead
# of compiling it again. Child processes started by tests inherit the variable and share the cache too, and so
# do pytest-xdist's workers: the controlling process loads this file first and the workers inherit its
# environment. A value the user set (a directory, or "off") is respected. A cache load still counts as one
# compilation in dantinox.CompileCounter (both fire /jax/core/compile/backend_compile_duration; cache_hits
# tells them apart).
_RUN_XLA_CACHE = None
if "DANTINOX_XLA_CACHE" not in os.environ:
    _RUN_XLA_CACHE = tempfile.mkdtemp(prefix="dantinox-test-xla-")
    os.environ["DANTINOX_XLA_CACHE"] = _RUN_XLA_CACHE

# The program store (dantinox.programs.store) is off in the suite: many tests retrace on purpose (a
# monkeypatched function, jax.clear_caches() before counting compilations), and a stored program of a patched
# trace would be found under the real code's key by later tests. tests/test_program_store.py turns it on.
os.environ.setdefault("DANTINOX_PROGRAM_STORE", "off")

# The suite's time is mostly XLA compiling thousands of tiny programs, and most of a CPU compile is LLVM
# optimizing the generated code, which the tiny configs do not need: backend optimization level 0 cut three
# heavy test files from 146 to 95 s (2 workers, 2026-12-04) and changes no HLO (fusion, buffer assignment and the
# copies the tests count are decided before it). Set before JAX is imported; child processes inherit it; a level
# the user set in XLA_FLAGS is kept. (One case of test_int8_reference skips, as on some platforms, because the
# unoptimized code happens to land on no rounding-boundary flip.)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


import gc  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import dantinox as dx  # noqa: E402
from dantinox.programs.store import clear_programs  # noqa: E402


def pytest_unconfigure(config):
    """Remove the run's compilation cache (only the one this conftest created)."""
    if _RUN_XLA_CACHE is not None:
        shutil.rmtree(_RUN_XLA_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_executables():
    """Drop every compiled executable when a test module ends.

    Each executable XLA's CPU backend loads holds about 3 memory mappings of its own. The whole suite compiles
    thousands of them in one process; kept alive, they pass Linux's default limit of 65,530 mappings per process
    (vm.max_map_count) and the next compilation dies with a segmentation fault inside XLA (seen on 2026-12-01:
    two CI runs died that way near the end, in compile and in the persistent cache's read; every file passed
    alone). Clearing JAX's caches after each module keeps the count near what one module needs; what a later
    module needs again it loads from the run's persistent compilation cache (above) instead of compiling it.
    """
    yield
    gc.collect()
    jax.clear_caches()
    clear_programs()
    gc.collect()


@partial(jax.jit, static_argnames=("graphdef", "use_cache", "fresh", "attend_slots"))
def _jitted_call(graphdef, state, ids, kv_caches, cache_index, key_start, logits_at, *, use_cache, fresh,
                 attend_slots):
    model = nnx.merge(graphdef, state)
    return model(ids, use_cache=use_cache, kv_caches=kv_caches, cache_index=0 if fresh else cache_index,
                 key_start=key_start, attend_slots=attend_slots, logits_at=logits_at)


def forward(model, ids, use_cache: bool = False, kv_caches=None, cache_index=0, key_start=None,
            attend_slots=None, logits_at=None):
    """``model(ids, ...)`` through ``jax.jit``: same arguments and results (logits, caches, aux), compiled once
    per model structure, input shapes and static options instead of primitive by primitive on every eager call.

    The model is split at each call, so parameters changed in place since the last call are used. cache_index
    the Python int 0 stays the model's fresh-prefill marker (a static flag); any other cache_index (int or [B])
    is a traced int32, so every decode step of one shape shares one program. The model's host-side argument
    checks see traced values here; this helper is for valid calls (it asserts ids in range and cache_index + T
    within the cache): the tests of the model's errors call the model itself."""
    ids = np.asarray(ids)
    assert ids.ndim == 2 and 0 <= ids.min() and ids.max() < model.cfg.vocab_size, (ids.shape, ids.min(), ids.max())
    fresh = isinstance(cache_index, int) and not isinstance(cache_index, bool) and cache_index == 0
    if use_cache:
        from dantinox.model.transformer import _capacity   # a sliding layer's ring holds fewer slots
        slots = _capacity(kv_caches, model.cfg)
        assert int(np.max(np.asarray(cache_index))) + ids.shape[1] <= slots, (cache_index, ids.shape, slots)
    graphdef, state = nnx.split(model)
    return _jitted_call(graphdef, state, jnp.asarray(ids, jnp.int32), kv_caches if use_cache else None,
                        jnp.int32(0) if fresh else jnp.asarray(cache_index, jnp.int32),
                        None if key_start is None else jnp.asarray(key_start, jnp.int32),
                        None if logits_at is None else jnp.asarray(logits_at, jnp.int32),
                        use_cache=use_cache, fresh=fresh, attend_slots=attend_slots)


def uncached_logits(model, seqs) -> np.ndarray:
    """The plain causal forward (use_cache=False, through ``forward``) over each row of ``seqs`` right-padded with
    token 0 to max_context: logits [B, max_context, V], one compiled program per model config and batch size.
    By causality position p holds the last-position logits of the forward over the row's first p + 1 tokens;
    the padding comes after every position a test compares."""
    S = model.cfg.max_context
    assert max(len(q) for q in seqs) <= S
    ids = np.array([list(q) + [0] * (S - len(q)) for q in seqs], np.int32)
    return np.asarray(forward(model, ids, use_cache=False)[0])


def tiered(cases, slow=()) -> list:
    """pytest parameters for ``cases`` (values, or tuples for several arguments): those in ``slow`` carry the
    slow mark (heavy tier only), the rest run in the default tier."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=[pytest.mark.slow] * (c in slow))
            for c in cases]


def tiny_config(**overrides) -> dx.ModelConfig:
    """The acceptance cases' tiny model, float32, with overrides."""
    return dx.ModelConfig.from_preset("tiny", **overrides)


KV_DTYPES = ["float32", "int8"]   # cache dtypes the exactness and acceptance tests run with


def qdq_rows(t: np.ndarray) -> np.ndarray:
    """Numpy reference of the int8 cache's round trip: symmetric absmax int8 per row (last axis), the scale
    max|row| / 127 in float32, read back as q * scale (float64 result). A zero row stays zero."""
    t32 = np.asarray(t, np.float32)
    scale = np.abs(t32).max(-1, keepdims=True) / np.float32(127)
    q = np.clip(np.round(t32 / np.where(scale > 0, scale, np.float32(1))), -127, 127)
    return (q.astype(np.float32) * scale).astype(np.float64)


def qdq_after_sinks(t: np.ndarray, sinks: int) -> np.ndarray:
    """The int8 cache's values for rows t [B, T, ...] (token axis 1): the first ``sinks`` tokens as they are
    (the float32 attention sinks, ``ModelConfig.sink_slots``), every later row through ``qdq_rows``."""
    t = np.asarray(t, np.float64)
    return np.concatenate([t[:, :sinks], qdq_rows(t[:, sinks:])], 1)


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    """Independent reference: numpy forward with an explicit causal mask and naive per-head GQA mapping
    (query head h reads KV head h // (H / K)). ids: [B, T] -> logits [B, T, V] float64. With
    cache_dtype="int8" every key and value row (per token and KV head) after the first cfg.sink_slots tokens
    goes through ``qdq_rows`` (``qdq_after_sinks``): the per-token layout, so an int8 model must have
    kv_keys="token" (per-channel keys, the int8 default, have their numpy reference in
    tests/quality/test_channel_keys.py)."""
    cfg = model.cfg
    assert not cfg.channel_keys, "reference_logits quantizes keys per token: give the model kv_keys='token'"
    p = lambda x: np.asarray(x[...], np.float64)  # noqa: E731
    emb = p(model.embed.embedding)
    x = emb[ids]
    B, T = ids.shape
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
    pos = np.arange(T)[None, :].repeat(B, 0)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2) / D))
    ang = pos[..., None] * inv
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]

    def rope(t):
        a, b = t[..., : D // 2], t[..., D // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def rms(t, scale):
        return t / np.sqrt(np.mean(t * t, -1, keepdims=True) + cfg.norm_eps) * scale

    for blk in model.blocks:
        h = rms(x, p(blk.attn_norm.scale))
        qkv = h @ p(blk.attn.qkv.kernel)
        q = rope(qkv[..., : H * D].reshape(B, T, H, D))
        k = rope(qkv[..., H * D:(H + K) * D].reshape(B, T, K, D))
        v = qkv[..., (H + K) * D:].reshape(B, T, K, D)
        if cfg.cache_dtype == "int8":
            k, v = qdq_after_sinks(k, cfg.sink_slots), qdq_after_sinks(v, cfg.sink_slots)
        out = np.zeros((B, T, H, D))
        mask = np.tril(np.ones((T, T), bool))
        for head in range(H):
            kv = head // (H // K)
            s = np.einsum("btd,bsd->bts", q[:, :, head], k[:, :, kv]) / np.sqrt(D)
            s = np.where(mask, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, :, head] = np.einsum("bts,bsd->btd", w, v[:, :, kv])
        x = x + out.reshape(B, T, H * D) @ p(blk.attn.out.kernel)
        h = rms(x, p(blk.mlp_norm.scale))
        gate, up = np.split(h @ p(blk.mlp.gate_up.kernel), 2, -1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p(blk.mlp.down.kernel)
    return rms(x, p(model.final_norm.scale)) @ emb.T


@pytest.fixture
def tiny():
    return tiny_config


def spiky_model(cfg: dx.ModelConfig, seed: int = 0, qk_scale: float = 12.0):
    """A random model whose query/key projections are scaled up so attention is far from uniform: a wrong
    position, mask or head mapping then changes the logits by much more than the test tolerances."""
    model = dx.build_model(cfg, seed)
    for blk in model.blocks:
        kernel = blk.attn.qkv.kernel
        width = (cfg.n_heads + cfg.kv_heads) * cfg.head_size
        kernel[...] = kernel[...].at[:, :width].multiply(qk_scale)
    return model


def spiky_mla(cfg: dx.ModelConfig, seed: int = 0, scale: float = 12.0):
    """A random MLA model with query, key up-projection and RoPE-key weights scaled up so attention is far
    from uniform: a wrong position, mask or head mapping then moves the logits far beyond the tolerances."""
    model = dx.build_model(cfg, seed)
    C, Q = cfg.kv_latent_dim, cfg.q_latent_dim or 0
    for blk in model.blocks:
        a = blk.attn
        a.q_up.kernel[...] = a.q_up.kernel[...] * scale
        a.w_uk[...] = a.w_uk[...] * scale
        a.down.kernel[...] = a.down.kernel[...].at[:, Q + C:].multiply(scale)
    return model
