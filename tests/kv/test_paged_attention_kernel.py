"""The compiled paged-attention kernel (``dantinox.kv.decode_kernel.paged_attention``): T new tokens per row
over a paged pool they were written into, read through block tables, against a float64 numpy softmax over the
same slots laid end to end, on every instruction set this CPU has; it equals the static-cache kernel bit for bit
on the same keys (so a served token equals the static cache's); a paged engine with the kernel serves the same
greedy tokens as one without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import spiky_model, tiny_config
from serving_util import drain, greedy, make_engine

from dantinox.kv import decode_kernel
from dantinox.kv.static import LayerKV
from dantinox.programs.store import clear_programs
from dantinox.quant.block_kernel import kernel_isa

pytestmark = pytest.mark.skipif(not decode_kernel.kernel_available()
                                or not hasattr(decode_kernel.extension(), "paged_attention_handler"),
                                reason="the compiled extension (with paged attention) is not built")

ISAS = [isa for isa in ("scalar", "avx2", "avx512")
        if kernel_isa() and ["scalar", "avx2", "avx512"].index(isa) <= ["scalar", "avx2", "avx512"].index(kernel_isa())]


def _pool_case(rng, B, K, G, D, T, P, M, N):
    """A pool [N, P, K, D] with B rows' tables (distinct random blocks), their cache indices, T new tokens per
    row written at cache_index .. cache_index + T - 1, and the rows laid end to end (the numpy view)."""
    pool_k, pool_v = (rng.normal(scale=2.0, size=(N, P, K, D)).astype(np.float32) for _ in range(2))
    blocks = rng.permutation(N)[:B * M].reshape(B, M).astype(np.int32)
    index = rng.integers(0, M * P - T + 1, size=B).astype(np.int32)
    q = rng.normal(size=(B, K, G, T, D)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(B, K, T, D)).astype(np.float32) for _ in range(2))
    for b in range(B):
        for t in range(T):
            s = index[b] + t
            pool_k[blocks[b, s // P], s % P] = k_new[b, :, t]
            pool_v[blocks[b, s // P], s % P] = v_new[b, :, t]
    rows = lambda pool: np.stack([pool[blocks[b]].reshape(M * P, K, D).transpose(1, 0, 2) for b in range(B)])  # noqa: E731
    return q, k_new, v_new, pool_k, pool_v, blocks, index, rows(pool_k), rows(pool_v)


def _reference(q, rows_k, rows_v, index, window):
    """float64: token t of row b over slots [lo, index + t] of its rows ([B, K, S, D])."""
    B, K, G, T, D = q.shape
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            hi = index[b] + t + 1
            lo = 0 if window is None else max(0, hi - window)
            keys, values = rows_k[b, :, lo:hi].astype(np.float64), rows_v[b, :, lo:hi].astype(np.float64)
            s = np.einsum("kgd,ksd->kgs", q[b, :, :, t].astype(np.float64), keys)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, :, t] = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), values)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B, K, G, D, T, P, M, window", [(2, 3, 3, 64, 1, 16, 24, None), (3, 2, 4, 16, 5, 4, 40, None),
                                                         (1, 1, 8, 40, 70, 8, 20, None), (2, 2, 2, 32, 9, 16, 12, 7),
                                                         (4, 4, 1, 8, 1, 4, 3, None)])
def test_paged_kernel_equals_a_numpy_softmax(isa, B, K, G, D, T, P, M, window):
    rng = np.random.default_rng(B * 1000 + T * 10 + P)
    q, k_new, v_new, pool_k, pool_v, table, index, rows_k, rows_v = _pool_case(rng, B, K, G, D, T, P, M, B * M + 3)
    got = decode_kernel.paged_attention(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(pool_k),
                                        jnp.asarray(pool_v), jnp.asarray(table), jnp.asarray(index), window, isa=isa)
    np.testing.assert_allclose(np.asarray(got), _reference(q, rows_k, rows_v, index, window), rtol=2e-5, atol=2e-5)


def test_paged_kernel_equals_the_static_kernel_bit_for_bit():
    rng = np.random.default_rng(11)
    q, k_new, v_new, pool_k, pool_v, table, index, rows_k, rows_v = _pool_case(rng, 2, 3, 3, 64, 4, 16, 20, 45)
    paged = decode_kernel.paged_attention(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                                          jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table),
                                          jnp.asarray(index), None)
    static = decode_kernel.verify_attention(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                                            LayerKV(jnp.asarray(rows_k), jnp.asarray(rows_v)), jnp.asarray(index),
                                            None, None)
    assert np.array_equal(np.asarray(paged), np.asarray(static))


def test_served_greedy_tokens_are_the_same_with_and_without_the_kernel(monkeypatch):
    model = spiky_model(tiny_config(attention="gqa", kv_heads=2))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [6, 5]]

    def serve():
        engine = make_engine(model)
        ids = [engine.add_request(p, greedy(10)) for p in prompts]
        out = drain(engine)
        return [out[i][0] for i in ids]

    with_kernel = serve()
    monkeypatch.setenv(decode_kernel.ENV, "off")
    jax.clear_caches()
    clear_programs()   # the engine's calls were traced with the kernel
    assert serve() == with_kernel
