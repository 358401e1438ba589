"""Each cache spec against the static reference: for every codec (float32, int8 rows with sinks, int8
per-channel keys) and kind (full, sliding window beside full layers, MLA latent), the bytes the specs count
equal the arrays allocated, the static cache's logits equal the uncached forward's at every position, and the
paged pool's equal the static cache's. A codec defined in this file alone (a lossless uint32 bit store) runs
through both storage forms: adding a codec is one file plus its test.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward, spiky_mla, spiky_model, tiny_config, uncached_logits
from serving_util import chunked_paged_run, static_logits

import dantinox as dx
from dantinox.kv import sizes
from dantinox.kv.attend import attend, old_slots
from dantinox.kv.codec import Codec, Field
from dantinox.kv.paged import PagedLayerKV
from dantinox.kv.pool import init_pool, pool_nbytes
from dantinox.kv.spec import codec_for, layer_specs, register_codec
from dantinox.kv.static import LayerKV, write_rows

P = 4    # block size of the paged runs (max_context 32: 8 table entries)
CASES = {
    "gqa-float32": dict(attention="gqa", kv_heads=2),
    "gqa-int8-token": dict(attention="gqa", kv_heads=2, cache_dtype="int8", kv_keys="token"),
    "gqa-int8-channel": dict(attention="gqa", kv_heads=2, cache_dtype="int8", kv_key_group=4),
    "mla-float32": dict(preset="tiny-mla"),
    "mla-int8": dict(preset="tiny-mla", cache_dtype="int8"),
    "hybrid-float32": dict(attention="gqa", kv_heads=2, sliding_window=5,
                           layer_types=["sliding_attention", "full_attention"]),
    "hybrid-int8-channel": dict(attention="gqa", kv_heads=2, sliding_window=5, cache_dtype="int8", kv_key_group=4,
                                layer_types=["full_attention", "sliding_attention"]),
}


def _config(case: str) -> dx.ModelConfig:
    fields = dict(CASES[case])
    preset = fields.pop("preset", "tiny")
    return dx.ModelConfig.from_preset(preset, **fields)


def _model(cfg):
    return spiky_mla(cfg) if cfg.attention == "mla" else spiky_model(cfg)


def _tolerance(want: np.ndarray) -> np.ndarray:
    return np.maximum(1e-4, 1e-5 * np.abs(want).max(-1, keepdims=True))


@pytest.mark.parametrize("case", CASES)
def test_spec_bytes_are_the_allocated_bytes(case):
    cfg = _config(case)
    assert sizes.cache_bytes(cfg, 2, cfg.max_context) == dx.cache_nbytes(dx.init_cache(cfg, 2))
    assert sizes.pool_bytes(cfg, 9, P, 3, 2) == pool_nbytes(init_pool(cfg, 9, P, 3, 2))
    assert sizes.pool_bytes(cfg, 9, P, 3, 2) == 9 * sizes.page_bytes(cfg, P) + 3 * sizes.sink_slot_bytes(cfg) + \
        2 * sizes.residual_slot_bytes(cfg)
    kinds = sizes.bytes_by_kind(cfg, cfg.max_context)
    assert sum(kinds.values()) == sizes.cache_bytes(cfg, 1, cfg.max_context)
    assert set(kinds) == {spec.kind for spec in layer_specs(cfg)}


@pytest.mark.parametrize("case", CASES)
def test_static_cache_equals_the_uncached_forward(case):
    cfg = _config(case)
    model = _model(cfg)
    seq = np.random.default_rng(7).integers(0, cfg.vocab_size, 15).tolist()
    want = uncached_logits(model, [seq])[0, :len(seq)]
    cache = dx.init_cache(cfg, 1)
    logits, cache, _ = forward(model, np.array([seq[:9]]), use_cache=True, kv_caches=cache, cache_index=0)
    got = [np.asarray(logits[0])]
    for t in range(9, len(seq)):
        logits, cache, _ = forward(model, np.array([[seq[t]]]), use_cache=True, kv_caches=cache, cache_index=t)
        got.append(np.asarray(logits[0]))
    got = np.concatenate(got)
    assert np.all(np.abs(got - want) <= _tolerance(want)), float(np.abs(got - want).max())


@pytest.mark.parametrize("case", CASES)
def test_paged_pool_equals_the_static_cache(case):
    cfg = _config(case)
    model = _model(cfg)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11, 17)]   # chunked_paged_run's lengths
    tables = np.zeros((3, cfg.max_context // P), np.int32)
    perm = 1 + rng.permutation(12)
    tables[0, :2], tables[1, :3], tables[2, :5] = perm[:2], perm[2:5], perm[5:10]
    got, _ = chunked_paged_run(model, init_pool(cfg, 13, P, 4, 4), seqs, tables)
    for b, seq in enumerate(seqs):
        want = static_logits(model, seq)
        assert np.all(np.abs(got[b] - want) <= _tolerance(want)), (b, float(np.abs(got[b] - want).max()))


def test_hybrid_layers_get_their_own_window():
    cfg = _config("hybrid-float32")
    assert [s.kind for s in layer_specs(cfg)] == ["sliding", "full"]
    assert [s.window for s in layer_specs(cfg)] == [5, None]
    # the same weights with the window on every layer: equal within the window, different past it
    seq = np.random.default_rng(2).integers(0, cfg.vocab_size, 20).tolist()
    hybrid = uncached_logits(_model(cfg), [seq])[0, :20]
    everywhere = uncached_logits(_model(cfg.replace(layer_types=None)), [seq])[0, :20]
    assert np.abs(hybrid[:5] - everywhere[:5]).max() < 1e-5 and np.abs(hybrid[5:] - everywhere[5:]).max() > 1e-3


@pytest.mark.parametrize("bad, why", [(["full_attention"], "num_blocks=2"),
                                       (["sliding_attention"] * 2, "without sliding_window"),
                                       (["global"] * 2, "got 'global'")])
def test_layer_types_refused_naming_the_field(bad, why):
    with pytest.raises(dx.ConfigError, match=f"layer_types.*{why}"):
        tiny_config(layer_types=bad)


# A codec defined here alone -----------------------------------------------------------------------------
class BitsKV(NamedTuple):
    """float32 keys and values stored as their uint32 bit patterns: [B, K, S, D] uint32 each."""

    k: jax.Array
    v: jax.Array

    def read(self, dtype):
        return LayerKV(jax.lax.bitcast_convert_type(self.k, jnp.float32).astype(dtype),
                       jax.lax.bitcast_convert_type(self.v, jnp.float32).astype(dtype)), None


class PagedBitsKV(NamedTuple):
    """The pool form: [N, P, K, D] uint32 each; gathers into BitsKV."""

    k: jax.Array
    v: jax.Array

    STATIC = BitsKV


class BitRows(Codec):
    name = "bits"
    element_dtype = "uint32"
    FIELDS = (Field("k", "slot", "head"), Field("v", "slot", "head"))

    def static_fields(self, latent):
        return self.FIELDS

    def paged_fields(self, latent):
        return self.FIELDS

    def static_type(self, latent):
        return BitsKV

    def paged_type(self, latent):
        return PagedBitsKV

    def encode(self, spec, rows, cache_index, key_start, layer_cache, names):
        return tuple(rows), tuple(jax.lax.bitcast_convert_type(r.astype(jnp.float32), jnp.uint32) for r in rows)

    def attend_static(self, spec, q, k, v, stored, layer, read_slots, cache_index, key_start, causal, valid=None):
        y = attend(q, k, v, old_slots(layer, read_slots), cache_index, key_start, spec.window, causal=causal)
        return y, None if layer is None else self.write(layer, stored, cache_index, key_start)

    def write(self, layer, stored, cache_index, key_start):
        return write_rows(layer, stored, cache_index, key_start)

    def __hash__(self):
        return hash("bits")

    def __eq__(self, other):
        return isinstance(other, BitRows)


def test_a_codec_defined_in_one_file_runs_static_and_paged():
    cfg = tiny_config(attention="gqa", kv_heads=4, vocab_size=96)   # a shape no other test compiles
    model = spiky_model(cfg)
    base = codec_for(cfg)
    jax.clear_caches()
    register_codec("float32", lambda c: BitRows())
    try:
        assert type(layer_specs(cfg)[0].codec) is BitRows
        cache = dx.init_cache(cfg, 1)
        assert type(cache[0]) is BitsKV and cache[0].k.dtype == jnp.uint32
        assert type(init_pool(cfg, 3, P)[0]) is PagedBitsKV
        assert sizes.cache_bytes(cfg, 1, cfg.max_context) == dx.cache_nbytes(cache)
        seq = np.random.default_rng(5).integers(0, cfg.vocab_size, 12).tolist()
        want = uncached_logits(model, [seq])[0, :12]
        np.testing.assert_allclose(static_logits(model, seq), want, atol=1e-4, rtol=0)
        tables = np.array([[1, 2, 0, 0, 0, 0, 0, 0], [3, 4, 5, 0, 0, 0, 0, 0], [6, 7, 8, 0, 0, 0, 0, 0]], np.int32)
        seq = np.random.default_rng(5).integers(0, cfg.vocab_size, 17).tolist()
        want = uncached_logits(model, [seq])[0, :17]
        got, _ = chunked_paged_run(model, init_pool(cfg, 10, P), [seq[:5], seq[:11], seq], tables)
        np.testing.assert_allclose(got[2], want, atol=1e-4, rtol=0)
    finally:
        register_codec("float32", lambda c: type(base)("float32"))
        jax.clear_caches()
    assert type(layer_specs(cfg)[0].codec) is type(base)
    assert type(init_pool(cfg, 3, P)[0]) is PagedLayerKV
