"""The block kernel's tiled many-row product (``csrc/block_gemm.inc``, prefill) against an independent reference:
the ``gguf`` package's dequantizer followed by a float64 matmul, for every block format and every instruction set
this CPU runs, at row counts that are not multiples of any tile height (12 / 6 / 4 rows) and output widths that are
not multiples of any panel (32 / 16 / 8 channels); a row's result bit for bit the same whatever rows surround it;
``block_matmul``'s choice between the tiled product and the few-row loops. Skips, naming the reason, where the
C++ extension is not built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_block_kernel import ISAS, close, reference, weights

from dantinox.quant import block_kernel
from dantinox.quant.block_formats import BLOCK_FORMATS
from dantinox.quant.block_kernel import TILED_MIN_TOKENS, block_matmul, kernel_matmul, kernel_status

KERNEL, WHY = kernel_status()
needs_kernel = pytest.mark.skipif(not KERNEL, reason=f"block kernel not in use here: {WHY}")


def tiled(x, data, fmt, isa="auto"):
    return np.asarray(jax.jit(lambda x, d: kernel_matmul(x, d, fmt, isa, tiled=True))(x, data))


@needs_kernel
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_tiled_product_matches_the_reference(fmt):
    """37 output channels (one full and one narrow panel on every instruction set) and 512 inputs (two slices of
    256); 1, 13, 29 and 250 rows: a lone row, a tile plus one, tails of every tile height, several row chunks."""
    rows, cols = 37, 512
    data = weights(fmt, rows, cols, seed=11)
    rng = np.random.default_rng(12)
    for batch in (1, 13, 29, 250):
        x = rng.standard_normal((batch, cols)).astype(np.float32)
        want = reference(x, data, fmt)
        for isa in ISAS:
            got = tiled(x, data, fmt, isa)
            assert got.shape == (batch, rows) and close(got, want) < 2e-6, (isa, batch)


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_tiled_product_wide_inputs_and_many_channels(fmt):
    """1,536 inputs (six slices) and 200 output channels split among many tasks; a chunk of 85 rows."""
    rows, cols = 200, 1536
    data = weights(fmt, rows, cols, seed=13)
    x = np.random.default_rng(14).standard_normal((85, cols)).astype(np.float32)
    want = reference(x, data, fmt)
    for isa in ISAS:
        assert close(tiled(x, data, fmt, isa), want) < 2e-6, isa


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_tiled_row_does_not_depend_on_the_rows_beside_it(fmt):
    """Each row's outputs are the same float32 values whether the call has 1, 18, 31 or 300 rows and wherever
    the row falls in a tile or chunk (every instruction set): a prompt's token gets the same result alone, in a
    chunk or in the whole prompt."""
    rows, cols = 45, 512
    data = weights(fmt, rows, cols, seed=15)
    x = np.random.default_rng(16).standard_normal((300, cols)).astype(np.float32)
    for isa in ISAS:
        whole = tiled(x, data, fmt, isa)
        for start, stop in ((0, 1), (5, 23), (100, 131), (299, 300)):
            assert np.array_equal(tiled(x[start:stop], data, fmt, isa), whole[start:stop]), (isa, start, stop)


@needs_kernel
def test_block_matmul_takes_the_tiled_product_from_tiled_min_tokens(monkeypatch):
    """x [B, T, M]: T >= TILED_MIN_TOKENS runs the tiled product (bit for bit kernel_matmul(tiled=True)), fewer
    tokens the few-row loops even for more rows in all (a batch of verify calls keeps a decode step's arithmetic);
    both match the reference, and the pure-JAX path agrees."""
    assert TILED_MIN_TOKENS > 17   # a verify call holds MAX_SPEC_TOKENS + 1 = 17 tokens per row
    from dantinox.generation.speculative import MAX_SPEC_TOKENS
    assert TILED_MIN_TOKENS > MAX_SPEC_TOKENS + 1
    rows, cols = 33, 256
    data = weights("Q4_1", rows, cols, seed=17)
    rng = np.random.default_rng(18)
    fn = jax.jit(lambda x, d: block_matmul(x, d, "Q4_1", cols))
    many = rng.standard_normal((2, TILED_MIN_TOKENS, cols)).astype(np.float32)
    got = np.asarray(fn(many, data))
    assert np.array_equal(got.reshape(-1, rows), tiled(many.reshape(-1, cols), data, "Q4_1"))
    few = rng.standard_normal((4, TILED_MIN_TOKENS - 1, cols)).astype(np.float32)   # 4 verify calls' rows
    assert few.shape[0] * few.shape[1] <= block_kernel.KERNEL_MAX_ROWS
    lowered = lambda x: jax.jit(lambda x, d: block_matmul(x, d, "Q4_1", cols)).lower(x, data).as_text()  # noqa
    assert "tiled = 0 : i64" in lowered(few) and "tiled = 1 : i64" in lowered(many)
    few_out = np.asarray(fn(few, data))
    loops = np.asarray(jax.jit(lambda x, d: kernel_matmul(x, d, "Q4_1"))(few.reshape(-1, cols), data))
    assert np.array_equal(few_out.reshape(-1, rows), loops)
    for x, out in ((many, got), (few, few_out)):
        assert close(out.reshape(-1, rows), reference(x.reshape(-1, cols), data, "Q4_1")) < 2e-6
    monkeypatch.setenv("DANTINOX_BLOCK_KERNEL", "off")
    fallback = np.asarray(jax.jit(lambda x, d: block_matmul(x, d, "Q4_1", cols))(many, data))
    assert np.abs(fallback - got).max() <= 1e-5 * np.abs(got).max()


@needs_kernel
def test_tiled_product_inside_a_lax_loop():
    """A fori_loop carries the tiled call; each step feeds back the previous output's first columns."""
    rows, cols = 300, 256
    data = weights("Q4_0", rows, cols, seed=19)
    x0 = np.random.default_rng(20).standard_normal((40, cols)).astype(np.float32)

    def steps(x, d):
        return jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(0.05 * kernel_matmul(x, d, "Q4_0", tiled=True)[:, :cols]),
                                 x)

    want = x0.astype(np.float64)
    w = reference(np.eye(cols, dtype=np.float32), data, "Q4_0")   # W^T [cols, rows] in float64
    for _ in range(3):
        want = np.tanh(0.05 * (want @ w[:, :cols]))
    assert np.abs(np.asarray(jax.jit(steps)(x0, data)) - want).max() < 1e-5
