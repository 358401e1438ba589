"""Multi-head latent attention (MLA) over a compressed latent cache.

DeepSeek-V2 (DeepSeek-AI 2024, arXiv 2405.04434), section 2.1. Shape letters as in ``dantinox.kv.attend``;
the MLA ones are C = kv_latent_dim (d_c), R = rope_head_dim (d_rope), Q = q_latent_dim (d_c').

Per token with input h [E] (section 2.1.2, eqs. 9-13, and 2.1.3, eqs. 14-19):
  c_kv = RMSNorm(W_DKV h)                 [C]      the latent, the only per-head-free thing cached
  k_R  = RoPE(W_KR h)                     [R]      decoupled RoPE key shared by all heads, also cached
  c_q  = RMSNorm(W_DQ h)                  [Q]      (or c_q = h without query compression)
  q_C  = W_UQ c_q                         [H, D]   and  q_R = RoPE(W_QR c_q)  [H, R]
  k_C  = W_UK c_kv, v_C = W_UV c_kv       [H, D], [H, Dv]  each head's key and value from the latent
  score(h, t, s) = (q_C[t, h] . k_C[s, h] + q_R[t, h] . k_R[s]) * cfg.softmax_scale  (default 1 / sqrt(D + R))
  y = W_O [softmax(score) v_C]_heads      [E]
W_DQ, W_DKV and W_KR are fused in ``down`` ([E, Q + C + R]); W_UQ and W_QR in ``q_up``; W_UK and W_UV are
``w_uk`` [H, D, C] and ``w_uv`` [H, C, Dv] (Dv = cfg.value_size, DeepSeek's v_head_dim). The RMSNorms on the
latents follow section 3.1.2 ("additional RMSNorm layers after the compressed latent vectors").

Two ways to run the same attention, same parameters, same logits (``cfg.mla_absorb`` picks the decode path;
with it, calls of many tokens still run naive where that is cheaper, see ``MLAttention._path``):
  naive     expand the latents (old cache and new tokens) to per-head k_C, v_C and run ordinary multi-head
            attention (``dantinox.kv.attend.attend`` with K = H). Costs S * C * H * 2D per step: a reference.
  absorbed  q_C . (W_UK c) = (W_UK^T q_C) . c, so fold W_UK into the query (q_lat = W_UK^T q_C, [H, C]) and
            attend against c_kv directly; the value side sums probabilities times latents first
            (o_lat [H, C]) and applies W_UV afterwards (section 2.1.2: "W_UK can be absorbed into W_UQ, and
            W_UV can be absorbed into W_O"). Per step the cache is read by einsums against c_kv [B, S, C] and
            k_R [B, S, R] only; nothing cache-sized is expanded per head.

int8 cache (cfg.cache_dtype="int8", ``QuantLatentKV``): the new latent and RoPE key are quantized once per
token (one scale each, ``dantinox.kv.int8_rows``); attention uses their read-back values, the int8 rows and scales
are stored, and both forms read the old slots back (``_float_latents``) before attending. The first A tokens of
each row (attention sinks, ``dantinox.kv.sinks``) keep their float latents, stored in the cache's float32
sink arrays and read from there instead of their int8 rows.

Both attend over the old cache slots plus the new tokens' own latents jointly and write afterwards (see
``dantinox.model.attention`` for why), with the same masks (causal, sliding window, left padding).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from ..kv.attend import NEG_INF, attend, new_token_mask, old_slot_mask, sink_mask
from ..kv.spec import layer_spec
from ..kv.static import LatentKV, LayerCacheView, LayerKV
from .layers import RMSNorm, apply_rope


def _float_latents(old, dtype):
    """The old slots as float latents and the float32 sinks (the layer type's ``read``: an int8 layer reads
    back in ``dtype`` and brings its sinks LatentKV [B, A, C] / [B, A, R] or None); (None, None) for no old
    slots."""
    return (None, None) if old is None else old.read(dtype)


class MLAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2 section 2.1) with a cache of LatentKV(c_kv, k_rope).

    Same call as ``dantinox.model.attention.Attention``. Projections (no biases): down [E, Q + C + R] (the query
    latent, the kv latent and the RoPE key in one matmul; Q = 0 without query compression), q_norm, q_up
    [Q, H (D + R)] (or [E, H (D + R)]), kv_norm, the up-projections w_uk [H, D, C] and w_uv [H, C, Dv], out
    [H Dv, E]. The up-projections are stored in the layouts the absorbed einsums consume (contraction axis
    second), so no weight is transposed per step. The layer cache is the static LatentKV, or an object with
    an ``attend_and_write_latent(attend_over, stored, cache_index, key_start) -> (o, new cache)`` method (the
    paged serving cache, ``dantinox.kv.paged.PagedLatentView``) that gathers its old latents as a
    LatentKV (or QuantLatentKV), calls ``attend_over`` on them and writes ``stored`` itself: (c_new [B, T, C],
    kr_new [B, T, R]), or for cache_dtype="int8" (c_q, kr_q int8, c_scale, r_scale [B, T, 1] float32, then
    the full-precision c_new, kr_new for the sink arrays).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.cfg, self.layer = cfg, layer   # layer: its index, for its cache spec (``dantinox.kv.spec``)
        H, D, C, R, E = cfg.n_heads, cfg.head_size, cfg.kv_latent_dim, cfg.rope_head_dim, cfg.dim
        Dv = cfg.value_size

        def linear(n_in, n_out, stddev=0.02):
            return nnx.Linear(n_in, n_out, use_bias=False, dtype=cfg.jnp_compute_dtype,
                              param_dtype=jnp.float32, kernel_init=nnx.initializers.normal(stddev=stddev),
                              rngs=rngs)

        Q = cfg.q_latent_dim or 0
        self.down = linear(E, Q + C + R)                       # [W_DQ ; W_DKV ; W_KR], one matmul over x
        self.q_norm = RMSNorm(Q, cfg.latent_norm_eps) if Q else None
        self.q_up = linear(Q or E, H * (D + R))                # [W_UQ ; W_QR]
        self.kv_norm = RMSNorm(C, cfg.latent_norm_eps)
        up_init = nnx.initializers.normal(stddev=0.02)
        self.w_uk = nnx.Param(up_init(rngs.params(), (H, D, C), jnp.float32))   # W_UK, stored [H, D, C]
        self.w_uv = nnx.Param(up_init(rngs.params(), (H, C, Dv), jnp.float32))  # W_UV, stored [H, C, Dv]
        self.out = linear(H * Dv, E, stddev=0.02 / math.sqrt(2 * cfg.num_blocks))

    def __call__(self, x, rope, layer_cache: LatentKV | None, cache_index, key_start, read_slots: int | None):
        """x: [B, T, E]; rope: (cos, sin) each [B, T, R/2]; layer_cache: LatentKV (c_kv [B, S, C], k_rope
        [B, S, R]) or None; cache_index: [B] int32 slot of the first new token; key_start: [B] int32 or None;
        read_slots: old cache slots to attend over (None all, 0 none, L the first L; see
        ``dantinox.kv.attend.old_slots``).

        Returns (y [B, T, E], updated LatentKV or None).
        """
        if isinstance(layer_cache, LayerCacheView):
            raise NotImplementedError("attention='mla' needs a latent cache (LatentKV or a paged latent view "
                                      "with attend_and_write_latent), not a per-head key/value layout")
        cfg = self.cfg
        B, T, _ = x.shape
        H, D, C, R = cfg.n_heads, cfg.head_size, cfg.kv_latent_dim, cfg.rope_head_dim
        Q = cfg.q_latent_dim or 0
        c_q, c_new, kr_new = jnp.split(self.down(x), [Q, Q + C], axis=-1)
        q = self.q_up(self.q_norm(c_q) if Q else x).reshape(B, T, H, D + R) * cfg.softmax_scale
        q_nope, q_rope = q[..., :D], apply_rope(q[..., D:], *rope)              # [B,T,H,D], [B,T,H,R]
        c_new = self.kv_norm(c_new)                                              # [B, T, C]
        kr_new = apply_rope(kr_new[:, :, None, :], *rope)[:, :, 0, :]            # [B, T, R]
        attention = self._path(T)
        o, new_cache = layer_spec(cfg, self.layer).attend_latent(
            lambda c, kr, old: attention(q_nope, q_rope, c, kr, old, cache_index, key_start),
            (c_new, kr_new), layer_cache, cache_index, key_start, read_slots)   # [B, T, H, Dv] float32
        return self.out(o.reshape(B, T, -1).astype(x.dtype)), new_cache

    def _path(self, T: int):
        """The attention form for a call with T new tokens per row (static).

        mla_absorb=False: always the naive (expanded) form. mla_absorb=True: the absorbed form unless the call
        has so many queries that expanding the latents is cheaper, as vLLM's MLA backend also does for
        prefill. Per key slot and head the absorbed form costs T (2C + R) multiply-adds (scores against
        [c_kv ; k_R], values against c_kv), the naive one 2 C D (expanding k_C and v_C once) + T (2D + R), so
        the naive form wins when T (C - D) >= C D: T >= 43 for C = 128, D = 32. Decode steps (T = 1) and short
        chunks stay absorbed; long prefill chunks and the uncached forward run naive. Same logits either way.
        """
        cfg = self.cfg
        C, D = cfg.kv_latent_dim, cfg.head_size
        if not cfg.mla_absorb or T * (C - D) >= C * D:
            return self._naive
        return self._absorbed

    def _absorbed(self, q_nope, q_rope, c_new, kr_new, old: LatentKV | None, cache_index, key_start):
        """Attention against the latent (W_UK folded into the query, W_UV applied after the sum).

        q_nope: [B, T, H, D]; q_rope: [B, T, H, R] (both scaled); c_new: [B, T, C]; kr_new: [B, T, R];
        old: LatentKV or None. Returns [B, T, H, D] float32.

        Layouts (what XLA on CPU runs fastest; see benchmarks/mla_decode.py): the T x H queries are
        flattened to N = T H. Scores are the product c_kv [S, C] @ q_lat [C, N] with the cache as the left
        operand in its stored layout (no per-step transpose of the cache); the small [S, N] result is then
        transposed to [N, S] so that masking and the softmax run along the minor axis, and the values are
        probs [N, S] @ c_kv [S, C]. The two per-head contractions with W_UK and W_UV run in float32 (the
        parameters' dtype; XLA on CPU has no bf16 x bf16 -> f32 kernel for these head-batched products).
        """
        f32, dt = jnp.float32, q_nope.dtype
        old, sinks = _float_latents(old, dt)
        B, T, H, _ = q_nope.shape
        q_lat = jnp.einsum("bthd,hdc->bthc", q_nope.astype(f32), self.w_uk[...].astype(f32))
        q_lat = q_lat.astype(dt).reshape(B, T * H, -1).transpose(0, 2, 1)             # [B, C, N]
        q_rot = q_rope.reshape(B, T * H, -1).transpose(0, 2, 1)                        # [B, R, N]

        def scores(c, kr):  # c: [B, S', C], kr: [B, S', R] -> [B, T, H, S'] float32
            s = (jnp.einsum("bsc,bcn->bsn", c, q_lat, preferred_element_type=f32)
                 + jnp.einsum("bsr,brn->bsn", kr, q_rot, preferred_element_type=f32))
            return s.transpose(0, 2, 1).reshape(B, T, H, -1)

        window = layer_spec(self.cfg, self.layer).window
        new_mask = new_token_mask(T, cache_index, key_start, window)                   # [1|B, T, T]
        new_scores = jnp.where(new_mask[:, :, None, :], scores(c_new, kr_new), NEG_INF)
        if old is None:
            probs = jax.nn.softmax(new_scores, axis=-1).reshape(B, T * H, T)
            o_lat = jnp.einsum("bnj,bjc->bnc", probs, c_new.astype(f32), preferred_element_type=f32)
        else:
            # keys: [sinks (A, float32) ; old slots (S, read back) ; new tokens (T)]
            A = 0 if sinks is None else sinks.c_kv.shape[1]
            keys = [(old.c_kv.astype(dt), old.k_rope.astype(dt),
                     old_slot_mask(old.c_kv.shape[1], T, cache_index, key_start, window, A))]
            if A:
                keys.insert(0, (sinks.c_kv.astype(dt), sinks.k_rope.astype(dt),
                                sink_mask(A, T, cache_index, key_start, window)))
            part = [jnp.where(mask[:, :, None, :], scores(c, kr), NEG_INF) for c, kr, mask in keys]
            probs = jax.nn.softmax(jnp.concatenate(part + [new_scores], axis=-1), axis=-1)
            probs = probs.reshape(B, T * H, -1)
            o_lat, first = 0.0, 0
            for c, _, _ in keys:
                width = c.shape[1]
                o_lat = o_lat + jnp.einsum("bns,bsc->bnc", probs[..., first:first + width].astype(dt), c,
                                           preferred_element_type=f32)
                first += width
            o_lat = o_lat + jnp.einsum("bnj,bjc->bnc", probs[..., first:], c_new.astype(f32),
                                       preferred_element_type=f32)
        return jnp.einsum("bthc,hcd->bthd", o_lat.reshape(B, T, H, -1), self.w_uv[...].astype(f32))

    def _naive(self, q_nope, q_rope, c_new, kr_new, old: LatentKV | None, cache_index, key_start):
        """Expand the latents to per-head keys [k_C ; k_R] and values v_C, then ordinary attention (K = H).

        Same arguments and result as ``_absorbed``.
        """
        B, T, H, _ = q_nope.shape
        old, sinks = _float_latents(old, q_nope.dtype)
        q = jnp.concatenate([q_nope, q_rope], axis=-1).transpose(0, 2, 1, 3)[:, :, None]  # [B, H, 1, T, D+R]
        k, v = self._expand(c_new, kr_new)
        def expand(lat):  # LatentKV or None -> per-head LayerKV [B, H, S', D + R] / [B, H, S', Dv] or None
            return None if lat is None else LayerKV(*self._expand(lat.c_kv.astype(q.dtype),
                                                                  lat.k_rope.astype(q.dtype)))

        y = attend(q, k, v, expand(old), cache_index, key_start, layer_spec(self.cfg, self.layer).window,
                   sinks=expand(sinks))                                               # [B, H, 1, T, D]
        return y[:, :, 0].transpose(0, 2, 1, 3)

    def _expand(self, c, kr):
        """c: [B, N, C], kr: [B, N, R] -> keys [B, H, N, D + R], values [B, H, N, D] (compute dtype)."""
        dt = self.cfg.jnp_compute_dtype
        c = c.astype(dt)
        k = jnp.einsum("bnc,hdc->bhnd", c, self.w_uk[...].astype(dt))
        v = jnp.einsum("bnc,hcd->bhnd", c, self.w_uv[...].astype(dt))
        kr = jnp.broadcast_to(kr.astype(k.dtype)[:, None], (k.shape[0], k.shape[1], kr.shape[1], kr.shape[2]))
        return jnp.concatenate([k, kr], axis=-1), v
