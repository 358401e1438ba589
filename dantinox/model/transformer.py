"""Transformer: token ids (+ an optional static KV cache) -> logits (+ the updated cache).

The call follows the seeds' contract::

    logits, kv_caches, aux = model(ids, use_cache=True, kv_caches=cache, cache_index=i)

``cache_index`` is a scalar or one slot per row ([B] int32) so prompts of different lengths share a batch.
``use_cache=False`` runs the plain causal forward over ``ids`` and returns ``kv_caches=None``.
With ``cfg.paradigm == "diffusion"`` attention is bidirectional (no causal mask; left padding still masked);
``dantinox.generation.diffusion`` passes its DualCache as per-layer objects with an ``attend_and_write`` method.
With compute_dtype float32 every matmul runs at full float32 precision on every backend (``float32_matmuls``).
Shape letters: see ``dantinox.model.layers``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..parallel.sharding import constrain_cache, shard_model
from .attention import Attention
from ..kv.static import KVCache, LatentCacheView, LayerCacheView, check_cache_capacity
from ..kv.cache import cache_shapes
from ..kv.spec import describe, layer_specs
from .layers import GatedMLP, RMSNorm, rope_angles
from .mla import MLAttention


def float32_matmuls(method):
    """Decorator for a model method: trace it with JAX's default matmul precision at "highest" when the model
    computes in float32 (``self.cfg.compute_dtype == "float32"``), so its float32 dots are float32 dots on every
    backend. Without it a GPU's default lets cuBLAS round float32 inputs to TF32 (a 10-bit mantissa): on an
    H200, ``dantinox verify`` on the bundled model measured max |cached - uncached| = 6.7e-3 against 1.3e-5 on
    the CPU, and failed. The CPU computes float32 dots in float32 either way (same tokens, same speed). A
    bfloat16 model is left at the default (its inputs are 16-bit already)."""

    @functools.wraps(method)
    def traced(self, *args, **kwargs):
        if self.cfg.compute_dtype != "float32":
            return method(self, *args, **kwargs)
        with jax.default_matmul_precision("highest"):
            return method(self, *args, **kwargs)

    return traced


class Block(nnx.Module):
    """Pre-norm decoder block: x + Attention(RMSNorm(x)), then x + MLP(RMSNorm(x)); with cfg.sandwich_norms
    each branch's output is RMS-normalised too before the residual add (Gemma 2 / 3: x + N'(Attention(N(x))),
    then x + N'(MLP(N(x)))).

    The attention is MLAttention for cfg.attention == "mla", Attention (MHA / GQA / MQA) otherwise; the MLP is
    the gated MLP with cfg.mlp_activation (SwiGLU or GeGLU).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        kind = MLAttention if cfg.attention == "mla" else Attention
        self.attn = kind(cfg, rngs=rngs, layer=layer)   # layer: its cache spec's index (dantinox.kv.spec)
        self.attn_post_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.sandwich_norms else None
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.dim, cfg.mlp_hidden, cfg.jnp_compute_dtype, rngs=rngs, activation=cfg.mlp_activation)
        self.mlp_post_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.sandwich_norms else None

    def __call__(self, x, rope, layer_cache, cache_index, key_start, read_slots, valid=None):
        """x: [B, T, E] -> ([B, T, E], updated layer cache or None). read_slots, valid: see Attention (valid
        reaches only Attention; MLA caches store per token and ignore it)."""
        extra = {} if valid is None or isinstance(self.attn, MLAttention) else {"valid": valid}
        h, layer_cache = self.attn(self.attn_norm(x), rope, layer_cache, cache_index, key_start, read_slots,
                                   **extra)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        return x + h, layer_cache


class Transformer(nnx.Module):
    """Decoder-only transformer with RoPE, RMSNorm, a gated MLP and (optionally) tied embeddings.

    Build with ``Transformer(cfg, rngs=nnx.Rngs(seed))`` or ``dantinox.build_model(cfg, seed)``.
    Parameters are float32; matmuls run in cfg.compute_dtype; logits are float32. Gemma's extras, each off by
    default (``ModelConfig``): embeddings times cfg.embed_scale, sliding-window layers rotating with their own
    base cfg.rope_local_theta, and logits soft-capped at cfg.final_logit_softcap.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, dtype=cfg.jnp_compute_dtype, param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(stddev=0.02), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs, layer=n) for n in range(cfg.num_blocks)])
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
            cfg.dim, cfg.vocab_size, use_bias=False, dtype=cfg.jnp_compute_dtype, param_dtype=jnp.float32,
            kernel_init=nnx.initializers.normal(stddev=0.02), rngs=rngs)

    @float32_matmuls
    def __call__(self, ids, use_cache: bool = False, kv_caches: KVCache | None = None, cache_index=0,
                 key_start=None, attend_slots: int | None = None, logits_at=None, valid_tokens=None):
        """Run the model on T new tokens per row.

        Args:
          ids: [B, T] integer token ids in [0, V).
          use_cache: attend over and write into ``kv_caches``; False runs the plain causal forward.
          kv_caches: from ``init_cache(cfg, B)``: per layer LayerKV(k, v) of [B, K, S, D] (MLA: LatentKV(c_kv
            [B, S, C], k_rope [B, S, R]); cache_dtype="int8": QuantLayerKV / QuantLatentKV, the int8 rows plus
            float32 scales [..., S, 1]). Required when use_cache is True (it is never allocated lazily). A cache
            cut to its first S' <= max_context slots (``dantinox.generation.decode.cache_window``) is accepted;
            the call must then stay below slot S'.
          cache_index: int or [B] int32: slot of each row's first new token. The Python int 0 marks a fresh
            prefill (the old cache is not read).
          key_start: optional [B] int32: number of left-padding slots per row; those slots are never
            attended to and row b's first real token gets RoPE position 0.
          attend_slots: optional static int L in [1, S]: attend over the first L cache slots only (plus the new
            tokens), which saves work when every row's cache_index <= L (the caller's promise; checked when
            cache_index is a host value). The compiled decode loop uses it (``dantinox.generation.decode``).
          logits_at: optional [B] int32 position in [0, T) per row: compute the output head at that position
            only and return logits [B, 1, V] (generation needs only each row's last real position; a prefill
            of a T-token bucket then skips T - 1 rows of the [E, V] head). None: logits at every position.
          valid_tokens: optional [B] int32 in [0, T]: row b's first valid_tokens[b] new tokens are real, the
            rest right padding that a later call overwrites (prefill's bucketed prompts). Only the per-channel
            key cache (cfg.channel_keys) needs it: padding must not enter a key group it quantizes. Other
            caches ignore it (their padding rows are overwritten in place).
        Returns:
          (logits [B, T, V] float32 ([B, 1, V] with logits_at), updated kv_caches or None, aux dict (empty for
          this architecture)).
        Raises:
          ValueError: ids not [B, T] integers, ids outside [0, V), cache missing or of the wrong shape.
          CapacityError: cache_index + T > max_context (checked whenever cache_index is a host value).
          ValueError: attend_slots not an int in [1, max_context], or a host cache_index beyond it; logits_at not
            [B] or (a host value) outside [0, T).
        """
        cfg = self.cfg
        ids = _check_ids(ids, cfg.vocab_size)
        B, T = ids.shape
        fresh = isinstance(cache_index, int) and cache_index == 0 and key_start is None
        attend_slots = _check_attend_slots(attend_slots, cache_index, cfg.max_context)
        if use_cache:
            if not _attends_itself(kv_caches):
                _check_cache(kv_caches, cfg, B)
                check_cache_capacity(cache_index, T, _capacity(kv_caches, cfg))
        elif T > cfg.max_context:
            raise ValueError(f"ids has T={T} tokens, more than max_context={cfg.max_context}")
        index = jnp.broadcast_to(jnp.asarray(cache_index if use_cache else 0, jnp.int32), (B,))
        positions = index[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        if key_start is not None:
            key_start = jnp.asarray(key_start, jnp.int32)
            positions = jnp.maximum(positions - key_start[:, None], 0)
        ropes = layer_ropes(cfg, positions)
        x = self.embed(ids)
        if cfg.embed_scale is not None:
            x = x * jnp.asarray(cfg.embed_scale, jnp.float32).astype(x.dtype)
        new_caches = []
        for n, block in enumerate(self.blocks):
            layer_cache = kv_caches[n] if use_cache else None
            x, layer_cache = block(x, ropes[n], layer_cache, index, key_start, 0 if fresh else attend_slots,
                                   None if valid_tokens is None else jnp.asarray(valid_tokens, jnp.int32))
            new_caches.append(layer_cache)
        if use_cache and not _attends_itself(kv_caches):  # on a mesh: one cache layout (dantinox.parallel.sharding)
            new_caches = constrain_cache(new_caches, cfg)
        if logits_at is not None:  # before the norm and head: they act per position
            x = jnp.take_along_axis(x, _check_logits_at(logits_at, B, T)[:, None, None], axis=1)
        return self.logits(self.final_norm(x)), (tuple(new_caches) if use_cache else None), {}

    @float32_matmuls
    def logits(self, h: jax.Array) -> jax.Array:
        """Output projection. h: [B, T, E] -> logits [B, T, V] float32 (soft-capped, c tanh(logits / c), when
        cfg.final_logit_softcap is c).

        A tied head contracts E with the table's last axis directly (dot_general on [V, E]); ``nnx.Embed.attend``
        writes ``embedding.T``, which XLA CPU materialised as a [E, V] transpose + copy every decode step (a
        copy of the whole table; measured cost in docs/explanation/performance.md, "Costs behind choices in the code").
        """
        if self.lm_head is not None:
            out = self.lm_head(h)
        elif isinstance(self.embed, nnx.Embed):
            dtype = self.embed.dtype or h.dtype
            table = self.embed.embedding[...].astype(dtype)
            out = jax.lax.dot_general(h.astype(dtype), table, (((h.ndim - 1,), (1,)), ((), ())))
        else:  # e.g. dantinox.quant.weights.LowPrecisionEmbed, which contracts its own table
            out = self.embed.attend(h)
        out = out.astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return out if cap is None else jnp.tanh(out / cap) * cap


def layer_ropes(cfg: ModelConfig, positions: jax.Array) -> list:
    """The rotary (cos, sin) each layer uses, [B, T, D/2] each (``rope_angles``) for positions [B, T] int32:
    rope_theta with rope_scaling, except that with cfg.rope_local_theta the "sliding_attention" layers get plain
    RoPE of that base (Gemma 3's local layers). Each distinct table is computed once."""
    full = rope_angles(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_local_theta is None or "sliding_attention" not in cfg.layer_kinds:
        return [full] * cfg.num_blocks
    local = rope_angles(positions, cfg.rope_dim, cfg.rope_local_theta)
    return [local if kind == "sliding_attention" else full for kind in cfg.layer_kinds]


def build_model(cfg: ModelConfig, seed: int = 0, mesh=None) -> Transformer:
    """A freshly initialised Transformer for ``cfg`` with parameters drawn from ``seed``; with a ``mesh``
    (``dantinox.make_mesh``) its parameters are sharded over it (``dantinox.parallel.sharding``; MeshError if the
    heads or MLP width do not divide by the model axis)."""
    return shard_model(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh)


def abstract_transformer(cfg: ModelConfig) -> Transformer:
    """``Transformer(cfg)`` as shapes only: every parameter a jax.ShapeDtypeStruct, nothing allocated, nothing
    random drawn (what ``nnx.eval_shape`` of the constructor gives), in time flat in depth: one block is traced
    and the other num_blocks - 1 are its copies (each told its own layer index), since every block of a config
    is built alike. SmolLM2 (30 blocks): 21 ms instead of 310 ms, on every ``load_run``."""
    model = nnx.eval_shape(lambda: Transformer(cfg.replace(num_blocks=1, layer_types=None), rngs=nnx.Rngs(0)))
    block = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0)))   # its modules keep the whole cfg
    model.cfg = cfg
    blocks = [block] + [nnx.clone(block) for _ in range(cfg.num_blocks - 1)]
    for n, copy in enumerate(blocks):
        copy.attn.layer = n
    model.blocks = nnx.List(blocks)
    return model


def _attends_itself(kv_caches) -> bool:
    """True for layer caches that run their own attention and checks (dantinox.kv.paged)."""
    return bool(kv_caches) and isinstance(kv_caches[0], (LayerCacheView, LatentCacheView))


def _check_attend_slots(attend_slots, cache_index, max_context: int) -> int | None:
    """attend_slots as a Python int (numpy integers accepted) or None; ValueError as documented."""
    if attend_slots is None:
        return None
    if (not isinstance(attend_slots, (int, np.integer)) or isinstance(attend_slots, bool)
            or not 1 <= attend_slots <= max_context):
        raise ValueError(f"attend_slots={attend_slots!r} is not allowed: None or an int in [1, max_context="
                         f"{max_context}]")
    if isinstance(cache_index, jax.core.Tracer):
        return int(attend_slots)
    furthest = int(np.max(np.asarray(cache_index)))
    if furthest > attend_slots:
        raise ValueError(f"cache_index {furthest} > attend_slots={attend_slots}: the call would skip cache slots "
                         f"its queries must see")
    return int(attend_slots)


def _check_logits_at(logits_at, batch: int, length: int) -> jax.Array:
    """logits_at as [B] int32; ValueError when its shape is not [B] or a host value lies outside [0, T)."""
    if np.shape(logits_at) != (batch,):
        raise ValueError(f"logits_at must be one position per row, shape ({batch},); got {np.shape(logits_at)}")
    if not isinstance(logits_at, jax.core.Tracer):
        host = np.asarray(logits_at)
        if host.min() < 0 or host.max() >= length:
            raise ValueError(f"logits_at holds positions {host.min()}..{host.max()}; allowed: [0, T={length})")
    return jnp.asarray(logits_at, jnp.int32)


def _check_ids(ids, vocab_size: int):
    if isinstance(ids, jax.core.Tracer):
        if ids.ndim != 2:
            raise ValueError(f"ids must be [B, T]; got shape {ids.shape}")
        return ids
    host = np.asarray(ids)
    if host.ndim != 2 or host.shape[1] == 0 or host.shape[0] == 0:
        raise ValueError(f"ids must be a non-empty [B, T] array of token ids; got shape {host.shape}")
    if not np.issubdtype(host.dtype, np.integer):
        raise ValueError(f"ids must be integers; got dtype {host.dtype}")
    if host.min() < 0 or host.max() >= vocab_size:
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}); got min {host.min()}, "
                         f"max {host.max()}")
    return jnp.asarray(host, jnp.int32)


def _capacity(kv_caches, cfg: ModelConfig) -> int:
    """Positions a static cache holds: the slots of its full-length layers (max_context, or the first S' of a
    cut cache); max_context when every layer is a sliding window's ring (``dantinox.kv.ring``)."""
    full = [layer for layer, spec in zip(kv_caches, layer_specs(cfg)) if not spec.ring]
    return full[0][0].shape[-2] if full else cfg.max_context


def _check_cache(kv_caches, cfg: ModelConfig, batch: int) -> None:
    """ValueError unless ``kv_caches`` is one static layer per block with the shapes its spec allocates
    (``dantinox.kv.cache.cache_shapes``), for max_context slots or a cut to the first S' slots."""
    if kv_caches is None:
        raise ValueError("use_cache=True needs kv_caches: allocate them with dantinox.init_cache(cfg, batch_size)")
    if len(kv_caches) != cfg.num_blocks:
        raise ValueError(f"kv_caches has {len(kv_caches)} layers; the model has num_blocks={cfg.num_blocks}")
    got = tuple(tuple(tuple(a.shape) for a in layer) for layer in kv_caches)
    full = [n for n, spec in enumerate(layer_specs(cfg)) if not spec.ring]   # rings are never cut
    window = got[full[0]][0][-2] if full and got[full[0]] and len(got[full[0]][0]) >= 2 else None
    want = cache_shapes(cfg, batch, window if window and 1 <= window <= cfg.max_context else None)
    if got != want:
        bad = next(n for n in range(len(got)) if got[n] != want[n])
        spec = layer_specs(cfg)[bad]
        fields = spec.codec.static_type(spec.latent)._fields
        layout = ", ".join(f"{name} {list(shape)}" for name, shape in zip(fields, want[bad]))
        raise ValueError(f"kv_caches layer {bad} shapes {got[bad]} do not match the model's cache "
                         f"(cache_dtype={cfg.cache_dtype!r}; {describe(spec)}): {layout}; allocate them with "
                         "dantinox.init_cache(cfg, batch_size)")
