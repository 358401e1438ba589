"""Process-wide XLA setup, applied once when dantinox is imported.

1. ``--xla_cpu_copy_insertion_use_region_analysis=true`` is appended to ``XLA_FLAGS`` (unless the user already
   set it): together with attending before writing the cache, it removes the cache-sized copies XLA otherwise
   inserts in the compiled decode loop (../shared/PERFORMANCE.md, item 1). It only takes effect if dantinox is
   imported before JAX initialises its CPU backend. ``--xla_cpu_enable_concurrency_optimized_scheduler=false``
   likewise: XLA:CPU's concurrency-optimised scheduler starts every independent computation early, so a
   prefill over block-quantized weights held every layer's dequantized float32 copy at once (SmolLM2 Q4_1:
   405 MiB of temporaries, 8 MiB with the memory-minimising scheduler), and on 2 cores it bought no speed:
   prefill of 64-256 tokens no slower, decode within noise (docs/explanation/performance.md, "Host memory").
2. The persistent compilation cache lives in ``~/.cache/jax_xla/dantinox``; the environment variable
   ``DANTINOX_XLA_CACHE`` overrides the path, and ``DANTINOX_XLA_CACHE=off`` disables it. Its size is capped
   (``jax_compilation_cache_max_size``) at ``DANTINOX_XLA_CACHE_MAX_SIZE`` bytes (default 1 GiB; "1GiB",
   "500MB", a plain byte count, or "unlimited"): past the cap JAX deletes the least recently used entries.
   JAX's bounded cache keeps an access-time file beside each entry; entries written without a cap (by older
   dantinox versions) get one stamped from their modification time, or JAX could not evict them.
3. Compilations are counted with a ``jax.monitoring`` listener (``compile_totals``, ``CompileCounter``), so
   tests and benchmarks can assert them. A compilation is one ``/jax/core/compile/backend_compile_duration``
   event: one executable built by XLA or loaded from the persistent compilation cache. Cache loads are also
   counted separately (``cache_hits``) so a benchmark can tell a cold process start from a warm one.
4. Freed host memory goes back to the system (glibc only): XLA:CPU allocates every buffer with malloc, and a
   static cache is dozens of per-layer arrays of a few MiB each, below glibc's adaptive mmap threshold (up to
   32 MiB), so a finished request's cache stayed in malloc's arenas and the process kept its peak resident
   size (SmolLM2 Q4_1, 8,192 slots: 1.35 GiB peak, 1.24 GiB after a request, against 0.87 / 0.49 GiB with the
   threshold at 1 MiB; docs/explanation/performance.md, "Host memory"). ``DANTINOX_MMAP_THRESHOLD`` (bytes, default
   1 MiB; ``off`` keeps glibc's default) sets ``mallopt(M_MMAP_THRESHOLD)`` so allocations that size or larger are
   mapped and unmapped on their own, and every compilation ends with ``trim_host_memory`` (``malloc_trim``).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from dataclasses import dataclass, field

_FLAGS = {"--xla_cpu_copy_insertion_use_region_analysis": "true",
          "--xla_cpu_enable_concurrency_optimized_scheduler": "false"}
for _flag, _value in _FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_flag}={_value}").strip()

import jax  # noqa: E402

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jax_xla", "dantinox")
DEFAULT_CACHE_MAX_BYTES = 1 << 30   # 1 GiB: SmolLM2's whole serve warm-up takes about 16 MiB
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def compilation_cache_dir() -> str | None:
    """The persistent XLA compilation cache directory in use, or None when disabled."""
    value = os.environ.get("DANTINOX_XLA_CACHE", DEFAULT_CACHE_DIR)
    return None if value.lower() in ("off", "0", "none", "") else value


def compilation_cache_max_bytes(value: str | None = None) -> int | None:
    """The cap of the persistent compilation cache in bytes, from ``value`` (default: the environment
    variable DANTINOX_XLA_CACHE_MAX_SIZE, unset = DEFAULT_CACHE_MAX_BYTES); None for "unlimited".

    Raises ValueError naming the variable for anything but a positive size ("1GiB", "500MB", "2000000")
    or "unlimited"."""
    text = os.environ.get("DANTINOX_XLA_CACHE_MAX_SIZE") if value is None else value
    if text is None:
        return DEFAULT_CACHE_MAX_BYTES
    if text.strip().lower() in ("unlimited", "none", "-1"):
        return None
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ValueError(f"DANTINOX_XLA_CACHE_MAX_SIZE={text!r} is not allowed: a positive size such as "
                         "1GiB, 500MB or 2000000 (bytes), or 'unlimited' (DANTINOX_XLA_CACHE=off turns the "
                         "cache off)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def stamp_unstamped_entries(path: str) -> int:
    """Give every cache entry in ``path`` without an access-time file (``KEY-atime``, written by JAX's bounded
    cache only) one holding its modification time, so the eviction, which reads every entry's access
    time, can run. Returns how many entries were stamped."""
    stamped = 0
    for name in os.listdir(path):
        if not name.endswith("-cache"):
            continue
        atime = os.path.join(path, name[:-len("-cache")] + "-atime")
        if not os.path.exists(atime):
            try:
                ns = os.stat(os.path.join(path, name)).st_mtime_ns
                with open(atime, "wb") as f:
                    f.write(ns.to_bytes(8, "little"))
                stamped += 1
            except OSError:   # removed meanwhile by another process's eviction, or read-only
                pass
    return stamped


def _enable_persistent_cache() -> None:
    path = compilation_cache_dir()
    if path is None:
        return
    max_bytes = compilation_cache_max_bytes()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if max_bytes is not None:   # JAX's bounded cache locks its directory with the filelock package
        stamp_unstamped_entries(path)
        jax.config.update("jax_compilation_cache_max_size", max_bytes)


_enable_persistent_cache()

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
DEFAULT_MMAP_THRESHOLD = 1 << 20


def mmap_threshold() -> int | None:
    """The M_MMAP_THRESHOLD (bytes) dantinox sets, from ``DANTINOX_MMAP_THRESHOLD``; None when it is off.
    ValueError naming the variable for a value that is neither ``off`` nor a whole number of bytes >= 4096."""
    value = os.environ.get("DANTINOX_MMAP_THRESHOLD", str(DEFAULT_MMAP_THRESHOLD)).strip()
    if value.lower() in ("off", "0", "none", ""):
        return None
    if not value.isdigit() or int(value) < 4096:
        raise ValueError(f"DANTINOX_MMAP_THRESHOLD={value!r} is not allowed: a number of bytes >= 4096, or off")
    return int(value)


_LIBC: list = []  # glibc, once _return_freed_memory found it


def _return_freed_memory() -> None:
    threshold = mmap_threshold()
    if threshold is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        libc.malloc_trim  # noqa: B018 (glibc has it; another libc raises AttributeError here)
    except (OSError, AttributeError):  # not glibc (musl, another libc): leave its allocator as it is
        return
    _LIBC.append(libc)


def trim_host_memory() -> None:
    """Hand malloc's free pages back to the system (glibc ``malloc_trim(0)``; nothing elsewhere or with
    ``DANTINOX_MMAP_THRESHOLD=off``). Run after every compilation: LLVM's many small allocations, freed when
    a compile ends, stay in malloc's arenas otherwise (a SmolLM2 serving program: 194 MiB kept after its
    compile, 64 MiB after the trim; docs/explanation/performance.md, "Host memory")."""
    if _LIBC:
        _LIBC[0].malloc_trim(0)


_return_freed_memory()

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_totals = {"compilations": 0, "seconds": 0.0, "cache_hits": 0}


def _on_duration(event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _totals["compilations"] += 1
            _totals["seconds"] += duration
        trim_host_memory()


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _totals["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compile_totals() -> dict:
    """Process-wide totals since import: {'compilations': int, 'seconds': float, 'cache_hits': int}."""
    with _lock:
        return dict(_totals)


@dataclass
class CompileCounter:
    """Context manager: compilations, compile seconds and persistent-cache hits inside the ``with`` block.

    >>> with CompileCounter() as counted:
    ...     run_something()
    >>> counted.compilations
    """

    compilations: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    _start: dict = field(default_factory=dict, repr=False)

    def __enter__(self) -> "CompileCounter":
        self._start = compile_totals()
        return self

    def __exit__(self, *exc) -> None:
        self.update()

    def update(self) -> "CompileCounter":
        """Refresh the counts (also usable inside the block)."""
        now = compile_totals()
        self.compilations = now["compilations"] - self._start["compilations"]
        self.seconds = now["seconds"] - self._start["seconds"]
        self.cache_hits = now["cache_hits"] - self._start["cache_hits"]
        return self
