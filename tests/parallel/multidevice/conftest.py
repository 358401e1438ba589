"""Tests that need 8 (forced CPU) devices. They run in their own process, started by tests/parallel/test_multidevice.py
with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag only works before JAX starts its CPU
backend, and the rest of the suite runs on one device); collected in a one-device process they are skipped."""

import importlib.util
import os
import sys

import jax
import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, TESTS)  # serving_util and the other helpers of tests/
_spec = importlib.util.spec_from_file_location("_tests_conftest", os.path.join(TESTS, "conftest.py"))
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
# This file is imported as "conftest" too: re-export the helpers tests/ modules import from it.
# Every public helper (not the fixtures: tests/conftest.py already provides those here).
globals().update({name: value for name, value in vars(_parent).items()
                  if not name.startswith("_") and name not in ("tiny",) and name not in globals()})


@pytest.fixture(autouse=True)
def _needs_eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: run through tests/parallel/test_multidevice.py")


def pytest_collection_modifyitems(config, items):
    """In a one-device process, mark this directory's tests skipped at collection, so their module fixtures
    (models, meshes, compilations) are not set up only to be skipped."""
    if jax.device_count() >= 8:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    skip = pytest.mark.skip(reason="needs 8 devices: run through tests/parallel/test_multidevice.py")
    for item in items:
        if os.path.dirname(str(item.path)) == here:
            item.add_marker(skip)
