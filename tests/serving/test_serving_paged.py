"""Paged attention: logits through the block pool equal the static cache's, for ragged batches, chunked
prefill and decode, with MHA, GQA and MQA; padding positions never reach the pool."""

import numpy as np
import pytest
from conftest import spiky_model, tiny_config
from flax import nnx
from serving_util import chunked_paged_run, paged_logits, static_logits

import dantinox as dx
from dantinox.kv.sizes import blocks_for_memory, page_bytes
from dantinox.kv.pool import init_pool, pool_nbytes

P = 4  # block size
M = 8  # block-table entries (max_context 32 / P)


SHAPES = [dict(attention="mha", kv_heads=None), dict(attention="gqa", kv_heads=2),
          dict(attention="mqa", kv_heads=None)]


@pytest.mark.parametrize("attn", SHAPES, ids=lambda a: a["attention"])
def test_paged_logits_equal_static_ragged_chunked(attn):
    cfg = tiny_config(**attn)
    model = spiky_model(cfg)
    rng = np.random.default_rng(1)
    lengths = [5, 11, 17]
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    # Non-contiguous, interleaved block tables; unused entries point at block 0 (masked, never written).
    perm = 1 + rng.permutation(16)  # block 0 is only ever a padding entry
    tables = np.zeros((3, M), np.int32)
    tables[0, :2], tables[1, :3], tables[2, :5] = perm[:2], perm[2:5], perm[5:10]
    pool = init_pool(cfg, 17, P)
    got, pool = chunked_paged_run(model, pool, seqs, tables)
    for b in range(3):
        np.testing.assert_allclose(got[b], static_logits(model, seqs[b]), atol=1e-5, rtol=0)
    # Blocks never listed in a table stay zero: padding and unused rows wrote nothing.
    untouched = np.concatenate([[0], perm[10:]])
    for layer in pool:
        assert float(np.abs(np.asarray(layer.k)[untouched]).max()) == 0.0   # on the host: no eager compiles
        assert float(np.abs(np.asarray(layer.v)[untouched]).max()) == 0.0


def test_padding_is_dropped_and_pool_is_sized_from_memory():
    cfg = tiny_config(attention="gqa", kv_heads=2)
    model = spiky_model(cfg)
    graphdef, params = nnx.split(model)
    pool = init_pool(cfg, 6, P)
    table = np.array([[1, 2, 0, 0, 0, 0, 0, 0]], np.int32)
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], np.int32)
    start, num_new = np.array([0], np.int32), np.array([5], np.int32)
    _, pool = paged_logits(graphdef, params, pool, ids, start, num_new, table)
    for layer in pool:
        k = np.asarray(layer.k)
        assert np.abs(k[1]).min() > 0 and np.abs(k[2, 0]).min() > 0  # tokens 0..4 written
        assert np.abs(k[2, 1:]).max() == 0 and np.abs(k[[0, 3, 4, 5]]).max() == 0  # padding dropped
    per_block = page_bytes(cfg, P)
    assert per_block == P * cfg.num_blocks * dx.bytes_per_token_per_layer(cfg)
    assert pool_nbytes(init_pool(cfg, 7, P)) == 7 * per_block
    assert blocks_for_memory(cfg, 7 * per_block + per_block - 1, P) == 7
    with pytest.raises(ValueError, match="holds no block"):
        blocks_for_memory(cfg, per_block - 1, P)
    with pytest.raises(ValueError, match="block_size"):
        init_pool(cfg, 4, 0)
