"""Count XLA compilations with a ``jax.monitoring`` listener, so tests and benchmarks can assert them.

A compilation is one ``/jax/core/compile/backend_compile_duration`` event: one executable built by XLA or
loaded from the persistent compilation cache. Cache loads are also counted separately (``cache_hits``) so a
benchmark can tell a cold process start from a warm one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_totals = {"compilations": 0, "seconds": 0.0, "cache_hits": 0}


def _on_duration(event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _totals["compilations"] += 1
            _totals["seconds"] += duration


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
