"""POST /sessions/save and /sessions/restore: one prompt's KV cache written to a file and read back, after
llama-server's ``POST /slots/{id}?action=save|restore`` (same body and answer fields; dantinox has no slots, so
the sequence is named by its prompt).

  POST /sessions/save     {"filename": "doc.session", "prompt": "text" | [token ids]}
      -> {"filename", "n_saved": prompt tokens whose KV blocks were written, "n_written": bytes,
          "timings": {"save_ms"}}
      The prompt runs through the engine first for one token (its blocks, when cached already, are a prefix
      hit), then every full block of it is read from the prefix cache (the pool, else the KV tiers) and the
      file is written atomically (``dantinox.kv.sessions``: tokens, layout, blocks, checksum).
  POST /sessions/restore  {"filename": "doc.session"}
      -> {"filename", "n_restored": prompt tokens now in the prefix cache, "n_read": bytes,
          "timings": {"restore_ms"}}
      The file is read and checked (its model and cache layout must be this server's: a file from another one
      is answered 400 naming the first difference) and its blocks enter the prefix cache under the hashes of
      its tokens, where the next request with that prefix finds them (``kv.sessions.import_prefix``).
Files live in ``serve --session-dir DIR`` (llama-server's --slot-save-path); a filename is a plain name in it
(no directory part, not starting with a dot). Without --session-dir both answer 501. File reads and writes run
in a worker thread; the cache itself is read and written on the engine thread (``EngineWorker.call``).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ..kv.sessions import SessionError, export_prefix, import_prefix, load_block_session, save_block_session
from ..kv.tier_block import tier_layout
from .completions import _next_event, _rejection
from .protocol import error_body
from .request import RequestError, SamplingOptions

POLL_S = 0.5   # how often a wait on the engine thread checks that it is still alive


def add_session_routes(app: FastAPI, service, session_dir: str | None, model_digest: str | None) -> None:
    """Add the two routes (module docstring). service: the server's completions service (its worker, tokenizer
    and prompt encoding); session_dir: the directory of session files (None: both answer 501); model_digest:
    names the served weights (``dantinox.cli.serve.model_digest``; None: the engine's own parameters hashed
    would differ per process, so the routes answer 501)."""
    engine = service.worker.engine
    layout = None
    if session_dir is not None and model_digest is not None:
        layout = tier_layout(engine.cfg, engine.allocator.block_size, model_digest, getattr(engine, "draft_cfg", None))

    @app.post("/sessions/save")
    async def save(body: dict):
        started = time.perf_counter()
        try:
            path = _session_path(session_dir, layout, body)
            prompt = body.get("prompt")
            if not isinstance(prompt, (str, list)) or not prompt:
                raise RequestError("prompt", "prompt is required: the text or token ids whose KV cache to save")
            tokens = await service.encode_prompt(prompt)
            service.worker.engine.check_request(tokens, SamplingOptions(max_new_tokens=1))
        except RequestError as err:
            return _error(str(err), err.field, 501 if isinstance(err, _Off) else 400)
        refused = await _run_once(service, tokens)
        if refused is not None:
            return refused
        blocks = await _on_engine(service.worker, lambda e: export_prefix(e.cache, tokens))
        try:
            written = await asyncio.to_thread(save_block_session, path, layout, tokens, blocks)
        except OSError as err:
            return _error(f"cannot write {path}: {err.strerror or err}", "filename", 500, "server_error")
        return {"filename": body["filename"], "n_saved": len(blocks) * layout.block_size, "n_written": written,
                "timings": {"save_ms": (time.perf_counter() - started) * 1e3}}

    @app.post("/sessions/restore")
    async def restore(body: dict):
        started = time.perf_counter()
        try:
            path = _session_path(session_dir, layout, body)
        except RequestError as err:
            return _error(str(err), err.field, 501 if isinstance(err, _Off) else 400)
        try:
            tokens, blocks = await asyncio.to_thread(load_block_session, path, layout)
            size = os.path.getsize(path)
        except FileNotFoundError:
            return _error(f"no session file {body['filename']!r} in the session directory", "filename", 404)
        except SessionError as err:
            return _error(str(err), "filename", 400)
        except OSError as err:
            return _error(f"cannot read {path}: {err.strerror or err}", "filename", 500, "server_error")
        restored = await _on_engine(service.worker, lambda e: import_prefix(e.cache, tokens, blocks))
        return {"filename": body["filename"], "n_restored": restored, "n_read": size,
                "timings": {"restore_ms": (time.perf_counter() - started) * 1e3}}


def _error(message: str, param: str | None, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, param, kind), status_code=status)


def _session_path(session_dir: str | None, layout, body) -> str:
    """The file a request names under the session directory. RequestError naming "filename" for a missing
    or unsafe name; _Off (answered 501) when sessions are off."""
    if session_dir is None or layout is None:
        raise _Off()
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise RequestError("filename", "filename is required: a file name in the server's --session-dir")
    if name != os.path.basename(name) or name.startswith(".") or "\\" in name or "\0" in name or len(name) > 255:
        raise RequestError("filename", f"filename {name!r} is not allowed: a plain file name (no directory, not "
                           "starting with a dot)")
    return os.path.join(session_dir, name)


class _Off(RequestError):
    """Sessions are off (no --session-dir)."""

    def __init__(self):
        super().__init__("sessions", "sessions are off: start the server with --session-dir DIR")


async def _run_once(service, tokens: list[int]):
    """Run ``tokens`` through the engine for one token (their full blocks enter the prefix cache); None, or the
    refusal's response."""
    cid, rids, events, refused = await service.submit(f"session-{uuid.uuid4().hex[:8]}", tokens,
                                                      [SamplingOptions(max_new_tokens=1)])
    if refused is not None:
        return refused
    while True:
        event = await _next_event(events, service.worker)
        if event is None or event[0] in ("dead", "shutdown"):
            return _error("the engine stopped before the session's prompt was computed", None, 503, "server_error")
        if event[0] == "rejected":
            return _rejection(event[1])
        if event[0] == "output" and event[1].finished:
            if event[1].finish_reason == "error":
                return _error(f"the session's prompt failed: {event[1].error}", None, 500, "server_error")
            return None


async def _on_engine(worker, fn):
    """``fn(engine)`` on the engine thread (``EngineWorker.call``); RuntimeError when the worker dies first."""
    future = worker.call(fn, asyncio.get_running_loop())
    while True:
        done, _ = await asyncio.wait({future}, timeout=POLL_S)
        if done:
            return future.result()
        if not worker.alive:
            raise RuntimeError(f"engine stopped: {worker.error}")
