"""A mesh smaller than the device count runs on the first data x model devices and leaves the others idle, as
vLLM's ``tensor_parallel_size`` does (issue 19 item 7); one larger than the count is one line naming the mesh,
the count and how to force CPU devices. Run with 8 forced CPU devices by tests/parallel/test_multidevice.py."""

import argparse

import jax
import pytest

from dantinox.cli.entrypoint import main
from dantinox.cli.serve import add_serve_arguments, build_engine
from dantinox.parallel.mesh import make_mesh


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (1, 8)])
def test_mesh_takes_the_first_devices(shape):
    mesh = make_mesh(*shape)
    assert dict(mesh.shape) == {"data": shape[0], "model": shape[1]}
    assert mesh.devices.flatten().tolist() == jax.devices()[:shape[0] * shape[1]]
    assert mesh.devices[0].tolist() == jax.devices()[:shape[1]]     # model spans neighbouring devices


def test_generate_on_a_smaller_mesh_equals_one_device(capsys):
    args = ["generate", "--prompt", "Nel mezzo", "--max_new_tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    single = capsys.readouterr().out
    for mesh in ("data=2,model=2", "model=2", "data=2"):          # 4, 2 and 2 of the 8 devices
        assert main(args + ["--mesh", mesh]) == 0
        assert capsys.readouterr().out == single, mesh


def test_serve_engine_on_a_smaller_mesh_places_its_pool_on_those_devices():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    engine, _, _ = build_engine(parser.parse_args(["--mesh", "model=2", "--max-running", "2"]))
    assert engine.blocks_per_device()["devices"] == 2
    assert {d for layer in engine.pool for a in layer for d in a.sharding.device_set} == set(jax.devices()[:2])


def test_mesh_larger_than_the_devices_is_one_line(capsys):
    assert main(["generate", "--prompt", "Nel mezzo", "--mesh", "data=4,model=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert ("--mesh 'data=4,model=4': mesh data=4 x model=4 = 16 devices, but 8 device(s) are available (cpu)"
            in err[0]) and "XLA_FLAGS=--xla_force_host_platform_device_count=16" in err[0], err
