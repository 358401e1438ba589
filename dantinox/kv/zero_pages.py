"""Zero arrays whose pages the operating system provides: a KV cache or pool allocated without writing it.

``jnp.zeros`` on the CPU writes every byte, so a serving pool of gigabytes (SmolLM2 at its 8,192-token context
and 16 sequences: 5.6 GiB) cost seconds before ``dantinox serve`` could listen (1.8-3.4 s measured, every page
faulted in and cleared) and was resident in full from the start, though the engine fills it block by block.
``zeros`` runs the compiled extension's ``dantinox_zero_pages`` custom call instead
(``dantinox/quant/csrc/zero_pages.inc``): on Linux the page-aligned inside of the buffer XLA allocated is handed
back to the kernel (``madvise(MADV_DONTNEED)``: the next access of a private anonymous page sees a fresh zero
page) and only the partial pages at its ends are written; elsewhere it clears with memset. Same values as
``jnp.zeros``; 60 arrays of 96 MiB take 0.05 s instead of 3.4 s and 213 MiB resident instead of 5,988 MiB
(measured on the 2-core Zen 4 host). A page becomes resident when the engine first writes a block in it.

It runs for concrete calls on the CPU backend with the extension installed; inside a trace (the array is then
part of a larger program) or on another backend, or without the extension, ``jnp.zeros`` runs.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..quant.block_kernel import ZERO_PAGES_TARGET, extension


@partial(jax.jit, static_argnums=(0, 1))
def _zero_pages(shape: tuple, dtype) -> jax.Array:
    return jax.ffi.ffi_call(ZERO_PAGES_TARGET, jax.ShapeDtypeStruct(shape, dtype))()


def pages_available() -> bool:
    """True when ``zeros`` can leave its pages to the operating system here: the CPU backend and the compiled
    extension with the zero-pages target."""
    module = extension()
    return jax.default_backend() == "cpu" and module is not None and hasattr(module, "zero_pages_handler")


def zeros(shape, dtype) -> jax.Array:
    """``jnp.zeros(shape, dtype)``, without writing the pages where it can (module docstring). shape: a tuple
    of ints; dtype: any JAX dtype. Raises what ``jnp.zeros`` raises for a bad shape or dtype."""
    shape = tuple(int(n) for n in shape)
    if (any(n < 0 for n in shape)   # jnp.zeros' own error for a negative dimension
            or isinstance(jnp.zeros((), jnp.int32), jax.core.Tracer) or not pages_available()):
        return jnp.zeros(shape, dtype)
    return _zero_pages(shape, jnp.dtype(dtype))
