"""Tests that need 8 (forced CPU) devices. They run in their own process, started by tests/test_multidevice.py
with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag only works before JAX starts its CPU
backend, and the rest of the suite runs on one device); collected in a one-device process they are skipped."""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (conftest helpers)


@pytest.fixture(autouse=True)
def _needs_eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: run through tests/test_multidevice.py")
