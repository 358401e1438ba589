"""Peak resident memory of `dantinox generate` (prompt and chat) and `dantinox serve` on a run, against what the
run must hold: its weights (bytes of the parameter arrays as stored) and its KV cache (generate: the static
cache of one sequence at max_context; serve: the paged pool its start-up line reports).

    python benchmarks/bench_memory.py --run_dir /tmp/smol-q41 [--max-running 2] [--skip-serve] [--skip-generate]
           [--serve-args "--max-loaded-programs 3"]

Each command runs in its own process; its peak is the kernel's accounting of that process (``ru_maxrss`` from
``wait4`` for generate, ``VmHWM`` from /proc for serve), which counts mapped file pages too. serve answers while
its warm-up still compiles in the background, so its peak is read twice: after one answered request, and once
``GET /ready`` says the warm-up is done (every program loaded; the figure the target is held to). The target
(issue 23, item 5): peak at most 2 x (weights + KV), and below 1 GiB for a Q4_1 run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

DANTINOX = [sys.executable, "-m", "dantinox.cli"]
MIB = 2**20


def weights_and_cache_bytes(run_dir: str) -> tuple[int, int]:
    """(weight bytes as stored, bytes of one max_context static cache) of the run."""
    from dantinox.budget.memory import kv_cache_bytes
    from dantinox.runs.run_dir import load_run
    import jax

    model, cfg, _, _ = load_run(run_dir)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model) if hasattr(x, "nbytes"))
    return weights, kv_cache_bytes(cfg, 1, cfg.max_context)


def _child_peak_mib() -> float:
    """ru_maxrss of the children is the largest child so far; each command runs in a fresh wrapper process
    (see ``main``), so this is that command's own peak."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def measure_generate(run_dir: str, chat: bool, tokens: int) -> tuple[float, float]:
    """Peak MiB and wall s of generate on a fresh process (this script re-run with --one)."""
    mode = "chat" if chat else "prompt"
    out = subprocess.run([sys.executable, __file__, "--one", mode, "--run_dir", run_dir, "--tokens", str(tokens)],
                         capture_output=True, text=True, check=True)
    peak, wall = json.loads(out.stdout.strip().splitlines()[-1])
    return peak, wall


def one(mode: str, run_dir: str, tokens: int) -> None:
    """Run one generate command as a child and print [peak MiB, wall s] (the only child of this process)."""
    flag = ["--chat", "What is the capital of France? Answer in one sentence."] if mode == "chat" else [
        "--prompt", "The capital of France is"]
    start = time.perf_counter()
    subprocess.run(DANTINOX + ["generate", "--run_dir", run_dir, *flag, "--max_new_tokens", str(tokens)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    print(json.dumps([_child_peak_mib(), time.perf_counter() - start]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_mib(pid: int) -> float:
    """The process's VmHWM (peak resident size) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _wait_ready(port: int, proc: subprocess.Popen, deadline: float) -> None:
    """Poll GET /ready until it answers 200 (the warm-up is done). RuntimeError if serve exits or the
    deadline (perf_counter seconds) passes first."""
    while proc.poll() is None and time.perf_counter() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=60):
                return
        except OSError:   # 503 while warming up (HTTPError is an OSError)
            time.sleep(1.0)
    raise RuntimeError("serve's warm-up did not finish")


def measure_serve(run_dir: str, max_running: int, tokens: int, timeout: float = 1800,
                  extra: tuple = ()) -> tuple[float, float, int, float, float]:
    """(peak MiB after one answered request, peak MiB once the warm-up is done, KV pool bytes from the start-up
    line, seconds to the answer, seconds to ready)."""
    port = _free_port()
    log = open(f"/tmp/bench_memory_serve_{port}.log", "w+")
    proc = subprocess.Popen(DANTINOX + ["serve", "--run_dir", run_dir, "--port", str(port),
                                        "--max-running", str(max_running), *extra], stdout=log,
                            stderr=subprocess.STDOUT)
    start, body = time.perf_counter(), json.dumps({"prompt": "The capital of France is", "max_tokens": tokens})
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - start > timeout:
                log.seek(0)
                raise RuntimeError(f"serve did not answer: {log.read()[-2000:]}")
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    json.load(r)
                break
            except OSError:
                time.sleep(1.0)
        answered, peak = time.perf_counter() - start, _peak_mib(proc.pid)
        _wait_ready(port, proc, start + timeout)
        ready, warm_peak = time.perf_counter() - start, _peak_mib(proc.pid)
        log.seek(0)
        found = re.search(r"KV cache: .*?= (\d+) bytes", log.read())
        return peak, warm_peak, int(found.group(1)) if found else 0, answered, ready
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", required=True)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--max-running", type=int, default=1, help="serve's --max-running (sizes its pool)")
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--serve-args", default="", help="more serve flags, e.g. '--max-loaded-programs 3'")
    p.add_argument("--one", choices=["prompt", "chat"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args.one, args.run_dir, args.tokens)
        return
    weights, cache = weights_and_cache_bytes(args.run_dir)
    print(f"run {args.run_dir}: weights {weights / MIB:.1f} MiB, one max_context cache {cache / MIB:.1f} MiB; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| command | weights MiB | KV MiB | peak MiB | peak / (weights + KV) | wall s |")
    print("|---|---|---|---|---|---|")
    for chat in () if args.skip_generate else (False, True):
        peak, wall = measure_generate(args.run_dir, chat, args.tokens)
        name = "generate --chat" if chat else "generate --prompt"
        print(f"| {name} | {weights / MIB:.1f} | {cache / MIB:.1f} | {peak:.0f} | "
              f"{peak * MIB / (weights + cache):.2f} | {wall:.1f} |", flush=True)
    if not args.skip_serve:
        extra = tuple(shlex.split(args.serve_args))
        peak, warm_peak, pool, wall, ready = measure_serve(args.run_dir, args.max_running, args.tokens, extra=extra)
        name = " ".join(["serve --max-running", str(args.max_running), *extra])
        for what, mib, seconds in (("one request", peak, wall), ("warm-up done", warm_peak, ready)):
            print(f"| {name} ({what}) | {weights / MIB:.1f} | {pool / MIB:.1f} | {mib:.0f} | "
                  f"{mib * MIB / (weights + pool):.2f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
