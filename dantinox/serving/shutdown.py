"""Shutting the server down on Ctrl-C (SIGINT) or SIGTERM without a traceback and without a cut answer.

uvicorn, told to exit, stops accepting connections and waits up to its graceful timeout for the requests in
flight; past it, it cancels their tasks, which Starlette answers with a bare 500 "Internal Server Error"
(plain requests) or a stream cut mid-event, each with a logged traceback. ``DrainingServer`` avoids that:
``grace_s`` seconds after the exit signal it drains the engine worker (``worker.EngineWorker.drain``): every
request still running ends at once with OpenAI's error object, a plain one answered 503 (type server_error,
"the server is shutting down"), a streamed one with that error as its last event and then its normal end
("data: [DONE]" for completions and chat, response.failed for the Responses API). The handlers return, the
connections close, and uvicorn's own graceful wait (grace_s + DRAIN_S) ends without cancelling anything;
``dantinox serve`` then exits with status 130 (``dantinox.cli.entrypoint``).
"""

from __future__ import annotations

import asyncio

import uvicorn

DRAIN_S = 5.0  # seconds past the grace period uvicorn still waits for the drained answers to be sent
SHUTTING_DOWN = "the server is shutting down: the request was ended before it finished; send it again later"


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server that drains ``worker`` (an EngineWorker) ``grace_s`` seconds into its shutdown.
    config's timeout_graceful_shutdown is set to grace_s + DRAIN_S."""

    def __init__(self, config: uvicorn.Config, worker, grace_s: float):
        if grace_s < 0:
            raise ValueError(f"grace_s={grace_s!r} is not allowed: seconds >= 0")
        config.timeout_graceful_shutdown = grace_s + DRAIN_S
        super().__init__(config)
        self.worker, self.grace_s = worker, grace_s

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.create_task(self._drain_later())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    async def _drain_later(self) -> None:
        await asyncio.sleep(self.grace_s)
        self.worker.drain(SHUTTING_DOWN)
