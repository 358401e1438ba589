"""Runs tests/parallel/multidevice/ in a fresh process with 8 forced CPU devices (XLA_FLAGS must be set before JAX
starts its backend; this process has one device)."""

import os
import subprocess
import sys

import pytest
from paths import REPO

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.slow   # a child pytest over tests/parallel/multidevice/ with 8 forced devices (minutes)


@pytest.mark.timeout(900)
def test_multidevice_suite():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    cmd = [sys.executable, "-m", "pytest", os.path.join(HERE, "multidevice"), "-q", "-x", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
