"""Warm-up in the background: the engine's programs compiled one by one between requests, most likely first.

``dantinox serve`` listens as soon as the model is loaded. The worker thread (``worker.EngineWorker``) then
runs one warm-up item whenever the engine has nothing to do, so a request that arrives during warm-up waits
for at most the compilation under way, and then compiles only the programs its own steps need (on demand, as
with ``--no-warmup``); the items it compiled that way cost nothing when warm-up reaches them. The items come
in the order ``PagedEngine.warmup_items`` gives: the programs of one short request first (batch 1, the
smallest chunk and block-table buckets), then growing batch and size buckets, so the first answer comes
after a few compilations, not after all of them.

``Warmup`` holds the items and their progress: ``status()`` is what /health and /ready report, and a progress
line is logged after each item ("warm-up 3/58 programs, 41.0 s: decode_steps B=1 M=8").
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass
from typing import Callable

from ..xla import CompileCounter

log = logging.getLogger("dantinox.serving")


@dataclass(frozen=True)
class WarmupItem:
    """One thing to compile: ``label`` names the program and its bucket (e.g. "forward B=1 T=16"), ``run``
    compiles (and runs once, writing nothing to the pool) the program. ``run`` is called on the engine's
    thread only."""

    label: str
    run: Callable[[], None]


class Warmup:
    """The warm-up items and their progress; ``run_next`` is called by the one thread that drives the engine,
    ``status`` from any thread.

    items: the WarmupItems in the order to run them; log_every: log a progress line after every item
    (False: only the first, every 10th and the last); parallel: items compiled at once (serve: the CPUs, at most
    2). An empty list is ready at once.
    """

    def __init__(self, items: list[WarmupItem], log_every: bool = True, parallel: int = 1):
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel={parallel!r} is not allowed: an integer >= 1 (programs compiled at once)")
        self.items = list(items)
        self.parallel = parallel
        self.done = 0
        self.log_every = log_every
        self.counter = CompileCounter()
        self._started: float | None = None
        self._finished: float | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        if not self.items:
            self._finished = self._started = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.done >= len(self.items)

    def cancel(self) -> None:
        """Run no further item (the server is stopping); the one under way finishes."""
        self._cancelled = True

    def run_next(self) -> bool:
        """Run the next items, up to ``parallel`` of them at once (the first call starts the clock and the compile
        counter). XLA compiles one program on one core, with the GIL released, so two programs compile side by
        side on two cores. Returns True while items remain after them. Exceptions of an item propagate (the
        caller treats them as the engine's)."""
        if self.finished or self._cancelled:
            return False
        if self._started is None:   # on the engine thread, once the server runs (and handles Ctrl-C)
            log.info("warm-up: compiling %d programs in the background, most likely first, %d at a time; requests "
                     "are served meanwhile (GET /ready answers 503 until it is done)", len(self.items), self.parallel)
            self._started = time.perf_counter()
            self.counter.__enter__()
        batch = self.items[self.done:self.done + self.parallel]
        if len(batch) == 1:
            batch[0].run()
        else:
            with ThreadPoolExecutor(len(batch)) as pool:
                for future in [pool.submit(item.run) for item in batch]:
                    future.result()
        with self._lock:
            self.done += len(batch)
            if self.finished:
                self._finished = time.perf_counter()
        self.counter.update()
        if self._cancelled:
            return False
        n, total = self.done, len(self.items)
        if self.log_every or n <= len(batch) or n % 10 < len(batch) or n == total:
            log.info("warm-up %d/%d programs, %.1f s: %s", n, total, self.seconds, ", ".join(i.label for i in batch))
        if self.finished:
            log.info("warm-up done: %d programs, %d compilations (%d from the persistent cache) in %.1f s; ready",
                     total, self.counter.compilations, self.counter.cache_hits, self.seconds)
        return not self.finished

    @property
    def seconds(self) -> float:
        """Seconds since the first item started (0.0 before), up to the last one's end."""
        with self._lock:
            if self._started is None:
                return 0.0
            return (self._finished or time.perf_counter()) - self._started

    def status(self) -> dict:
        """{"status": "warming up" or "ready", "programs_done": int, "programs_total": int, "seconds": float}."""
        with self._lock:
            done, total = self.done, len(self.items)
        return {"status": "ready" if done >= total else "warming up", "programs_done": done,
                "programs_total": total, "seconds": round(self.seconds, 3)}
