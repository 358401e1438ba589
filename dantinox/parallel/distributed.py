"""Several processes, one mesh: ``--coordinator HOST:PORT --num-processes N --process-id I``.

Every process runs the same command with its own ``--process-id``; process 0 also hosts the coordinator
(``jax.distributed``). After :func:`initialize`, ``jax.devices()`` lists the devices of every process, so
``--mesh data=D,model=M`` spans them all (D * M = the global device count) and GSPMD inserts the
cross-process collectives; on CPU they go over gloo (``jax_cpu_collectives_implementation``). Host values
that the program needs (prompts, batches, seeds) must be the same in every process: dantinox derives them
from the same arguments and seeds.

jax.distributed aborts the whole process (no Python exception) when the coordinator cannot be reached, so
:func:`initialize` first checks the address itself, within ``timeout_s``: process 0 must be able to listen
on it, the others must be able to connect to it. Either failure is a DistributedError naming the address.
"""

from __future__ import annotations

import socket
import time

import jax
import numpy as np

DEFAULT_TIMEOUT_S = 60


class DistributedError(ValueError):
    """The process group cannot be formed (bad flags or an unreachable coordinator; the address is named)."""


def parse_address(text: str) -> tuple[str, int]:
    """"HOST:PORT" -> (host, port). Raises DistributedError naming --coordinator."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"--coordinator {text!r} is not allowed: HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


def check_group(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """True when the flags ask for several processes; DistributedError for an incomplete or inconsistent set."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if not any(given):
        return False
    if not all(given):
        raise DistributedError("--coordinator, --num-processes and --process-id go together: give all three")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise DistributedError(f"--num-processes {num_processes!r} is not allowed: an integer >= 1")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id {process_id!r} is not allowed: an integer in [0, {num_processes})")
    parse_address(coordinator)
    return True


def wait_for_coordinator(coordinator: str, process_id: int, timeout_s: float) -> None:
    """Process 0: the address can be listened on. Others: a TCP connection to it succeeds within timeout_s
    (retried every 0.2 s while process 0 starts). Raises DistributedError naming the address."""
    host, port = parse_address(coordinator)
    if process_id == 0:
        try:
            with socket.create_server((host, port)):
                return
        except OSError as err:
            raise DistributedError(f"--coordinator {coordinator}: process 0 cannot listen there ({err})") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise DistributedError(f"--coordinator {coordinator} cannot be reached within {timeout_s:g} s "
                                       f"({err}); is process 0 running there?") from None
            time.sleep(0.2)


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group (``jax.distributed.initialize``; gloo collectives on CPU) unless no flag is given.
    Must run before anything touches a device. Returns True when a group was joined.
    Raises DistributedError (see :func:`check_group`, :func:`wait_for_coordinator`)."""
    if not check_group(coordinator, num_processes, process_id):
        return False
    wait_for_coordinator(coordinator, process_id, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=max(1, int(timeout_s)))
    return True


def to_host(x) -> np.ndarray:
    """A jax.Array as a numpy array on this host, gathering the shards other processes hold
    (``multihost_utils.process_allgather``) when it is not fully addressable here."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
