"""EngineWorker: the one thread that owns an Engine, and the thread-safe queues the HTTP handlers use.

  1. Handlers (on the server's asyncio loop) never touch the engine. ``submit`` and ``abort`` put a command on
     ``commands``, a ``queue.Queue``.
  2. The worker thread loops: take every pending command (blocking briefly only when the engine is idle), run
     ``engine.step()``, route each output to its request's ``asyncio.Queue`` with
     ``loop.call_soon_threadsafe``, record metrics, and publish ``engine.stats()`` as an immutable snapshot
     that handlers read without locks.
  3. A submit carries the n engine requests of one completion (one per choice, same prompt); the worker adds
     all of them or none. It is answered first with ("accepted",) or ("rejected", error) where error is the
     RequestError or QueueFullError the engine raised, then with ("output", RequestOutput) events, each
     naming its request, until every one of them is finished.
  4. If the engine raises outside a step's own error handling, every request in flight gets an "error"
     output, the worker marks itself unhealthy (``/health`` answers 503) and stops.
  5. With a ``warmup.Warmup``, the worker runs its next item whenever the engine has nothing unfinished (no
     request waits on it), until every item ran: requests are served during warm-up, each compiling on demand
     what it needs that warm-up has not reached yet. A warm-up item that raises is an engine failure (4).
  6. ``call(fn)`` runs ``fn(engine)`` on the engine thread between two steps and resolves an asyncio future
     with its result or exception (the session endpoints read and write the prefix cache this way).
  7. ``drain(message)`` (the server shutting down after its grace period, ``dantinox.serving.shutdown``):
     every request in flight gets ("shutdown", message) and leaves the engine, and later submissions are
     answered ("dead", message), so each handler ends its answer with an error instead of being cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from .engine import Engine
from .request import QueueFullError, RequestError, RequestOutput, SamplingOptions

log = logging.getLogger("dantinox.serving")

IDLE_WAIT_S = 0.05


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float          # perf_counter seconds
    last_token: float | None = None
    first_token: float | None = None
    tokens: int = 0
    slice_name: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0

    def send(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shutting down)
            pass


class EngineWorker:
    """Runs ``engine`` in a daemon thread. ``metrics`` (optional) is a ServerMetrics; ``request_log``
    (optional) a request_log.RequestLog that gets one line per finished request."""

    def __init__(self, engine: Engine, metrics=None, request_log=None, warmup=None):
        self.engine = engine
        self.metrics = metrics
        self.request_log = request_log
        self.warmup = warmup
        self.commands: queue.Queue = queue.Queue()
        self.snapshot: dict = engine.stats()
        self.healthy = True
        self.error: str | None = None
        self._streams: dict[str, _Stream] = {}
        self.draining: str | None = None   # the message of drain(), once called
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dantinox-engine", daemon=True)

    # Called from other threads ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self.warmup is not None:
            self.warmup.cancel()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.healthy

    @property
    def ready(self) -> bool:
        """True once the warm-up (if any) has run every item, while the worker is alive."""
        return self.alive and (self.warmup is None or self.warmup.finished)

    def submit(self, request_ids: list[str], prompt_ids: list, options: list[SamplingOptions],
               loop: asyncio.AbstractEventLoop, events: asyncio.Queue, slice_name: str | None = None) -> None:
        """Queue one completion: request_ids[i] runs with options[i] on the same prompt_ids (choice i).
        Replies go to ``events`` on ``loop`` (see the module docstring); choices i > 0 share the first
        one's prompt blocks through the engine's prefix cache (``share_prompt_with``). slice_name: the class
        the request log records for it. A request that is invalid or can never fit is refused here, without
        waiting for the worker (which may be compiling a warm-up program)."""
        check = getattr(self.engine, "check_request", None)   # Engine's; a duck-typed stand-in may lack it
        try:
            for opts in options:
                if check is not None:
                    check(prompt_ids, opts)
        except RequestError as err:
            if self.metrics:
                self.metrics.rejected(err)
            _Stream(loop, events, time.perf_counter()).send(("rejected", err))
            return
        if self.draining is not None:
            _Stream(loop, events, time.perf_counter()).send(("dead", self.draining))
            return
        self.commands.put(("submit", list(request_ids), prompt_ids, list(options), loop, events,
                           time.perf_counter(), slice_name))

    def call(self, fn, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future on ``loop`` for ``fn(engine)``, run on the engine thread between two steps (item 6); it
        fails with RuntimeError when the worker is draining or dead."""
        future = loop.create_future()
        self.commands.put(("call", fn, loop, future))
        return future

    def drain(self, message: str) -> None:
        """End every request in flight with ("shutdown", message) and refuse later ones (see item 6)."""
        self.draining = message
        self.commands.put(("drain", message))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Ask the worker to stop ``request_id`` (one engine request) and free its blocks. ``reason`` is the
        finish reason the engine records for it (so /health's engine counters and /metrics agree): "abort"
        (the client left), or "stop" (the server ended it on a stop string, which the engine does not see)."""
        self.commands.put(("abort", request_id, reason))

    # The worker thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                warming = self.warmup is not None and not self.warmup.finished
                self._take_commands(block=not self.engine.has_unfinished() and not warming)
                if self.engine.has_unfinished():
                    self._route(self.engine.step())
                elif warming:
                    self.warmup.run_next()
                self._publish()
        except Exception as err:  # a bug outside the engine's own step handling: fail loudly, never hang
            log.exception("engine worker stopped")
            self.healthy, self.error = False, repr(err)
            for rid, stream in self._streams.items():
                stream.send(("output", RequestOutput(rid, [], True, "error", f"engine failed: {err!r}")))
            self._streams.clear()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command: tuple) -> None:
        if command[0] == "abort":
            self.engine.abort(command[1], command[2])
            return
        if command[0] == "call":
            _, fn, loop, future = command
            try:
                if self.draining is not None:
                    raise RuntimeError(self.draining)
                outcome = (future.set_result, fn(self.engine))
            except Exception as err:  # noqa: BLE001 (handed to the caller, who answers with it)
                outcome = (future.set_exception, err)
            try:
                loop.call_soon_threadsafe(lambda: future.done() or outcome[0](outcome[1]))
            except RuntimeError:   # the loop is closed
                pass
            return
        if command[0] == "drain":
            for rid, stream in list(self._streams.items()):
                self.engine.abort(rid)
                stream.send(("shutdown", command[1]))
            self._streams.clear()
            return
        if self.draining is not None:   # submitted before drain() was called, queued after it
            _Stream(command[4], command[5], command[6]).send(("dead", self.draining))
            return
        _, rids, prompt_ids, options, loop, events, submitted, slice_name = command
        added = []
        try:
            self._check_choices(len(rids))
            for rid, opts in zip(rids, options):
                self.engine.add_request(prompt_ids, opts, request_id=rid,
                                        share_prompt_with=None if rid == rids[0] else rids[0])
                added.append(rid)
        except (RequestError, QueueFullError) as err:
            for rid in added:  # all or none: the choices already queued leave again
                self.engine.abort(rid)
            if self.metrics:
                self.metrics.rejected(err)
            _Stream(loop, events, submitted).send(("rejected", err))
            return
        for rid in rids:
            self._streams[rid] = _Stream(loop, events, submitted, slice_name=slice_name,
                                         prompt_tokens=len(prompt_ids))
        self._streams[rids[0]].send(("accepted",))

    def _check_choices(self, n: int) -> None:
        """RequestError naming "n" when a request's n choices could never all wait in the queue at once (each
        choice is one engine request): a 429 "retry later" would never succeed."""
        scheduler = getattr(self.engine, "scheduler", None)
        limit = scheduler.policy.max_queued if scheduler is not None else None
        if limit is not None and n > limit:
            raise RequestError("n", f"n={n} is not allowed: each choice is one request in the queue, and this "
                               f"server queues at most max_queued={limit} (serve --max-queued)")

    def _route(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.new_token_ids:
                if self.metrics:
                    since = now - (stream.last_token or stream.submitted)
                    self.metrics.token(since, first=stream.last_token is None)
                stream.last_token = now
                stream.first_token = now if stream.first_token is None else stream.first_token
                stream.tokens += len(out.new_token_ids)
            if self.request_log and out.request_id in getattr(self.engine, "requests", {}):
                stream.cached_tokens = self.engine.requests[out.request_id].num_cached_tokens
            if out.finished:
                del self._streams[out.request_id]
                if self.metrics:
                    self.metrics.finished(out.finish_reason)
                if self.request_log:
                    self.request_log.record(stream.submitted, stream.first_token, stream.last_token, stream.tokens,
                                            stream.prompt_tokens, stream.cached_tokens, out.finish_reason,
                                            stream.slice_name)
            stream.send(("output", out))

    def _publish(self) -> None:
        self.snapshot = self.engine.stats()
        if self.metrics:
            self.metrics.update(self.snapshot)
