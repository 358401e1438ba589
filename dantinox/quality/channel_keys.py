"""The per-channel key cache (KIVI, ``dantinox.kv.channel_keys``) as a layer-cache view ``dantinox eval`` runs.

``ChannelKeyKV`` is a ``dantinox.kv.static.LayerCacheView``: ``dantinox.model.attention.Attention`` hands it
the new tokens' queries, their int8 read-back values and (in ``stored``) their full-precision keys, and it
attends and writes. It keeps the keys in float32 and reads each one back the way the layout of
``dantinox.kv.channel_keys`` would give it to a query at slot t: from its group's per-channel int8 codes when
the group was complete before t ((s // G + 1) G <= t), in full precision otherwise (the filling group), and in
full precision for the row's first A = cfg.sink_slots tokens when the candidate also keeps sinks (which then
count as zeros in their group's scales: their codes are never read). Values are
the model's per-token int8 read-back (``dantinox.kv.int8_rows``; the sinks' in full). So the numbers are the
per-channel layout's; its memory is not (float32 keys are held here; the bytes that layout takes are
``dantinox.budget.kv_channel_key_cache_bytes``).

The view is a pytree (children k, v; static group and sinks), so it is carried through ``lax.scan``. Slots are
grouped from slot 0 and a row's sequence starts at slot 0 (no left padding: key_start must be None); no
sliding window. Shape letters as in ``dantinox.kv.attend``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..kv.attend import NEG_INF
from ..kv.scores import grouped_scores, grouped_values
from ..kv.static import LayerKV, write_layer
from ..kv.channel_keys import channel_roundtrip, check_group, reads_int8


@jax.tree_util.register_pytree_node_class
class ChannelKeyKV:
    """One layer's per-channel key cache view. k, v: [B, K, S, D] float32 (S a multiple of group); group: G
    tokens per key-scale group; sinks: A leading tokens whose keys stay in full precision."""

    def __init__(self, k: jax.Array, v: jax.Array, group: int, sinks: int = 0):
        self.k, self.v, self.group, self.sinks = k, v, group, sinks

    def tree_flatten(self):
        return (self.k, self.v), (self.group, self.sinks)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def attend_and_write(self, q, k, v, cache_index, key_start, window, stored=None):
        """Write the new keys (full precision, ``stored[4]``) and values (``v``: int8 read-back), then attend.

        q: [B, K, G', T, D] scaled queries; k: [B, K, T, D] (per-token read-back keys, unused); v: [B, K, T, D];
        cache_index: [B] int32; stored: the int8 layer's (k_q, v_q, k_scale, v_scale, k_full, v_full).
        Returns (y [B, K, G', T, D] float32, the updated view). Raises ValueError for a float cache
        (stored None), left padding or a sliding window.
        """
        if stored is None or len(stored) != 6:
            raise ValueError("per-channel keys need the int8 cache (cache_dtype='int8' / --kv-dtype int8)")
        if key_start is not None or window is not None:
            raise ValueError("per-channel keys run without left padding (key_start) and without a sliding window")
        full = write_layer(LayerKV(self.k, self.v), stored[4], v, cache_index)
        T, S = q.shape[3], full.k.shape[2]
        t = cache_index[:, None, None] + jnp.arange(T)[None, :, None]          # [B, T, 1] query slots
        s = jnp.arange(S)[None, None, :]                                       # [1, 1, S] key slots
        from_int8 = reads_int8(s, t, self.group) & (s >= self.sinks)
        quantized = jnp.where((s >= self.sinks)[..., None], full.k, 0.0)      # sinks never set a group's scale
        scores = jnp.where(from_int8[:, None, None],
                           grouped_scores(q, channel_roundtrip(quantized, self.group).astype(q.dtype)),
                           grouped_scores(q, full.k.astype(q.dtype)))
        probs = jax.nn.softmax(jnp.where((s <= t)[:, None, None], scores, NEG_INF), axis=-1)
        return grouped_values(probs, full.v.astype(jnp.float32)), ChannelKeyKV(full.k, full.v, self.group,
                                                                                self.sinks)


def channel_key_cache(cfg: ModelConfig, batch: int, slots: int, group: int) -> tuple:
    """One ``ChannelKeyKV`` per layer, zeros of [batch, K, S, D] float32 with S = slots rounded up to whole
    groups; sinks = cfg.sink_slots. Raises ValueError for attention="mla", a cache that is not int8 or a bad
    group."""
    check_group(group)
    if cfg.attention == "mla" or cfg.cache_dtype != "int8":
        raise ValueError(f"--kv-keys channel needs an int8 MHA / GQA / MQA cache; the candidate has attention="
                         f"{cfg.attention!r}, cache_dtype={cfg.cache_dtype!r} (give --kv-dtype int8)")
    S = -(-slots // group) * group
    shape = (batch, cfg.kv_heads, S, cfg.head_size)
    return tuple(ChannelKeyKV(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), group, cfg.sink_slots)
                 for _ in range(cfg.num_blocks))
