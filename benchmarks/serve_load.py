"""Load test against a live dantinox server on 127.0.0.1: a mixed trace arriving faster than it is served,
on a KV pool small enough to force preemption.

The script saves the small random model of benchmarks/serve_common.py (with a byte-level tokenizer) to a
temporary run directory and starts ``dantinox serve`` on it in a child process (127.0.0.1, a free port), with
a KV pool of --blocks blocks of 16 tokens (passed as --kv-memory): far fewer than the running sequences
could fill, so sequences get preempted (--policy recompute or swap). The client (this process) replays
the trace of benchmarks/serve_common.py (--requests requests, Poisson arrivals at --rate per second,
greedy, streamed) with httpx. The server's log goes to serve_load.log in the temporary directory; its
"KV cache: ..." line is printed.
Checks: every request either completes with exactly its max_tokens tokens or gets 429; each completed
text equals the batch-1 ``dantinox.generate`` output for its prompt; once idle, every KV block is free and
/health answers "ok". Prints TTFT p50/p99 and TPOT p50/p99 (client side, ms), output throughput
(tokens/s over the wall time of the run), completed / rejected counts, preemptions and prefix-cache hits.
Bounded: one pass over the trace, a 120 s client timeout per request.

Run:  python benchmarks/serve_load.py [--requests 200] [--rate 100] [--blocks 24] [--policy recompute]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from serve_common import add_trace_arguments, mixed_trace, pct, small_model

import dantinox as dx
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.kv.sizes import page_bytes


async def one_request(client: httpx.AsyncClient, url: str, req, start: float) -> dict:
    await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - start)))
    sent = time.perf_counter()
    body = dict(prompt=req.prompt, max_tokens=req.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
    text, first, usage, finish = [], None, None, None
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return dict(status=reply.status_code, retry_after=reply.headers.get("Retry-After"))
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice["text"]:
                    first = first or time.perf_counter()
                    text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    done = time.perf_counter()
    return dict(status=200, text="".join(text), ttft=(first or done) - sent, end=done - start,
                tpot=(done - (first or done)) / max(usage["completion_tokens"] - 1, 1),
                tokens=usage["completion_tokens"], finish=finish)


async def replay(url: str, trace) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=len(trace), max_keepalive_connections=len(trace))
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, r, start) for r in trace))
    return results, time.perf_counter() - start


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        idle = health["engine"]["running"] == 0 and health["engine"]["waiting"] == 0
        if idle or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def wait_warm(url: str, timeout: float = 900.0) -> dict:
    """/health once the background warm-up is done (GET /ready answers 200), or at the timeout: a short run can
    end while the server still compiles its remaining programs, and "warming up" is not a failure."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    return httpx.get(url + "/health").json()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(run_dir: str, args, memory: int, log) -> tuple[subprocess.Popen, str]:
    """``dantinox serve`` in a child process; returns it and its URL once /health answers (180 s at most)."""
    port = free_port()
    command = [sys.executable, "-m", "dantinox.cli", "serve", "--run_dir", run_dir, "--port", str(port),
               "--kv-memory", str(memory), "--block-size", "16", "--policy", args.policy,
               "--max-running", "16", "--max-queued", str(args.max_queued), "--max-batched-tokens", "64"]
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while time.monotonic() < deadline and child.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return child, url
        except httpx.HTTPError:
            time.sleep(0.2)
    child.kill()
    raise RuntimeError(f"dantinox serve did not start on port {port}; see {log.name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=100.0, help="mean arrivals per second")
    parser.add_argument("--blocks", type=int, default=24, help="KV blocks of 16 tokens in the pool")
    parser.add_argument("--policy", choices=("recompute", "swap"), default="recompute")
    parser.add_argument("--max-queued", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    add_trace_arguments(parser)
    args = parser.parse_args()
    model = small_model()
    tokenizer = train_tokenizer("".join(chr(32 + i % 95) for i in range(2000)), "bpe", 256)  # bytes only
    assert tokenizer.vocab_size == model.cfg.vocab_size, (tokenizer.vocab_size, model.cfg.vocab_size)
    trace = mixed_trace(args.requests, args.rate, args.seed, vocab=tokenizer.vocab_size,
                        prompt_range=args.prompt_range, new_range=args.new_range, new_dist=args.new_dist)
    with tempfile.TemporaryDirectory() as tmp:
        save_run(tmp, model, model.cfg, tokenizer)
        with open(os.path.join(tmp, "serve_load.log"), "w+") as log:
            child, url = start_server(tmp, args, args.blocks * page_bytes(model.cfg, 16), log)
            try:
                results, wall = asyncio.run(replay(url + "/v1/completions", trace))
                wait_idle(url)
                health = wait_warm(url)
            finally:
                child.send_signal(signal.SIGINT)
                child.wait(30)
            log.seek(0)
            print(next((line.split(" INFO ")[-1].strip() for line in log if "KV cache:" in line), ""))
    ok = [(r, res) for r, res in zip(trace, results) if res["status"] == 200]
    rejected = [res for res in results if res["status"] == 429]
    others = [res for res in results if res["status"] not in (200, 429)]
    def reference(r) -> str:
        return tokenizer.decode(np.asarray(dx.generate(model, r.prompt, r.max_tokens)).tolist())

    wrong = [i for i, (r, x) in enumerate(ok) if x["tokens"] != r.max_tokens or x["text"] != reference(r)]
    stats = health["engine"]
    tokens = sum(res["tokens"] for _, res in ok)
    (p0, p1), (n0, n1) = args.prompt_range, args.new_range
    print(f"trace: {len(trace)} requests at {args.rate:g}/s, prompts {p0}-{p1}, {n0}-{n1} new tokens; pool "
          f"{args.blocks} blocks x 16 tokens, policy {args.policy}; server in a child process")
    print(f"completed {len(ok)}, rejected with 429: {len(rejected)}, other statuses: {len(others)}, "
          f"outputs differing from batch-1 generate: {len(wrong)}")
    ttft, tpot = [1e3 * x["ttft"] for _, x in ok], [1e3 * x["tpot"] for _, x in ok]
    print(f"TTFT p50 {pct(ttft, 50):.1f} ms, p99 {pct(ttft, 99):.1f} ms; TPOT p50 {pct(tpot, 50):.2f} ms, "
          f"p99 {pct(tpot, 99):.2f} ms")
    print(f"throughput {tokens / wall:.1f} output tokens/s ({tokens} tokens in {wall:.2f} s); preemptions "
          f"{stats['preemptions']}, prefix-cache hits {stats['prefix_cache_hits']} blocks")
    print(f"after the run: health {health['status']}, blocks used {stats['blocks_used']} / free "
          f"{stats['blocks_free']} of {stats['blocks_total']}")
    passed = (not others and not wrong and stats["blocks_used"] == 0 and health["status"] == "ok"
              and stats["preemptions"] > 0 and all(res["finish"] == "length" for _, res in ok))
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
