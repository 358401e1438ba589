"""Causal self-attention over a KV cache: MHA, GQA and MQA in one implementation.

Shape letters: see ``dantinox.kv.attend`` (B batch, T new tokens, S cache slots, H query heads, K KV heads,
G = H // K query heads per KV head, D head size, E model width).

Grouped heads: query head h uses KV head h // G (contiguous groups), so q is reshaped from
[B, T, H, D] to [B, K, G, T, D]. MHA is K = H, MQA is K = 1 (Ainslie et al. 2023, "GQA", section 2).

The layer computes its queries, keys and values and hands them to its cache spec
(``dantinox.kv.spec.LayerSpec.attend``), which encodes the new rows as the layer's codec stores them (float,
int8 rows with float32 sinks, per-channel int8 keys), attends over the old slots of whatever storage the
layer cache is (the static cache, a paged pool view, the DualCache, a quality reference) and writes. The layer
never asks what kind of cache it has. Multi-head latent attention lives in ``dantinox.model.mla``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from ..kv.spec import layer_spec
from .layers import RMSNorm, apply_rope


class Attention(nnx.Module):
    """Multi-head attention with K <= H KV heads (MHA / GQA / MQA) and rotary positions.

    Projections: one fused [E, (H + 2K) D] matmul for q, k, v (columns: the H query heads, then the K key
    heads, then the K value heads, each head's D contiguous; with cfg.qkv_bias a bias of (H + 2K) D, as Qwen2);
    an [H D, E] output matmul without bias. With cfg.qk_norm each query and key head is RMS-normalised over D
    before RoPE (one [D] weight for all query heads, one for all key heads; Qwen3). Query head h reads KV head
    h // G, the grouping of transformers' ``repeat_kv``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.cfg, self.layer = cfg, layer   # layer: its index, for its cache spec (``dantinox.kv.spec``)
        init = nnx.initializers.normal(stddev=0.02)
        qkv_width = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_size
        self.qkv = nnx.Linear(cfg.dim, qkv_width, use_bias=cfg.qkv_bias, dtype=cfg.jnp_compute_dtype,
                              param_dtype=jnp.float32, kernel_init=init, rngs=rngs)
        self.q_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.out = nnx.Linear(cfg.n_heads * cfg.head_size, cfg.dim, use_bias=False,
                              dtype=cfg.jnp_compute_dtype, param_dtype=jnp.float32,
                              kernel_init=nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.num_blocks)),
                              rngs=rngs)

    def __call__(self, x, rope, layer_cache, cache_index, key_start, read_slots: int | None, valid=None):
        """x: [B, T, E]; rope: (cos, sin) each [B, T, D/2]; layer_cache: this layer's cache (a static layer of
        ``init_cache``, a view with ``attend_and_write``: the paged pool, the DualCache, ...) or None (the
        uncached forward); cache_index: [B] int32 slot of the first new token; key_start: [B] int32 or None;
        read_slots: old cache slots to attend over: None all S, 0 none (prefill at slot 0), L the first L
        (the caller guarantees cache_index <= L for every row; ``dantinox.kv.attend.old_slots``); valid: [B]
        int32 real tokens among the T (the rest right padding) or None (the per-channel key codec keeps
        padding out of its key groups with it).

        Returns (y [B, T, E], the updated layer cache (the same kind as given) or None).
        """
        cfg = self.cfg
        B, T, _ = x.shape
        H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
        q, k, v = jnp.split(self.qkv(x), [H * D, (H + K) * D], axis=-1)
        q, k = q.reshape(B, T, H, D), k.reshape(B, T, K, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        v = v.reshape(B, T, K, D)
        q = (q * cfg.softmax_scale).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,D]
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        y, new_cache = layer_spec(cfg, self.layer).attend(q, k, v, layer_cache, cache_index, key_start, read_slots,
                                                          valid, causal=cfg.paradigm != "diffusion")
        y = y.transpose(0, 3, 1, 2, 4).reshape(B, T, H * D).astype(x.dtype)
        return self.out(y), new_cache
