"""The block matrix product per GGUF block format against an independent reference: the ``gguf`` package's own
dequantizer (``gguf.quants.dequantize``) followed by a float64 matmul. The compiled kernel (each instruction set
this CPU has), the pure-JAX path (DANTINOX_BLOCK_KERNEL=off) and the JAX dequantizer, at B = 1, 3, 16 (and 20:
two passes of 16), with odd row counts; the kernel inside a jax.lax loop. Kernel tests skip, naming the
reason, where the C++ extension is not built (``python setup.py build_ext --inplace`` in a checkout)."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from gguf_util import RANDOM_BLOCKS, random_blocks

from dantinox.quant import block_kernel
from dantinox.quant.block_formats import BLOCK_FORMATS, check_blocks, dequantize_blocks, row_bytes
from dantinox.quant.block_kernel import block_matmul, kernel_isa, kernel_matmul, kernel_status

Q = gguf.GGMLQuantizationType
KERNEL, WHY = kernel_status()
needs_kernel = pytest.mark.skipif(not KERNEL, reason=f"block kernel not in use here: {WHY}")
ISAS = {"avx512": ("scalar", "avx2", "avx512"), "avx2": ("scalar", "avx2"), "scalar": ("scalar",),
        None: ()}[kernel_isa()]  # every code path this CPU can run


def weights(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Blocks of ``fmt`` for a [rows, cols] matrix: gguf's quantizer where it has one, else random valid blocks."""
    rng = np.random.default_rng(seed)
    if fmt in RANDOM_BLOCKS:
        return random_blocks(Q[fmt], rows, cols, rng)
    return quantize((rng.standard_normal((rows, cols)) * 0.5).astype(np.float32), Q[fmt])


def reference(x: np.ndarray, data: np.ndarray, fmt: str) -> np.ndarray:
    """x [B, M] . W^T in float64 with W dequantized by the gguf package."""
    w = dequantize(data, Q[fmt]).astype(np.float64)
    return x.astype(np.float64) @ w.T


def close(got, want) -> float:
    """Largest error relative to the largest |reference| value (float32 sums of M products)."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_jax_dequantizer_equals_gguf(fmt):
    cols = 512
    data = weights(fmt, 7, cols)
    assert data.shape == (7, row_bytes(fmt, cols))
    got = np.asarray(jax.jit(lambda d: dequantize_blocks(d, fmt, cols))(data))
    assert np.array_equal(got, dequantize(data, Q[fmt]))  # the same float32 values, bit for bit


@needs_kernel
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernel_and_fallback_match_the_reference(fmt, monkeypatch):
    rows, cols = 37, 512  # an odd number of output rows: the thread chunks do not divide it
    data = weights(fmt, rows, cols, seed=1)
    rng = np.random.default_rng(2)
    for batch in (1, 3, 16, 20):
        x = rng.standard_normal((batch, cols)).astype(np.float32)
        want = reference(x, data, fmt)
        for isa in ISAS:
            got = jax.jit(lambda x, d, isa=isa: kernel_matmul(x, d, fmt, isa))(x, data)
            assert got.shape == (batch, rows) and close(got, want) < 2e-6, (isa, batch)
        auto = jax.jit(lambda x, d: block_matmul(x, d, fmt, cols))(x, data)
        assert close(auto, want) < 2e-6, batch
        monkeypatch.setenv("DANTINOX_BLOCK_KERNEL", "off")
        fallback = jax.jit(lambda x, d: block_matmul(x, d, fmt, cols))(x, data)  # a new trace: the XLA dot
        monkeypatch.delenv("DANTINOX_BLOCK_KERNEL")
        assert close(fallback, want) < 2e-6, batch
        assert np.abs(np.asarray(fallback) - np.asarray(auto)).max() <= 1e-5 * np.abs(want).max()


@needs_kernel
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernel_decodes_every_weight_exactly(fmt):
    """x = the identity: each output row is one column of W, a sum of one product w * 1 and zeros, so the
    kernel's decoded weights appear bit for bit (every instruction set) and must equal gguf's dequantizer."""
    rows, cols = 9, 512
    data = weights(fmt, rows, cols, seed=11)
    want = dequantize(data, Q[fmt]).T                                     # [cols, rows]
    for isa in ISAS:
        got = np.asarray(jax.jit(lambda x, d, isa=isa: kernel_matmul(x, d, fmt, isa))(np.eye(cols, dtype=np.float32),
                                                                                     data))
        assert np.array_equal(got, want), isa


def test_fallback_matches_the_reference_without_the_kernel(monkeypatch):
    monkeypatch.setenv("DANTINOX_BLOCK_KERNEL", "off")
    assert kernel_status() == (False, "pure-JAX path (DANTINOX_BLOCK_KERNEL=off)")
    data = weights("Q4_K", 9, 256)
    x = np.random.default_rng(3).standard_normal((2, 5, 256)).astype(np.float32)
    got = jax.jit(lambda x, d: block_matmul(x, d, "Q4_K", 256))(x, data)
    assert got.shape == (2, 5, 9)
    assert close(np.asarray(got).reshape(10, 9), reference(x.reshape(10, 256), data, "Q4_K")) < 2e-6


@needs_kernel
def test_kernel_inside_a_lax_loop_and_a_large_matrix():
    """Each step's input is the previous output's first columns (scaled into tanh's steep range): a fori_loop
    carries the custom call."""
    rows, cols = 1001, 576
    data = weights("Q8_0", rows, cols, seed=4)
    x0 = np.random.default_rng(5).standard_normal((2, cols)).astype(np.float32)

    def steps(x, d):
        return jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(0.05 * kernel_matmul(x, d, "Q8_0")[:, :cols]), x)

    want = x0.astype(np.float64)
    w = dequantize(data, Q.Q8_0).astype(np.float64)
    for _ in range(3):
        want = np.tanh(0.05 * (want @ w.T[:, :cols]))
    assert np.abs(np.asarray(jax.jit(steps)(x0, data)) - want).max() < 1e-5


def test_check_blocks_finds_nan_scales():
    data = weights("Q6_K", 3, 256)
    assert check_blocks(data, "Q6_K") == 0
    data[1, 208:210] = np.array([np.nan], np.float16).view(np.uint8)
    assert check_blocks(data, "Q6_K") == 1


def test_unknown_format_and_bad_width():
    with pytest.raises(ValueError, match="'Q8_1' is not supported: one of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, "
                       "Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS"):
        row_bytes("Q8_1", 64)
    with pytest.raises(ValueError, match="multiples of 256"):
        row_bytes("Q4_K", 64)
    assert block_kernel.KERNEL_MAX_ROWS == 128


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_row_does_not_depend_on_the_rows_beside_it(fmt):
    """Each activation row's outputs are the same float32 values, bit for bit, whether the call has 1, 3, 6 or 17
    rows (every instruction set): a decode step and a verification call of k + 1 rows agree exactly."""
    rows, cols = 45, 576
    data = weights(fmt, rows, cols, seed=6)
    x = np.random.default_rng(7).standard_normal((17, cols)).astype(np.float32)
    for isa in ISAS:
        alone = np.asarray(jax.jit(lambda x, d, isa=isa: kernel_matmul(x, d, fmt, isa))(x[:1], data))
        for batch in (3, 6, 17):
            got = np.asarray(jax.jit(lambda x, d, isa=isa: kernel_matmul(x, d, fmt, isa))(x[:batch], data))
            assert np.array_equal(got[0], alone[0]), (isa, batch)


@needs_kernel
def test_concurrent_calls_from_several_threads():
    """Calls made at once from several Python threads (each a separate jitted program) share the kernel's helper
    threads through its job queue; every result matches the reference."""
    import threading

    rows, cols = 3000, 576
    data = weights("Q4_1", rows, cols, seed=8)
    xs = [np.random.default_rng(9 + i).standard_normal((1 + i % 3, cols)).astype(np.float32) for i in range(4)]
    fn = jax.jit(lambda x, d: jax.lax.fori_loop(0, 20, lambda i, acc: acc + kernel_matmul(x, d, "Q4_1"),
                                                jnp.zeros((x.shape[0], rows), jnp.float32)))
    results = [None] * len(xs)

    def work(i):
        results[i] = np.asarray(fn(xs[i], data))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, got in zip(xs, results):
        assert close(got / 20, reference(x, data, "Q4_1")) < 2e-6
