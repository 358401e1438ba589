"""Per-channel int8 keys (KIVI, Liu et al. 2024, sections 3.2-3.3; ``dantinox.kv.channel_keys``) in the paged
pool: the layer type, its attention over block tables, its writes and its bytes.

Letters as in ``dantinox.kv.paged`` (N blocks, P tokens per block, M block-table entries, R sink
slots, A sink tokens) plus G = cfg.key_group tokens per key-scale group and Q residual slots.

Layout of one layer (``PagedChannelKV``), P a multiple of G so a group never straddles two blocks:
  k        [N, P, K, D] int8     keys of complete groups, per-channel codes
  v        [N, P, K, D] int8     values, per token (``dantinox.kv.int8_rows``), as the per-token int8 pool
  k_scale  [N, P/G, K, D] f32    one scale per (group, KV head, channel): max over the group's G keys of |k| / 127
  v_scale  [N, P, K, 1] f32      one scale per (token, KV head)
  k_sink, v_sink [R, A, K, D] f32 the sequence's first A tokens in full (``dantinox.kv.sink_slots``)
  k_resid  [Q, 2G, K, D] f32     per running SEQUENCE: a ring of 2 G slots (slot s at s mod 2 G) with the
                                 full keys of its group still filling (KIVI's residual) and of the group
                                 before it, so a speculative rollback into that group still finds them
                                 (``dantinox.kv.channel_keys``, Rollback; ``residual_slots``)
The first four fields have the block axis, so copy-on-write, swap and prefix sharing move a block's key
scales with it (``paged_cache.BLOCK_FIELDS``). A block in the prefix cache is full, so all its groups are
complete and its keys are all int8: a prefix hit never needs a residual. The residual goes with its
sequence: swapped to host memory and back with its blocks, dropped on a recompute preemption (recomputed).

The read rule (the same as the eval view ``dantinox.quality.channel_keys.ChannelKeyKV``): a query at slot t
reads key slot s from its group's int8 codes when the group was complete before t, (s // G + 1) G <= t, and
s >= A; in float32 otherwise (the filling group from the residual or the call's own new keys; the sinks
from the sink slot). One call (a prefill chunk, a decode step) with cache_index c and n new tokens:
  1. gathers the row's blocks: codes and scales read back ([B, K, M P, D]), values read back, sinks;
  2. builds the full-precision keys of the slots from g0 = (c // G) G on: the residual (g0 <= s < c) and the
     new keys (c <= s < c + T), and quantizes their groups (``quantize_channels``), the A sinks counted as
     zeros (they are read from the sink slot, never from their codes, so an outlier sink token does not
     coarsen the rest of its group);
  3. attends with the rule above, one softmax over the M P slots, causal;
  4. writes: the codes and scales of every group that completes in this call (its slots below
     e = ((c + n) // G) G), the keys of slots max(g0, e - G) .. c + n - 1 into the residual ring, the values
     and value scales per token, and the sinks of slots below A.
Because a group's codes are computed once, from exactly its G full keys, by the same function the eval view
uses, the served numbers equal the eval view's (tests/serving/test_kv_channel_paged.py).

Bytes, per layer: N (P (2 K D + 4 K) + (P / G) 4 K D) for the blocks, R 2 A K D 4 for the sinks, Q 2 G K D 4
for the residual rings (``channel_block_bytes``, ``residual_set_bytes``); ``init_pool`` allocates exactly that.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .attend import NEG_INF
from .scores import grouped_scores, grouped_values
from .channel_keys import RING_GROUPS, dequantize_channels, quantize_channels, reads_int8
from .int8_rows import dequantize_rows

RESIDUAL_DTYPE = jnp.float32
RESIDUAL_BYTES = 4


class PagedChannelKV(NamedTuple):
    """One MHA / GQA / MQA layer's int8 pool with per-channel keys (module docstring). k, v: [N, P, K, D] int8;
    k_scale: [N, P/G, K, D] float32; v_scale: [N, P, K, 1] float32; k_sink, v_sink: [R, A, K, D] float32;
    k_resid: [Q, 2 G, K, D] float32 (residual rings)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    k_sink: jax.Array
    v_sink: jax.Array
    k_resid: jax.Array


def check_channel_block_size(cfg: ModelConfig, block_size: int) -> None:
    """ValueError naming --block-size and --kv-key-group unless block_size is a multiple of cfg.key_group
    (a key group must lie in one block)."""
    G = cfg.key_group
    if block_size % G:
        raise ValueError(f"--block-size {block_size} is not allowed with per-channel int8 keys (--kv-keys channel, "
                         f"the int8 default) and --kv-key-group {G}: the block size must be a multiple of the key "
                         f"group (e.g. --block-size {G}, serve's default here), so a group of keys never straddles "
                         "two blocks; or give --kv-keys token")


def _rows(pool: jax.Array, table: jax.Array) -> jax.Array:
    """pool [N, X, K, W] gathered through table [B, M] -> [B, K, M X, W]."""
    B, M = table.shape
    _, X, K, W = pool.shape
    return pool[table].reshape(B, M * X, K, W).transpose(0, 2, 1, 3)


def _at(a: jax.Array, index: jax.Array) -> jax.Array:
    """a [B, K, X, D] taken at slots index [B, S] (clipped into range) -> [B, K, S, D]."""
    index = jnp.clip(index, 0, a.shape[2] - 1)
    return jnp.take_along_axis(a, index[:, None, :, None], axis=2)


class PagedChannelView(NamedTuple):
    """A per-channel key pool layer plus the batch's paging metadata, handed to the model as its layer cache.

    pool: PagedChannelKV; block_table: [B, M] int32; num_new: [B] int32 valid new tokens per row; sink_slot:
    [B] int32 (R: none); residual_slot: [B] int32 each row's residual slot (Q: none, for unused rows).
    """

    pool: PagedChannelKV
    block_table: jax.Array
    num_new: jax.Array
    sink_slot: jax.Array
    residual_slot: jax.Array

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None):
        """Attention hook called by ``dantinox.model.attention.Attention`` (module docstring, steps 1-4).

        q: [B, K, G', T, D] scaled queries; k: unused (the per-token read-back keys); v: [B, K, T, D] the new
        values read back from int8 (sinks in full); cache_index: [B] int32; stored: the int8 layer's (k_q, v_q,
        k_scale, v_scale, k_full, v_full), of which k_full, v_full [B, K, T, D] and v_q, v_scale are used.
        window: the sliding window (a query sees the slots t - window < s <= t, sinks included, as the static
        cache) or None. Returns (y [B, K, G', T, D] float32, the view with the new tokens written). Raises
        ValueError for a key_start or a missing ``stored`` (a pool built for another cache dtype).
        """
        if key_start is not None:
            raise ValueError("per-channel keys (--kv-keys channel) are served without left padding")
        if stored is None or len(stored) != 6:
            raise ValueError("the pool holds PagedChannelKV (int8, per-channel keys) but the model does not "
                             "write an int8 layer: build the pool from the model's config")
        pool, table, c = self.pool, self.block_table, cache_index
        R, A, T, S = pool.k_resid.shape[1], pool.k_sink.shape[1], q.shape[3], table.shape[1] * pool.k.shape[1]
        G = R // RING_GROUPS
        s = jnp.arange(S, dtype=jnp.int32)[None]                                  # [1, S] key slots
        g0 = (c // G * G)[:, None]                                                # [B, 1] filling group
        sinks_k, sinks_v = (_tokens(a[self.sink_slot]) for a in (pool.k_sink, pool.v_sink))  # [B, K, A, D]
        resid = _tokens(pool.k_resid[self.residual_slot])                         # [B, K, R, D] rings
        is_new, in_sink = (s >= c[:, None]) & (s < c[:, None] + T), (s < A) & (s < c[:, None])
        new_at, old = s - c[:, None], lambda x: x[:, None, :, None]
        full = jnp.where(old(is_new), _at(stored[4].astype(jnp.float32), new_at),
                         jnp.where(old((s >= g0) & (s < c[:, None])), _at(resid, s % R),
                                   _with_sinks(old(in_sink), sinks_k, s, A, 0.0)))
        codes, scales = quantize_channels(jnp.where(old(s < A), 0.0, full), G)   # sinks: never read as int8
        stored_keys = dequantize_channels(_rows(pool.k, table), _rows(pool.k_scale, table), G)
        int8_keys = jnp.where(old(s < g0), stored_keys, dequantize_channels(codes, scales, G))
        values = jnp.where(old(is_new), _at(v.astype(jnp.float32), new_at),
                           _with_sinks(old(in_sink), sinks_v, s, A,
                                       dequantize_rows(_rows(pool.v, table), _rows(pool.v_scale, table))))
        t = c[:, None, None] + jnp.arange(T, dtype=jnp.int32)[None, :, None]     # [B, T, 1] query slots
        from_int8 = reads_int8(s[:, None], t, G) & (s[:, None] >= A)             # [B, T, S]
        if T == 1:   # one query per row (decode): choose each slot's key first, one matmul
            keys = jnp.where(old(from_int8[:, 0]), int8_keys, full)
            scores = grouped_scores(q, keys.astype(q.dtype))
        else:        # a prefill chunk: a group completing inside it is read both ways
            scores = jnp.where(from_int8[:, None, None], grouped_scores(q, int8_keys.astype(q.dtype)),
                               grouped_scores(q, full.astype(q.dtype)))
        visible = s[:, None] <= t                                                # [B, T, S]
        if window is not None:
            visible = visible & (t - s[:, None] < window)
        probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, NEG_INF), axis=-1)
        y = grouped_values(probs, values)
        return y, self._replace(pool=self._written(stored, codes, scales, full, c, T))

    def _written(self, stored, codes, scales, full, c, T: int) -> PagedChannelKV:
        """The pool with step 4 done. codes [B, K, S, D] int8, scales [B, K, S / G, D], full [B, K, S, D]: the
        call's quantized and full-precision keys by slot."""
        pool, table, n = self.pool, self.block_table, self.num_new
        N, P = pool.k.shape[:2]
        Q, R, A = pool.k_resid.shape[0], pool.k_resid.shape[1], pool.k_sink.shape[1]
        G = R // RING_GROUPS
        g0, end = c // G * G, c + n
        done = end // G * G                                                       # complete groups end here
        width = -(-(T + G - 1) // G) * G                                          # slots g0 .. touched
        slot = g0[:, None] + jnp.arange(width, dtype=jnp.int32)[None]            # [B, W]
        k = _put(pool.k, _tokens(_at(codes, slot)), _block(table, slot, slot < done[:, None], P, N), slot % P)
        group = g0[:, None] // G + jnp.arange(width // G, dtype=jnp.int32)[None]  # [B, W / G]
        k_scale = _put(pool.k_scale, _tokens(_at(scales, group)),
                       _block(table, group * G, (group + 1) * G <= done[:, None], P, N), group * G % P // G)
        new = c[:, None] + jnp.arange(T, dtype=jnp.int32)[None]                 # [B, T] new slots
        valid = jnp.arange(T)[None] < n[:, None]
        block, offset = _block(table, new, valid, P, N), new % P
        v = _put(pool.v, _tokens(stored[1]), block, offset)
        v_scale = _put(pool.v_scale, _tokens(stored[3]), block, offset)
        k_sink, v_sink = pool.k_sink, pool.v_sink
        if A:
            sink_row = jnp.where(valid & (new < A), self.sink_slot[:, None], pool.k_sink.shape[0])
            sink_at = jnp.clip(new, 0, A - 1)
            k_sink, v_sink = (_put(a, _tokens(x), sink_row, sink_at)
                              for a, x in ((pool.k_sink, stored[4]), (pool.v_sink, stored[5])))
        rest = (done - G)[:, None] + jnp.arange(R, dtype=jnp.int32)[None]       # [B, R] the last two groups
        kept = (rest >= g0[:, None]) & (rest < end[:, None])
        k_resid = _put(pool.k_resid, _tokens(_at(full, rest)), jnp.where(kept, self.residual_slot[:, None], Q),
                       rest % R)
        return PagedChannelKV(k, v, k_scale, v_scale, k_sink, v_sink, k_resid)


def _with_sinks(in_sink, sinks, s, A: int, other):
    """other [B, K, S, D] with the sink rows sinks [B, K, A, D] where in_sink [B, 1, S, 1] (A = 0: other)."""
    return jnp.where(in_sink, _at(sinks, s), other) if A else other


def _block(table, slot, valid, P: int, N: int) -> jax.Array:
    """The block holding each slot [B, X] of its row (table [B, M]); N (a dropped write) where not valid."""
    index = jnp.clip(slot // P, 0, table.shape[1] - 1)
    return jnp.where(valid, jnp.take_along_axis(table, index, axis=1), N)


def _tokens(a: jax.Array) -> jax.Array:
    """[B, K, Y, W] -> [B, Y, K, W] (the pool's token-major order)."""
    return a.transpose(0, 2, 1, 3)


def _put(pool: jax.Array, rows: jax.Array, index, offset) -> jax.Array:
    """pool [N, X, K, W] with rows [B, Y, K, W] written at (index, offset) [B, Y]; index N is dropped."""
    flat = rows.reshape((-1,) + rows.shape[2:]).astype(pool.dtype)
    return pool.at[index.reshape(-1), offset.reshape(-1)].set(flat, mode="drop")
