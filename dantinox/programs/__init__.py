"""Compiled programs kept between processes.

  store.py   stored_jit: a jax.jit whose programs are kept on disk as jax.export artifacts, so a warm start
             loads them without tracing; the cap on loaded programs (least recently used evicted)
"""

from .store import StoredFunction, clear_programs, max_loaded_programs, set_max_loaded_programs, store_dir, stored_jit

__all__ = ["StoredFunction", "clear_programs", "max_loaded_programs", "set_max_loaded_programs", "store_dir",
           "stored_jit"]
