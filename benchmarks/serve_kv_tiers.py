"""Time to first token of a long shared document asked several questions, the server restarted between them.

    python benchmarks/serve_kv_tiers.py [--run_dir runs/smollm2] [--doc-tokens 4096] [--questions 3]
           [--max-tokens 16] [--block-size 16] [--llama-server BIN --gguf FILE]

The document is the first --doc-tokens tokens of the bundled en-shakespeare slice (public domain), the
questions short lines after it; each request is prompt = document + question, greedy, streamed, and its TTFT is
the client's time from sending it to the first streamed token. dantinox: every question runs on a freshly
started ``dantinox serve --kv-disk-dir DIR --max-running 1`` (the same DIR each time, empty at first), timed
once /ready says the warm-up has compiled its programs, then the server is stopped. The first question computes
the whole document (and writes its blocks to DIR); the later ones restore it from DIR and compute only their
question (usage.prompt_tokens_details.cached_tokens says how many prompt tokens came back). The target of the
KV tiers: TTFT of questions 2 and 3 at most 0.2 x question 1's.

With --llama-server (and --gguf, the same model's GGUF file) the same questions go to llama-server with
--slot-save-path: question 1 on a fresh server, its slot saved (POST /slots/0?action=save), the server
restarted, the slot restored (POST /slots/0?action=restore, its time reported beside the TTFT), question 2, and
so on; its "restore+TTFT" column is the figure to compare with dantinox's TTFT (dantinox restores inside the
request). Run on a quiet host: one core busy elsewhere moves a 4k-token prefill by seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

QUESTIONS = ["\n\nQuestion: Who speaks first in this text?\nAnswer:",
             "\n\nQuestion: Name one place mentioned above.\nAnswer:",
             "\n\nQuestion: What is the mood of the last lines?\nAnswer:",
             "\n\nQuestion: Which character speaks most?\nAnswer:"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def document(run_dir: str, tokens: int) -> str:
    """The first ``tokens`` tokens of the en-shakespeare slice, as text (repeated if the slice is shorter)."""
    from dantinox.runs.bundled import resolve_slice_file
    from dantinox.runs.tokenizer import TextTokenizer

    text = open(resolve_slice_file("en-shakespeare"), encoding="utf-8").read()
    tokenizer = TextTokenizer.load(os.path.join(run_dir, "tokenizer.json"))
    ids = tokenizer.encode(text, unknown="replace")
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def wait_for(url: str, proc, path: str, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}{path} did not answer 200 within {timeout} s")


def stop(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def streamed_ttft(url: str, path: str, body: dict) -> tuple[float, dict]:
    """(seconds to the first streamed token, the last event's JSON) of one streamed completion."""
    import json

    start, first, last = time.perf_counter(), None, {}
    with httpx.stream("POST", url + path, json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            text = (event.get("choices") or [{}])[0].get("text", event.get("content", ""))
            if first is None and text:
                first = time.perf_counter() - start
            last = event
    return (first if first is not None else time.perf_counter() - start), last


def dantinox_round(args, disk: str, prompt: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "dantinox.cli", "serve", "--run_dir", args.run_dir, "--port", str(port),
           "--kv-disk-dir", disk, "--max-running", "1", "--block-size", str(args.block_size)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, proc, "/ready")
        body = dict(prompt=prompt, max_tokens=args.max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True})
        ttft, last = streamed_ttft(url, "/v1/completions", body)
    finally:
        stop(proc)
    usage = last.get("usage") or {}
    return dict(ttft=ttft, cached=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                prompt_tokens=usage.get("prompt_tokens"))


def llama_round(args, slots: str, prompt: str, first: bool) -> dict:
    port = free_port()
    cmd = [args.llama_server, "-m", args.gguf, "--port", str(port), "--slot-save-path", slots, "-np", "1",
           "-c", str(args.context), "-t", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    restore = 0.0
    try:
        wait_for(url, proc, "/health")
        if not first:
            start = time.perf_counter()
            httpx.post(url + "/slots/0?action=restore", json={"filename": "doc.bin"}, timeout=600).raise_for_status()
            restore = time.perf_counter() - start
        body = dict(prompt=prompt, n_predict=args.max_tokens, temperature=0, stream=True, id_slot=0,
                    cache_prompt=True)
        ttft, last = streamed_ttft(url, "/completion", body)
        httpx.post(url + "/slots/0?action=save", json={"filename": "doc.bin"}, timeout=600).raise_for_status()
    finally:
        stop(proc)
    return dict(ttft=ttft, restore=restore, cached=(last.get("timings") or {}).get("cache_n"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", default="runs/smollm2")
    p.add_argument("--doc-tokens", type=int, default=4096)
    p.add_argument("--questions", type=int, default=3, choices=range(2, len(QUESTIONS) + 1))
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--llama-server", default=None, help="a llama-server binary to run the same questions on")
    p.add_argument("--gguf", default=None, help="the model's GGUF file, for --llama-server")
    p.add_argument("--context", type=int, default=8192, help="llama-server's -c")
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    args = p.parse_args()
    doc = document(args.run_dir, args.doc_tokens)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; document {args.doc_tokens} "
          f"tokens, {args.questions} questions, max_tokens {args.max_tokens}, a restart before each question")
    with tempfile.TemporaryDirectory() as disk:
        rounds = [dantinox_round(args, disk, doc + q) for q in QUESTIONS[:args.questions]]
    base = rounds[0]["ttft"]
    print("dantinox serve --kv-disk-dir")
    for i, r in enumerate(rounds, 1):
        print(f"  question {i}: TTFT {r['ttft']:7.3f} s  ({r['ttft'] / base:.3f} x question 1)  cached "
              f"{r['cached']} of {r['prompt_tokens']} prompt tokens")
    if args.llama_server:
        with tempfile.TemporaryDirectory() as slots:
            rows = [llama_round(args, slots, doc + q, i == 0) for i, q in enumerate(QUESTIONS[:args.questions])]
        base = rows[0]["ttft"]
        print("llama-server --slot-save-path")
        for i, r in enumerate(rows, 1):
            total = r["restore"] + r["ttft"]
            print(f"  question {i}: restore {r['restore']:6.3f} s  TTFT {r['ttft']:7.3f} s  restore+TTFT "
                  f"{total:7.3f} s  ({total / base:.3f} x question 1)  cache_n {r['cached']}")


if __name__ == "__main__":
    main()
