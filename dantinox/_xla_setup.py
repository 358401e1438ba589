"""Process-wide XLA setup, applied once when dantinox is imported.

1. ``--xla_cpu_copy_insertion_use_region_analysis=true`` is appended to ``XLA_FLAGS`` (unless the user already
   set it): together with attending before writing the cache, it removes the cache-sized copies XLA otherwise
   inserts in the compiled decode loop (../shared/PERFORMANCE.md, item 1). It only takes effect if dantinox is
   imported before JAX initialises its CPU backend.
2. The persistent compilation cache lives in ``~/.cache/jax_xla/dantinox``; the environment variable
   ``DANTINOX_XLA_CACHE`` overrides the path, and ``DANTINOX_XLA_CACHE=off`` disables it.
"""

from __future__ import annotations

import os

_FLAG = "--xla_cpu_copy_insertion_use_region_analysis"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=true").strip()

import jax  # noqa: E402

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jax_xla", "dantinox")


def compilation_cache_dir() -> str | None:
    """The persistent XLA compilation cache directory in use, or None when disabled."""
    value = os.environ.get("DANTINOX_XLA_CACHE", DEFAULT_CACHE_DIR)
    return None if value.lower() in ("off", "0", "none", "") else value


def _enable_persistent_cache() -> None:
    path = compilation_cache_dir()
    if path is None:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_enable_persistent_cache()
