"""The timing client of benchmarks/serve_vs_llamacpp.py: streamed /v1/completions, timed on the client side.

Every request is greedy (``temperature: 0``), streamed with ``stream_options.include_usage``, with an explicit
``max_tokens`` and ``ignore_eos: true`` (both servers read it), so both servers generate the same number of
tokens. The clock is this process's ``time.perf_counter``; for each request it records the time it was sent,
the arrival of every server-sent event that carries text (``chunk_s``, seconds after sending), the end of the
stream, and the final event's ``usage`` (both servers send one: completion and prompt tokens as the server
counted them, and ``prompt_tokens_details.cached_tokens``, the prompt tokens served from its prefix cache) and
llama-server's ``timings`` where present.
Derived per request, as vLLM's benchmark_serving.py defines them: TTFT = first text event - sent; TPOT =
(end - first text event) / (completion tokens - 1).
Give a long timeout: a request may wait minutes in a busy server's queue, and llama-server keeps generating for a
client that gave up (so an early timeout distorts every later request).
Each request opens its own connection (no keep-alive): llama-server may close a connection after a stream, and
a request sent on it would fail at once.
A trace workload runs open loop: one asyncio task per request, each sleeping until its arrival time, so a slow
server never delays the arrivals. Single prompts are sent one after another.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx


def request_body(text: str, max_tokens: int) -> dict:
    """The JSON body of one benchmark request (see the module docstring)."""
    return dict(prompt=text, max_tokens=max_tokens, temperature=0, stream=True, ignore_eos=True,
                stream_options={"include_usage": True})


def _read_event(line: str, record: dict, sent: float) -> None:
    """Fold one ``data: {...}`` line into ``record``."""
    event = json.loads(line[6:])
    if event.get("usage"):
        record["usage"] = event["usage"]
    if event.get("timings"):
        record["timings"] = event["timings"]
    for choice in event.get("choices") or []:
        if choice.get("text"):
            record["chunk_s"].append(time.perf_counter() - sent)
            record["text"] += choice["text"]
        record["finish_reason"] = choice.get("finish_reason") or record["finish_reason"]


async def stream_one(client: httpx.AsyncClient, url: str, req, start: float, wait: bool = True) -> dict:
    """Send ``req`` (a TextRequest) at ``start + req.arrival_s`` (perf_counter seconds; at once when ``wait`` is
    False) and time its stream. ``sent_s`` and ``end_s`` are seconds after ``start``, ``chunk_s`` seconds after
    sending. Returns its record (see the module docstring); a failure (an HTTP status other than 200, a dropped
    connection, a timeout) is recorded in ``status`` / ``error``, never raised."""
    if wait:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - start)))
    sent = time.perf_counter()
    record = dict(name=req.name, arrival_s=req.arrival_s, sent_s=sent - start, ref_prompt_tokens=req.prompt_tokens,
                  max_tokens=req.max_tokens, status=None, error=None, chunk_s=[], text="", usage=None,
                  timings=None, finish_reason=None)
    try:
        async with client.stream("POST", url, json=request_body(req.text, req.max_tokens)) as reply:
            record["status"] = reply.status_code
            if reply.status_code != 200:
                record["error"] = (await reply.aread()).decode("utf-8", "replace")[:500]
            else:
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        _read_event(line, record, sent)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["end_s"] = time.perf_counter() - start
    return derive(record)


def derive(record: dict) -> dict:
    """Add ttft_s, tpot_s, completion_tokens, prompt_tokens, cached_tokens and ``complete`` (status 200 and
    exactly max_tokens tokens) to a request record; None where the stream gave no figure."""
    usage = record.get("usage") or {}
    tokens = usage.get("completion_tokens")
    chunks = record["chunk_s"]
    record["completion_tokens"] = tokens
    record["prompt_tokens"] = usage.get("prompt_tokens")
    record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    record["ttft_s"] = chunks[0] if chunks else None
    stream_s = record["end_s"] - record["sent_s"] - chunks[0] if chunks else None
    record["tpot_s"] = stream_s / (tokens - 1) if chunks and tokens and tokens > 1 else None
    record["complete"] = record["status"] == 200 and tokens == record["max_tokens"] and bool(chunks)
    return record


async def run_workload(url: str, workload, timeout_s: float) -> tuple[list, float]:
    """Run a Workload against ``url`` (the server's /v1/completions), each request waiting at most ``timeout_s``
    seconds between bytes. Returns (records in request order, wall seconds from the workload's start to its
    last stream's end)."""
    limits = httpx.Limits(max_connections=len(workload.requests), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()
        if workload.kind == "trace":
            records = await asyncio.gather(*(stream_one(client, url, r, start) for r in workload.requests))
        else:
            records = []
            for r in workload.requests:
                records.append(await stream_one(client, url, r, start, wait=False))
    return list(records), time.perf_counter() - start
