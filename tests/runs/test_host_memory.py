"""Host memory: freed buffers go back to the system (``dantinox.xla.mmap_threshold``); figures in
docs/explanation/performance.md, "Host memory" (``benchmarks/bench_memory.py``)."""

import os
import subprocess
import sys

import pytest

from dantinox.xla import DEFAULT_MMAP_THRESHOLD, mmap_threshold


@pytest.mark.parametrize("value, want", [(None, DEFAULT_MMAP_THRESHOLD), ("off", None), ("65536", 65536)])
def test_mmap_threshold_from_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("DANTINOX_MMAP_THRESHOLD", raising=False)
    else:
        monkeypatch.setenv("DANTINOX_MMAP_THRESHOLD", value)
    assert mmap_threshold() == want


@pytest.mark.parametrize("value", ["1MB", "-5", "100"])
def test_mmap_threshold_refuses_a_bad_value_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("DANTINOX_MMAP_THRESHOLD", value)
    with pytest.raises(ValueError, match=r"DANTINOX_MMAP_THRESHOLD=.*bytes >= 4096, or off"):
        mmap_threshold()


def test_a_bad_threshold_is_refused_when_dantinox_is_imported():
    code = "import dantinox.xla"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DANTINOX_MMAP_THRESHOLD": "12kb", "PATH": ""})
    assert run.returncode != 0 and "DANTINOX_MMAP_THRESHOLD='12kb' is not allowed" in run.stderr


def test_a_layer_chain_holds_one_dequantized_weight_at_a_time():
    """The memory-minimising XLA:CPU scheduler (dantinox.xla) keeps a chain of dequantize-then-dot layers to about
    one float32 weight of temporaries; the concurrency-optimised one held every layer's copy at once (the
    405 MiB a SmolLM2 Q4_1 prefill took)."""
    import jax
    import jax.numpy as jnp

    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in os.environ["XLA_FLAGS"]
    layers, width = 12, 256

    def chain(x, weights):
        for w in weights:
            x = jnp.tanh(x @ (w.astype(jnp.float32) * 0.5 - 3.0))
        return x

    x = jnp.ones((32, width), jnp.float32)
    weights = [jnp.ones((width, width), jnp.uint8) for _ in range(layers)]
    temp = jax.jit(chain).lower(x, weights).compile().memory_analysis().temp_size_in_bytes
    one_weight = width * width * 4
    assert temp < 3 * one_weight, (temp, one_weight)
