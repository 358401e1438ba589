"""Issue 19 item 7, the part one device can show: a mesh larger than the device count is one line naming the
mesh, the count and how to force CPU devices (a smaller mesh on 8 forced devices is
tests/parallel/multidevice/test_mesh_smaller_than_devices.py)."""

import jax
import pytest

from dantinox.cli.entrypoint import main
from dantinox.parallel.mesh import MeshError, make_mesh


def test_one_device_mesh_is_the_device():
    assert make_mesh(1, 1).devices.flatten().tolist() == jax.devices()[:1]


@pytest.mark.parametrize("command", [["generate", "--prompt", "Nel mezzo"], ["verify"]])
def test_mesh_larger_than_the_devices_is_one_line_with_the_fix(capsys, command):
    n = jax.device_count()
    assert main(command + ["--mesh", "data=2,model=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"--mesh 'data=2,model=2': mesh data=2 x model=2 = 4 devices, but {n} device(s) are available" in err[0]
    assert "force more devices before JAX starts: XLA_FLAGS=--xla_force_host_platform_device_count=4" in err[0]


def test_library_error_names_the_product():
    with pytest.raises(MeshError, match=r"mesh data=3 x model=5 = 15 devices, but \d+ device\(s\)"):
        make_mesh(3, 5)
