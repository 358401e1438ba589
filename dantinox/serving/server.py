"""OpenAI-compatible HTTP server: FastAPI on uvicorn in front of one Engine running in its own thread.

Design (threads and queues):
  1. uvicorn runs the FastAPI app on one asyncio event loop. A body over the size limit is answered 413
     before it is read (``request_limits.BodySizeLimit``). Handlers validate the body, refuse a prompt that
     cannot fit the context by its length in characters, encode the prompt with the run's tokenizer in a
     worker thread (so a huge prompt never holds the loop) and hand the request to the EngineWorker
     (``dantinox.serving.worker``) through its thread-safe command queue, together with a fresh
     ``asyncio.Queue`` for the replies. A request for
     n choices becomes n engine requests (ids ``<completion id>-<i>``), submitted together.
  2. The worker thread owns the engine: it admits or rejects the request (the first reply: "accepted" or
     "rejected" with a RequestError -> 400 naming the field, or QueueFullError -> 429 with Retry-After),
     then steps the engine and pushes each new token to the request's queue via
     ``loop.call_soon_threadsafe``. Only the worker thread ever calls the engine.
  3. The handler turns each choice's tokens into text with a StreamDecoder (never splitting a multi-byte
     character), watches for stop strings (holding back text that may begin one), collects the tokens'
     log-probabilities when asked (``logprobs``, see ``dantinox.serving.protocol``), and answers with one
     JSON body or with server-sent events (``stream=true``, one choice per chunk) ending in
     ``data: [DONE]``.
  4. A stop string, or a client that disconnects, sends an abort to the worker: the request leaves the
     engine and its KV blocks are freed at once. The stop string's abort carries the reason "stop", so
     /metrics counts that request as finished by "stop", not "abort" (K10). A disconnect is noticed while
     tokens flow: a watcher task polls ``is_disconnected()`` every DISCONNECT_POLL_S seconds beside the
     token loop, for plain and streamed requests alike, and aborts every unfinished choice (case K10).
  5. Every request answered with 400, 413, 429 or 503 is counted once in
     ``dantinox_requests_rejected_total`` under one reason label (see ``ServerMetrics.rejected``).
  6. Every error, whatever raised it, is OpenAI's error object {"error": {"message", "type", "param",
     "code"}}: a body that is not JSON, not an object, misses a field or has a field of the wrong type is a 400
     naming the field (never FastAPI's 422 format); an unknown path or method keeps its 404 / 405 status.
Steps 1, 3 and 4 (validation and submission, the per-choice text, stop strings and disconnects) are
``dantinox.serving.completions``; this module builds the app (``create_app``) and runs it (``ServerThread``).
Endpoints: POST /v1/completions, POST /v1/chat/completions (``dantinox.serving.chat_endpoint``), GET /v1/models,
POST /sessions/save and /sessions/restore (``dantinox.serving.session_endpoints``),
GET /health (liveness: 200 while the engine thread runs, its status "warming up" until the background warm-up
has compiled every program, then "ok"; 503 "unhealthy" once the engine failed), GET /ready (readiness: 200
"ready" once warm, 503 "warming up" before; a Kubernetes readinessProbe's form), GET /metrics (Prometheus
text format). Requests are served during warm-up (``dantinox.serving.warmup``).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api_errors import ModelNotFound
from .api_keys import ApiKeyAuth
from .chat_endpoint import add_chat_route
from .completions import _Service
from .engine import Engine
from .metrics import ServerMetrics
from .protocol import CompletionRequest, error_body
from .request_limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit, TokenListBound, check_max_bytes
from .responses_endpoint import add_responses_route
from .session_endpoints import add_session_routes
from .worker import EngineWorker

log = logging.getLogger("dantinox.serving")


def create_app(engine: Engine, tokenizer, model_name: str = "dantinox", chat_format=None,
               stop_ids=None, request_log=None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_parser: str | None = None, warmup=None, api_keys: tuple = (), api_key_all: bool = False,
               strict_fields: bool = False, model_aliases: tuple = (), session_dir: str | None = None,
               model_digest: str | None = None) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan.

    engine: an Engine (not yet driven by any thread); tokenizer: a dantinox TextTokenizer; chat_format: the
    model's ``dantinox.runs.chat.ChatFormat`` (None: /v1/chat/completions answers 400, the model has no template);
    stop_ids: the token ids every request stops at unless it sets ignore_eos (``dantinox.runs.stop_ids.
    read_stop_ids``); None: chat_format's stop_ids, or none without a chat format.
    request_log: a ``request_log.RequestLog`` (one line per finished request; closed with the app) or None.
    max_request_bytes: the largest request body accepted (bytes); a larger one is answered 413.
    tool_parser: the tool-call syntax chat answers are read in ("hermes" or "llama3_json",
    ``dantinox.serving.tool_calls``); None: the one the chat template shows.
    warmup: a ``warmup.Warmup`` the engine thread runs in the background while serving (None: none; the
    engine is ready at once, e.g. warmed up before).
    api_keys: the keys a request must show (``api_keys``; empty: none needed); api_key_all: also for /health,
    /ready and /metrics. strict_fields: refuse request fields no part of the server reads (400) instead of
    ignoring them. model_aliases: more names a request's ``model`` may give for this model (answers report
    model_name; /v1/models lists model_name, GET /v1/models/{alias} finds it). session_dir: the directory of
    POST /sessions/save and /sessions/restore (``session_endpoints``; None: they answer 501); model_digest:
    names the served weights in session files (``dantinox.cli.serve.model_digest``).
    Raises ValueError for a max_request_bytes below 1.
    """
    check_max_bytes(max_request_bytes, "max_request_bytes")
    metrics = ServerMetrics()
    worker = EngineWorker(engine, metrics, request_log, warmup)

    @asynccontextmanager
    async def lifespan(_app):
        worker.start()
        yield
        worker.stop()
        if request_log is not None:
            request_log.close()

    app = FastAPI(title="dantinox", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes,
                       on_reject=lambda reason: metrics.rejected(reason=reason),
                       precheck=TokenListBound(engine.max_context))
    app.add_middleware(ApiKeyAuth, keys=tuple(api_keys), protect_all=api_key_all,   # outermost: before the body
                       on_reject=lambda: metrics.rejected(reason="unauthorized"))
    app.state.worker, app.state.metrics, app.state.engine = worker, metrics, engine
    if stop_ids is None:
        stop_ids = chat_format.stop_ids if chat_format is not None else ()
    service = _Service(worker, tokenizer, model_name, engine.max_context, metrics, stop_ids, strict_fields,
                       model_aliases)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        path = request.url.path
        required = ("messages" if path.endswith("/chat/completions") else "input" if path.endswith("/responses")
                    else "prompt")
        body, label = _validation_error(exc, required, request.headers.get("content-type"))
        metrics.rejected(reason=f"invalid_{label or 'body'}")
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else repr(exc.detail)
        body = error_body(f"{request.method} {request.url.path}: {detail}", None,
                          "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HttpRequest):
        return await service.complete(body, request)

    add_chat_route(app, service, chat_format, tool_parser)
    add_responses_route(app, service, chat_format, tool_parser)
    add_session_routes(app, service, session_dir, model_digest)
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "dantinox",
            "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name and model_id not in model_aliases:
            err = ModelNotFound(model_id, model_name)
            return JSONResponse(error_body(str(err), "model", "invalid_request_error", err.code), status_code=404)
        return card

    _add_unversioned_paths(app)

    @app.get("/health")
    async def health():
        warm = _warmup_status(worker)
        if not worker.alive:
            label = "unhealthy"
        else:
            label = "ok" if warm["status"] == "ready" else "warming up"
        return JSONResponse(_with_error({"status": label, "warmup": warm, "engine": worker.snapshot}, worker),
                            status_code=200 if worker.alive else 503)

    @app.get("/ready")
    async def ready():
        warm = _warmup_status(worker)
        label = warm["status"] if worker.alive else "unhealthy"
        return JSONResponse(_with_error({"status": label, "warmup": warm}, worker),
                            status_code=200 if worker.ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_unversioned_paths(app: FastAPI) -> None:
    """The OpenAI routes also without their /v1 prefix (/chat/completions, ...), as llama-server serves
    them: a client whose base URL lacks /v1 reaches the same handlers (left out of the OpenAPI schema)."""
    for route in list(app.routes):
        path = getattr(route, "path", "")
        if path.startswith("/v1/"):
            app.add_api_route(path[len("/v1"):], route.endpoint, methods=list(route.methods),
                              include_in_schema=False)


def _with_error(body: dict, worker: EngineWorker) -> dict:
    """``body`` with "error": the engine's failure, when it failed (a healthy answer has no "error" key)."""
    return {**body, "error": worker.error} if worker.error is not None else body


def _warmup_status(worker: EngineWorker) -> dict:
    """The warm-up's progress ({"status", "programs_done", "programs_total", "seconds"}); "ready" without one."""
    if worker.warmup is None:
        return {"status": "ready", "programs_done": 0, "programs_total": 0, "seconds": 0.0}
    return worker.warmup.status()


def _validation_error(exc: RequestValidationError, required: str, content_type: str | None = None
                      ) -> tuple[dict, str | None]:
    """(OpenAI error body, metrics label) for a body FastAPI could not parse or validate (answered with 400):
    the label is the JSON field, "json" (not JSON) or "body" (not an object). required: the field the
    endpoint needs ("prompt" or "messages"), named when the body is missing. content_type: the request's
    Content-Type header; FastAPI reads a body as JSON only when it says JSON, so another one (curl -d sends
    application/x-www-form-urlencoded) is named as the cause."""
    first = exc.errors()[0]
    media = (content_type or "").split(";")[0].strip().lower()
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") != "missing" and "json" not in media:
        return error_body(f"the request body was not read as JSON: its Content-Type is {media or 'not given'}; "
                          "send the header 'Content-Type: application/json'", "body"), "body"
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg"))
        return error_body(f"the request body is not valid JSON: {detail}", "body"), "json"
    if loc == ("body",):
        what = "missing" if first.get("type") == "missing" else "not a JSON object"
        return error_body(f"the request body is {what}: send a JSON object with at least {required!r}",
                          "body"), "body"
    field = str(loc[1]) if len(loc) > 1 else None  # the top-level field (later parts name union members)
    if first.get("type") == "missing":
        return error_body(f"{field} is required", field), field
    # a union field (stop: a string or a list of strings) fails once per member: name every allowed form
    msgs = [e.get("msg") for e in exc.errors() if len(tuple(e.get("loc", ()))) > 1 and str(e["loc"][1]) == field]
    allowed = " or ".join(dict.fromkeys(m for m in msgs if m))
    return error_body(f"{field}: {allowed} (got {first.get('input')!r})", field), field


class ServerThread:
    """Run an app with uvicorn in a background thread, on 127.0.0.1 and a free port by default.

    >>> with ServerThread(create_app(engine, tokenizer)) as server:
    ...     httpx.get(server.url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="dantinox-http", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 60.0) -> "ServerThread":
        """Start serving and wait until the socket listens (a second call does nothing)."""
        if self.thread.is_alive():
            return self
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port} within {timeout} s")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
