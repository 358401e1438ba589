"""The product of activations with block-quantized weights: the compiled kernel or the pure-JAX path.

``block_matmul(x, data, fmt, n_in)`` computes x [..., M] . W^T -> [..., N] float32 for a weight matrix W [N, M]
kept as ggml blocks (``data`` uint8 [N, row bytes], see ``dantinox.quant.block_formats``). Two paths, chosen
when the call is traced (the choice is static, so the decode loop still compiles once):

  kernel    on the CPU backend with the extension built: an XLA FFI custom call (``jax.ffi.ffi_call`` of
            ``dantinox_block_matmul``, C++ in ``dantinox/quant/csrc/block_matmul.cc``), AVX-512, AVX2 or portable
            loops picked by CPUID, the work split over XLA's intra-op thread pool. Two algorithms:
            - few tokens (x.shape[-2] < TILED_MIN_TOKENS: decode steps, speculative verify calls, short prompts),
              R = prod(x.shape[:-1]) <= KERNEL_MAX_ROWS: the blocks are streamed once per pass of a few rows and
              dequantized in registers (``block_simd32.inc``, ``block_avx512.inc``, ``block_formats.inc``);
            - many tokens (prefill, long chunks), any R: the tiled product (``block_gemm.inc``): panels of W
              dequantized once per task into float32 and multiplied with register tiles of rows.
            Each algorithm computes a row's outputs the same way whatever the other rows of the call, so a verify
            call of k + 1 <= TILED_MIN_TOKENS - 1 tokens agrees bit for bit with the decode steps it replaces.
  pure JAX  few tokens with R > KERNEL_MAX_ROWS, another backend, no extension, or ``DANTINOX_BLOCK_KERNEL=off``:
            the blocks are dequantized inside the jitted function (``dequantize_blocks``, exact) and XLA's dot
            runs in float32.

All paths compute each output as a float32 sum of the same float32 products (the dequantized weights equal
``gguf.quants.dequantize``'s); only the order of the additions differs, so results agree to float32 rounding.
On a mesh (an ambient ``jax.set_mesh`` with a "model" axis) the kernel runs inside a ``jax.shard_map``: each
device multiplies its own rows of W (``_kernel_on_mesh``). The path in use is logged once (logger
``dantinox.quant``; a fallback at WARNING) and reported by ``kernel_status()``.
"""

from __future__ import annotations

import importlib
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..programs.store import register_custom_calls
from .block_formats import block_format, dequantize_blocks

# Rows up to which the kernel runs: at 64 and 128 rows a SmolLM2 prefill takes as long through the kernel as through
# XLA's dot on the dequantized weights (239-278 against 238-244 ms at 64 rows, 323-329 against 332-337 ms at 128;
# Zen 4, 2 cores) and its program compiles 1.5 s faster cold (2.1-2.3 against 3.6-3.9 s: no dequantizing
# fusions); at 512 and 1,024 rows the kernel is 15-20 % slower (1,197 against 1,041 ms; 2,768 against 2,311).
KERNEL_MAX_ROWS = 128
# Tokens per row (x.shape[-2]) from which the kernel runs its tiled many-row product: one more than a speculative
# verify call holds (dantinox.generation.speculative.MAX_SPEC_TOKENS + 1 = 17), so verify calls and decode steps
# keep the few-row loops and their bit-for-bit agreement.
TILED_MIN_TOKENS = 18
TARGET = "dantinox_block_matmul"
ATTENTION_TARGET = "dantinox_decode_attention"
PAGED_ATTENTION_TARGET = "dantinox_paged_attention"   # the same over a paged pool, dantinox.kv.decode_kernel
ZERO_PAGES_TARGET = "dantinox_zero_pages"   # zeros without writing the pages, dantinox.kv.zero_pages
PREFILL_ATTENTION_TARGET = "dantinox_prefill_attention"   # dantinox.kv.prefill_attention
ISA_CODES = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
ENV = "DANTINOX_BLOCK_KERNEL"
log = logging.getLogger("dantinox.quant")
_state: dict = {}


def _load() -> tuple[object | None, str]:
    """(the extension module or None, why not), registering the FFI target the first time."""
    if "module" not in _state:
        try:
            module = importlib.import_module("dantinox.quant._block_matmul")
            jax.ffi.register_ffi_target(TARGET, module.handler(), platform="cpu")
            if hasattr(module, "attention_handler"):  # decode attention, dantinox.kv.decode_kernel
                jax.ffi.register_ffi_target(ATTENTION_TARGET, module.attention_handler(), platform="cpu")
            if hasattr(module, "paged_attention_handler"):
                jax.ffi.register_ffi_target(PAGED_ATTENTION_TARGET, module.paged_attention_handler(),
                                            platform="cpu")
            if hasattr(module, "prefill_attention_handler"):
                jax.ffi.register_ffi_target(PREFILL_ATTENTION_TARGET, module.prefill_attention_handler(),
                                            platform="cpu")
            if hasattr(module, "zero_pages_handler"):
                jax.ffi.register_ffi_target(ZERO_PAGES_TARGET, module.zero_pages_handler(), platform="cpu")
            _state["module"], _state["why"] = module, ""
        except ImportError as err:
            _state["module"], _state["why"] = None, f"the compiled extension is not installed ({err})"
    return _state["module"], _state["why"]


register_custom_calls((TARGET, ATTENTION_TARGET, PAGED_ATTENTION_TARGET, ZERO_PAGES_TARGET, PREFILL_ATTENTION_TARGET),
                      _load)


def kernel_status() -> tuple[bool, str]:
    """(True, "compiled kernel (avx512)") when block weights use the kernel in this process; else (False,
    the reason and "pure-JAX path"). Reads ``DANTINOX_BLOCK_KERNEL`` ("off" forces the pure-JAX path)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False, f"pure-JAX path ({ENV}=off)"
    if jax.default_backend() != "cpu":
        return False, f"pure-JAX path (backend {jax.default_backend()}, the kernel is CPU-only)"
    module, why = _load()
    if module is None:
        return False, f"pure-JAX path ({why})"
    return True, f"compiled kernel ({module.isa()})"


def extension():
    """The compiled extension module (``dantinox.quant._block_matmul``, its FFI targets registered), or None
    when it is not installed."""
    return _load()[0]


def kernel_isa() -> str | None:
    """The instruction set the kernel runs on this CPU ("avx512", "avx2" or "scalar"), None without it."""
    module, _ = _load()
    return None if module is None else module.isa()


def _announce(use: bool, text: str) -> None:
    if _state.get("announced") != text:
        _state["announced"] = text
        (log.info if use else log.warning)("block-quantized weights: %s", text)


def kernel_matmul(x2: jax.Array, data: jax.Array, fmt: str, isa: str = "auto", tiled: bool = False) -> jax.Array:
    """The custom call itself: x2 [R, M] float32, data uint8 [N, row bytes] -> [R, N] float32 (any R).
    tiled=False: the few-row loops (the weights streamed once per 16 rows, on AVX-512 once per 6 rows of Q4_0 /
    Q4_1 and 5 of Q8_0); tiled=True: the many-row tiled product (``csrc/block_gemm.inc``). isa: "auto" (CPUID) or
    force "scalar" / "avx2" / "avx512" (tests; the CPU must have it). RuntimeError when the extension is not
    installed."""
    module, why = _load()
    if module is None:
        raise RuntimeError(f"the block kernel is unavailable: {why}")
    out = jax.ShapeDtypeStruct((x2.shape[0], data.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(x2.astype(jnp.float32), data, format=np.int64(block_format(fmt).code),
                isa=np.int64(ISA_CODES[isa]), tiled=np.int64(bool(tiled)))


def _kernel_on_mesh(x2: jax.Array, data: jax.Array, fmt: str, tiled: bool) -> jax.Array:
    """kernel_matmul, split by rows of W over the ambient mesh's "model" axis when one is in scope (the mesh
    ``jax.set_mesh`` entered; ``dantinox.parallel.sharding`` places block weights [N, row bytes] with N over
    "model", whole rows of blocks per device) and N divides by its size: a ``jax.shard_map`` in which each
    device runs the kernel on its N / M rows against the whole x2 [R, M] (replicated), the outputs [R, N / M]
    laid side by side over "model". Without such a mesh: the plain call."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "model" not in mesh.axis_names or data.shape[0] % mesh.shape["model"]:
        return kernel_matmul(x2, data, fmt, tiled=tiled)
    local = jax.shard_map(lambda a, d: kernel_matmul(a, d, fmt, tiled=tiled), mesh=mesh,
                          in_specs=(P(), P("model", None)),
                          out_specs=P(None, "model"), check_vma=False)
    return local(x2, data)


def block_matmul(x: jax.Array, data: jax.Array, fmt: str, n_in: int) -> jax.Array:
    """x [..., M] (M = n_in) . W^T with W [N, M] stored as blocks ``data`` uint8 [N, row bytes] -> [..., N]
    float32. The kernel where available: its tiled product when x.shape[-2] >= TILED_MIN_TOKENS, its few-row loops
    when R = prod(x.shape[:-1]) <= KERNEL_MAX_ROWS; else the pure-JAX path (module docstring). ValueError if x's
    last axis is not n_in."""
    if x.shape[-1] != n_in:
        raise ValueError(f"x has {x.shape[-1]} input channels; the weights have {n_in}")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    tiled = x.ndim >= 2 and x.shape[-2] >= TILED_MIN_TOKENS
    use, text = kernel_status()
    _announce(use, text)
    if use and (tiled or rows <= KERNEL_MAX_ROWS):
        out = _kernel_on_mesh(x.reshape(rows, n_in), data, fmt, tiled)
        return out.reshape(*x.shape[:-1], data.shape[0])
    w = dequantize_blocks(data, fmt, n_in)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(x.astype(jnp.float32), w, dims, preferred_element_type=jnp.float32)
