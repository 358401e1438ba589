"""Host memory: freed buffers go back to the system (``dantinox.xla.mmap_threshold``); figures in
docs/performance.md, "Host memory" (``benchmarks/bench_memory.py``)."""

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
