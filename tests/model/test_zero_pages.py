"""Zeros whose pages the operating system provides (``dantinox.kv.zero_pages``): the same values as numpy's
zeros for every dtype and size (odd sizes, buffers under the 64 KiB threshold, memory that held other values
just before), not resident until written, a tracer inside a trace, and ``jnp.zeros`` without the extension.
The serving pool and the static cache are built with it (``zero_arrays``), so every engine and generation test
also checks it against the uncached model."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dantinox.cli.serve import host_available_bytes, kv_summary
from dantinox.kv import zero_pages
from dantinox.kv.static import zero_arrays

needs_pages = pytest.mark.skipif(not zero_pages.pages_available(), reason="the compiled extension is not installed")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@needs_pages
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint32])
@pytest.mark.parametrize("shape", [(0,), (3,), (1000, 37), (3_000_001,), (64, 16, 3, 64)])
def test_zeros_equal_numpy_zeros_even_in_reused_memory(shape, dtype):
    garbage = [jnp.full(shape, 7, dtype) for _ in range(4)]   # freed just before: the allocator may reuse it
    jax.block_until_ready(garbage)
    del garbage
    out = zero_pages.zeros(shape, dtype)
    assert out.shape == shape and out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out), np.zeros(shape, jnp.dtype(dtype)))


@needs_pages
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are left to the OS on Linux only")
def test_pages_are_resident_only_once_written():
    """256 MiB of zeros add far less than 256 MiB resident; writing a slice makes that slice resident."""
    before = _resident_bytes()
    pool = zero_pages.zeros((64, 1024, 1024), jnp.float32)
    jax.block_until_ready(pool)
    assert _resident_bytes() - before < 64 * 2**20
    pool = jax.jit(lambda a: a.at[:16].set(1.0), donate_argnums=0)(pool)
    jax.block_until_ready(pool)
    assert _resident_bytes() - before > 48 * 2**20            # the 64 MiB written are resident now
    assert float(pool[15].sum()) == 1024 * 1024 and float(pool[16:].max()) == 0.0


def test_inside_a_trace_it_is_the_traced_zeros():
    @jax.jit
    def f(x):
        z = zero_pages.zeros((4, 3), jnp.float32)
        assert isinstance(z, jax.core.Tracer)
        return z + x

    np.testing.assert_array_equal(np.asarray(f(1.0)), np.ones((4, 3), np.float32))


def test_without_the_extension_it_is_jnp_zeros(monkeypatch):
    monkeypatch.setattr(zero_pages, "pages_available", lambda: False)
    calls = []
    monkeypatch.setattr(zero_pages, "_zero_pages", lambda *a: calls.append(a))
    out = zero_arrays([(2, 5)], jnp.float32, int8=True, sinks=[(1, 2)])
    assert calls == [] and [a.shape for a in out] == [(2, 5), (2, 1), (1, 2)]
    assert all(float(jnp.abs(a).max()) == 0.0 for a in out)


def test_a_negative_dimension_gets_the_jnp_error():
    with pytest.raises((TypeError, ValueError)):
        zero_pages.zeros((2, -1), jnp.float32)


def test_a_pool_larger_than_the_available_memory_is_named_at_start(monkeypatch):
    """The pool no longer fails while zero-filled at start when the host lacks the memory: the start-up line
    says so instead."""
    from dantinox.cli import entrypoint as cli
    from dantinox.cli import serve
    from dantinox.cli.serve import build_engine

    engine, _, _ = build_engine(cli.build_parser().parse_args(["serve", "--kv-memory", "1MB"]))
    nbytes = engine.stats()["kv_cache_bytes"]
    monkeypatch.setattr(serve, "host_available_bytes", lambda: nbytes - 1)
    assert f"the KV pool ({nbytes / 2**20:.0f} MiB) is larger than the memory this host has available" in \
        kv_summary(engine)
    monkeypatch.setattr(serve, "host_available_bytes", lambda: nbytes)
    assert "larger than the memory" not in kv_summary(engine)


def test_host_available_bytes_reads_meminfo():
    available = host_available_bytes()
    if sys.platform.startswith("linux"):
        assert available is not None and 0 < available < 2**50


def test_the_advice_fits_kv_memory_all(monkeypatch):
    from dantinox.cli import entrypoint as cli
    from dantinox.cli import serve
    from dantinox.cli.serve import build_engine

    engine, _, _ = build_engine(cli.build_parser().parse_args(["serve", "--kv-memory", "1MB", "--kv-memory-all"]))
    monkeypatch.setattr(serve, "host_available_bytes", lambda: 1)
    line = kv_summary(engine)
    assert line.endswith("lower --kv-memory"), line


def test_a_pool_the_host_cannot_allocate_is_one_clear_error(monkeypatch, capsys):
    """`serve --kv-memory 400GB --kv-memory-all` on a 24 GiB host: XLA's RESOURCE_EXHAUSTED becomes one line
    naming the pool's size and the flags, not a traceback (the allocation failure is simulated)."""
    from dantinox.cli import entrypoint as cli
    from dantinox.kv import manager as manager_module

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 49999998976 bytes.")

    monkeypatch.setattr(manager_module, "init_pool", exhausted)
    status = cli.main(["serve", "--port", "18999", "--kv-memory", "2MB", "--kv-memory-all", "--no-warmup"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "dantinox serve: error: the KV pool of" in err and "could not be allocated" in err
    assert "Out of memory allocating 49999998976 bytes" in err and "--kv-memory, --max-running" in err
