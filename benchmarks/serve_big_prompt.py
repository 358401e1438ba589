"""A small request's latency beside a 10 MB prompt (issue 19, item 4: one request cannot stall the server).

The bundled ``dante`` run (byte-level BPE, max_context 256) is served in this process on 127.0.0.1 by the real
app (``create_app`` under uvicorn). The small request is a completion of "Nel mezzo" with max_tokens 4,
greedy; its latency is the wall time of one HTTP call, measured:
  alone                    with nothing else running;
  beside 10 MB: 413        while a 10 MB prompt is sent to a server with the default 1 MiB body limit
                           (answered 413 from its Content-Length, the body never read);
  beside 10 MB: by length  with --max-request-bytes 16MiB: the 10 MB body is read and parsed, and the prompt
                           is refused from its length in characters (no token of the vocabulary spans more
                           than C characters), never tokenized;
  beside 10 MB: tokenized  as above, but the bound switched off, as for a tokenizer whose pipeline allows none:
                           the whole 10 MB prompt is tokenized (in a worker thread, the GIL released) and then
                           refused by the engine; the small requests are sent while the tokenizer runs.
Each line gives the median and the largest of --repeats small requests (beside: one big prompt per small
request, except "tokenized", where all small requests run during one tokenization). Before the fix (the
prompt tokenized on the event loop) the small request waited 8.8-67 s.

Run:  python benchmarks/serve_big_prompt.py [--repeats 5] [--megabytes 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import httpx

from dantinox.runs.bundled import bundled_run_dir
from dantinox.runs.chars_per_token import max_chars_per_token
from dantinox.runs.run_dir import load_run
from dantinox.serving import request_limits
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.server import ServerThread, create_app

SMALL = {"prompt": "Nel mezzo", "max_tokens": 4, "temperature": 0}


def serve(max_request_bytes: int, bound: bool = True) -> tuple[ServerThread, object]:
    """A server of the bundled run; bound False serves it as if its tokenizer had no characters-per-token bound."""
    model, _, tokenizer, _ = load_run(bundled_run_dir("dante"))
    engine = PagedEngine(model, EngineConfig(block_size=16, max_running=4, max_batched_tokens=64))
    if not bound:
        request_limits.max_chars_per_token = lambda _tokenizer: None
    try:
        app = create_app(engine, tokenizer, "dante", max_request_bytes=max_request_bytes)
    finally:
        request_limits.max_chars_per_token = max_chars_per_token
    return ServerThread(app).start(), tokenizer


def small_latency(client: httpx.Client, url: str) -> float:
    t0 = time.perf_counter()
    answer = client.post(url + "/v1/completions", json=SMALL)
    took = time.perf_counter() - t0
    if answer.status_code != 200:
        raise RuntimeError(f"the small request got {answer.status_code}: {answer.text[:200]}")
    return took


def beside_big(server: ServerThread, body: bytes, repeats: int) -> tuple[list[float], set]:
    """Latencies of ``repeats`` small requests, each sent while one big request is under way; the big
    requests' status codes."""
    latencies, statuses = [], set()
    with httpx.Client(timeout=600) as client, httpx.Client(timeout=600) as big_client:
        small_latency(client, server.url)  # compiled and connected before timing
        for _ in range(repeats):
            sent = threading.Event()

            def big(sent=sent):
                sent.set()
                statuses.add(big_client.post(server.url + "/v1/completions", content=body,
                                             headers={"content-type": "application/json"}).status_code)

            thread = threading.Thread(target=big)
            thread.start()
            sent.wait()
            latencies.append(small_latency(client, server.url))
            thread.join()
    return latencies, statuses


def during_tokenizing(server: ServerThread, tokenizer, body: bytes) -> tuple[list[float], set, float]:
    """Small requests sent one after another while one big prompt is being tokenized; (latencies, the big
    request's status, seconds the tokenizer took)."""
    entered, spent, statuses = threading.Event(), [], set()
    real = tokenizer.encode

    def timed(text, *a, **k):
        if len(text) < 10**6:
            return real(text, *a, **k)
        entered.set()
        t0 = time.perf_counter()
        try:
            return real(text, *a, **k)
        finally:
            spent.append(time.perf_counter() - t0)

    tokenizer.encode = timed
    latencies = []
    with httpx.Client(timeout=600) as client, httpx.Client(timeout=600) as big_client:
        small_latency(client, server.url)
        thread = threading.Thread(target=lambda: statuses.add(big_client.post(
            server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
        ).status_code))
        thread.start()
        entered.wait(600)
        while not spent and len(latencies) < 1000:
            latencies.append(small_latency(client, server.url))
        thread.join()
    tokenizer.encode = real
    return latencies, statuses, spent[0] if spent else float("nan")


def line(name: str, latencies: list[float], note: str = "") -> str:
    return (f"| {name} | {len(latencies)} | {1000 * statistics.median(latencies):.0f} | "
            f"{1000 * max(latencies):.0f} | {note} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=10.0, help="size of the big prompt (10^6 bytes)")
    args = parser.parse_args()
    words = "Nel mezzo del cammin di nostra vita "
    prompt = words * int(args.megabytes * 10**6 / len(words))
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode("utf-8")
    print(f"# big prompt {len(body) / 1e6:.1f} MB body, {len(prompt):,} characters; {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, python {sys.version.split()[0]}")
    print("| small request | n | median ms | max ms | big request |")
    print("|---|---|---|---|---|")
    server, tokenizer = serve(request_limits.DEFAULT_MAX_REQUEST_BYTES)
    with httpx.Client(timeout=600) as client:
        small_latency(client, server.url)
        alone = [small_latency(client, server.url) for _ in range(args.repeats)]
    print(line("alone", alone), flush=True)
    latencies, statuses = beside_big(server, body, args.repeats)
    print(line("beside 10 MB: 413", latencies, f"status {sorted(statuses)}"), flush=True)
    server.stop()
    server, tokenizer = serve(16 * 2**20)
    bound = max_chars_per_token(tokenizer)
    latencies, statuses = beside_big(server, body, args.repeats)
    print(line("beside 10 MB: by length", latencies, f"status {sorted(statuses)}, C = {bound}"), flush=True)
    server.stop()
    server, tokenizer = serve(16 * 2**20, bound=False)
    latencies, statuses, seconds = during_tokenizing(server, tokenizer, body)
    print(line("beside 10 MB: tokenized", latencies, f"status {sorted(statuses)}, tokenizing took {seconds:.1f} s"),
          flush=True)
    server.stop()


if __name__ == "__main__":
    main()
