"""dantinox serve against llama.cpp's llama-server: the same seeded text workloads, one server at a time.

Each server is started in a child process on 127.0.0.1, waited for until ready (dantinox: GET /ready; llama-server:
GET /health), sent one short untimed request, then every workload in turn (each after the server is idle again),
and stopped before the other one starts. The servers mirror each other:
  dantinox serve --run_dir RUN --max-running N [--dantinox-args ...]
  llama-server -m GGUF -t T -tb T -np N -c N*CONTEXT [--llamacpp-args ...]
N is --max-running (both run N sequences at once), CONTEXT the run's max_context (each llama-server slot gets
-c / -np tokens), T is --threads; GGUF defaults to the file the run directory was imported from. How to build
llama-server and what makes the comparison fair: the llama.cpp section of the peers notes (greedy, explicit
max_tokens with ignore_eos, no prompt-cache hits, one server at a time, nothing else on the cores).

Workloads (benchmarks/text_workloads.py; text prompts, cut to their lengths by the run's tokenizer.json, each
starting with its own random digits so that no prompt-cache hit is possible):
  single-L    --single-repeats prompts of L tokens (--single-lengths, default 128 1024 4096) sent one after
              another, --single-new tokens each: the time to first token of a prompt alone (median of repeats);
  trace-R     --requests requests with Poisson arrivals at R per second (--rates, default 0.15 0.3: a light rate
              and one near llama-server's capacity on 2 cores), prompt lengths from --bands (default 70 % 64-256,
              20 % 512-1,024, 10 % 2,048-4,096 tokens), --new-tokens (default 32 64 128) new tokens, open loop.
Timing is client-side (benchmarks/stream_client.py): TTFT, TPOT = (end - first token) / (tokens - 1), and output
tokens/s = completed tokens / the workload's wall time. Also recorded: each server's seconds from start to ready,
its peak resident memory (the process tree, sampled every 0.25 s; needs psutil), the prompt and cached token
counts each server reports, and whether the two servers' greedy texts agree.

Output: a markdown table on stdout (each figure for both servers and the ratio dantinox / llama-server; below
1 is faster for latencies, above 1 for throughput) and --out, a JSON file with every request's timings (each
streamed chunk's arrival), the summaries, the exact commands and the host. Server logs go beside --out.
--only runs one server; --llamacpp-from takes llama-server's results from an earlier --out made with the same
workload flags (refused otherwise), to compare dantinox settings without rerunning llama-server.

Run (minutes to hours: on a quiet host only):
  python benchmarks/serve_vs_llamacpp.py --run-dir runs/smollm2 --llama-server PATH/llama-server --out vs.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time

import httpx
from serve_common import pct
from server_process import ServerProcess, free_port
from stream_client import run_workload, stream_one
from text_workloads import (DEFAULT_BANDS, PromptCutter, TextRequest, Workload, parse_bands, single_workload,
                            trace_workload)

SERVERS = {"dantinox": "dantinox serve", "llamacpp": "llama-server"}
BUNDLED_SLICES = os.path.join(os.path.dirname(__file__), "..", "dantinox", "bundled", "slices")
DEFAULT_CORPUS = [os.path.join(BUNDLED_SLICES, f) for f in ("en-shakespeare.txt", "it-heldout.txt")]
RESERVED_DANTINOX_FLAGS = ("--run_dir", "--host", "--port", "--max-running")
RESERVED_LLAMACPP_FLAGS = ("-m", "--model", "--host", "--port", "-np", "--parallel", "-c", "--ctx-size")
IDLE_TIMEOUT_S = 600.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--run-dir", required=True, help="dantinox run directory (e.g. from dantinox import FILE.gguf)")
    p.add_argument("--llama-server", help="path of the llama-server binary (needed unless --only dantinox)")
    p.add_argument("--gguf", help="model file for llama-server (default: the file the run was imported from)")
    p.add_argument("--max-running", type=int, default=4, help="sequences at once: dantinox --max-running, "
                   "llama-server -np (default 4)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t and -tb (default 2)")
    p.add_argument("--only", choices=tuple(SERVERS), help="run one server only")
    p.add_argument("--dantinox-args", default="", help="more dantinox serve flags, one string "
                   "written with '=' (e.g. --dantinox-args='--max-batched-tokens 256')")
    p.add_argument("--llamacpp-args", default="", help="more llama-server flags, one string "
                   "written with '='")
    p.add_argument("--llamacpp-from", metavar="JSON", help="llama-server's results from an earlier --out")
    p.add_argument("--single-lengths", type=int, nargs="*", default=[128, 1024, 4096], metavar="L")
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--single-new", type=int, default=32, help="max_tokens of the single prompts (default 32)")
    p.add_argument("--requests", type=int, default=40, help="requests per trace (default 40)")
    p.add_argument("--rates", type=float, nargs="*", default=[0.15, 0.3], metavar="R", help="requests/s per trace")
    p.add_argument("--bands", default=DEFAULT_BANDS, help=f"prompt-length bands WEIGHT:LO-HI,... "
                   f"(default {DEFAULT_BANDS})")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[32, 64, 128], metavar="K",
                   help="max_tokens of trace requests, drawn uniformly (default 32 64 128)")
    p.add_argument("--corpus", action="append", metavar="FILE", help="text the prompts are cut from (repeatable; "
                   "default: the bundled en-shakespeare and it-heldout slices)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="serve_vs_llamacpp.json", help="the JSON file of results")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds a request may wait between "
                   "bytes (default 1800)")
    p.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds a server may take to be ready")
    return p.parse_args(argv)


def check_args(args) -> None:
    """Refuse flag values that cannot make a fair run, naming the flag (ValueError)."""
    for flag, value in (("--max-running", args.max_running), ("--threads", args.threads),
                        ("--single-repeats", args.single_repeats), ("--single-new", args.single_new),
                        ("--requests", args.requests)):
        if value < 1:
            raise ValueError(f"{flag} {value} is not allowed: an integer >= 1")
    for flag, values in (("--single-lengths", args.single_lengths), ("--new-tokens", args.new_tokens),
                         ("--rates", args.rates)):
        if any(v <= 0 for v in values):
            raise ValueError(f"{flag} {values} is not allowed: every value must be > 0")
    for flag, text, reserved in (("--dantinox-args", args.dantinox_args, RESERVED_DANTINOX_FLAGS),
                                 ("--llamacpp-args", args.llamacpp_args, RESERVED_LLAMACPP_FLAGS)):
        taken = [w.split("=")[0] for w in shlex.split(text) if w.split("=")[0] in reserved]
        if taken:
            raise ValueError(f"{flag} {text!r} sets {', '.join(taken)}, which the benchmark sets itself "
                             f"(use --max-running, --gguf or --run-dir)")
    if args.only != "dantinox" and not args.llamacpp_from:
        if not args.llama_server or not os.access(args.llama_server, os.X_OK):
            raise ValueError(f"--llama-server {args.llama_server!r} is not an executable file; give the path of "
                             f"llama-server, or --only dantinox")


def run_info(run_dir: str) -> dict:
    """The run directory's max_context, tokenizer.json path and imported GGUF path (None if not from one)."""
    if not os.path.isfile(os.path.join(run_dir, "config.json")):
        raise ValueError(f"--run-dir {run_dir!r} has no config.json: not a dantinox run directory")
    with open(os.path.join(run_dir, "config.json")) as f:
        context = json.load(f)["max_context"]
    source = None
    summary = os.path.join(run_dir, "model_summary.json")
    if os.path.isfile(summary):
        with open(summary) as f:
            source = json.load(f).get("imported_from")
    return dict(context=context, tokenizer=os.path.join(run_dir, "tokenizer.json"), gguf=source)


def build_workloads(args, info: dict) -> list:
    """The run's workloads: single prompts, then the traces; each request fits the run's context (ValueError
    naming the flags otherwise)."""
    from tokenizers import Tokenizer

    corpus = "\n".join(open(path, encoding="utf-8").read() for path in (args.corpus or DEFAULT_CORPUS))
    cutter = PromptCutter(Tokenizer.from_file(info["tokenizer"]), corpus)
    workloads = [single_workload(cutter, n, args.single_repeats, args.single_new, args.seed)
                 for n in args.single_lengths]
    bands = parse_bands(args.bands)
    workloads += [trace_workload(cutter, args.requests, rate, bands, tuple(args.new_tokens), args.seed)
                  for rate in args.rates]
    longest = max((r.prompt_tokens + r.max_tokens for w in workloads for r in w.requests), default=0)
    if longest > info["context"]:
        raise ValueError(f"a request of {longest} tokens (prompt + max_tokens) does not fit the run's context of "
                         f"{info['context']}: lower --single-lengths, --bands, --single-new or --new-tokens")
    return workloads


def workload_json(w: Workload) -> dict:
    """A workload as the results file keeps it: every request's name, arrival, text and token counts."""
    return dict(name=w.name, kind=w.kind, requests=[dict(name=r.name, arrival_s=r.arrival_s, text=r.text,
                                                         prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens)
                                                    for r in w.requests])


def fingerprint(workloads: list) -> str:
    """sha256 of every request's name, arrival, text and max_tokens: equal fingerprints, equal workloads."""
    digest = hashlib.sha256()
    for w in workloads:
        for r in w.requests:
            digest.update(json.dumps([r.name, round(r.arrival_s, 6), r.text, r.max_tokens]).encode("utf-8"))
    return digest.hexdigest()


def server_command(name: str, args, info: dict, port: int) -> tuple[list, str]:
    """(argv, readiness path) of one server on 127.0.0.1:port."""
    if name == "dantinox":
        argv = [sys.executable, "-m", "dantinox.cli", "serve", "--run_dir", args.run_dir, "--host", "127.0.0.1",
                "--port", str(port), "--max-running", str(args.max_running)] + shlex.split(args.dantinox_args)
        return argv, "/ready"
    gguf = args.gguf or info["gguf"]
    if not gguf or not os.path.isfile(gguf):
        raise ValueError(f"--gguf {gguf!r} is not a file; give llama-server's model file with --gguf")
    n, t = args.max_running, str(args.threads)
    argv = [args.llama_server, "-m", gguf, "-t", t, "-tb", t, "-np", str(n), "-c", str(n * info["context"]),
            "--host", "127.0.0.1", "--port", str(port)] + shlex.split(args.llamacpp_args)
    return argv, "/health"


def wait_idle(name: str, url: str, timeout_s: float = IDLE_TIMEOUT_S) -> bool:
    """Wait until the server runs no request (dantinox: /health's engine counts; llama-server: no slot
    processing in /slots). True once idle; False after ``timeout_s`` or when the server cannot say."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            try:
                if name == "dantinox":
                    engine = client.get(url + "/health").json()["engine"]
                    busy = engine["running"] + engine["waiting"] > 0
                else:
                    reply = client.get(url + "/slots")
                    if reply.status_code != 200:
                        return False
                    busy = any(slot.get("is_processing") for slot in reply.json())
            except (httpx.HTTPError, KeyError, ValueError):
                return False
            if not busy:
                return True
            time.sleep(0.5)
    return False


async def warm_up(url: str, timeout_s: float) -> dict:
    """One short untimed request (4 tokens after a 4-word prompt): a server's first request may pay one-off
    costs (first allocations, lazily loaded programs) that no workload should."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        request = TextRequest("warm-up", 0.0, "Once upon a time", 0, 4)
        return await stream_one(client, url + "/v1/completions", request, time.perf_counter())


def run_server(name: str, args, info: dict, workloads: list) -> dict:
    """Start one server, run every workload against it, stop it. Returns its section of the results."""
    port = free_port()
    argv, ready_path = server_command(name, args, info, port)
    url = f"http://127.0.0.1:{port}"
    log = os.path.splitext(args.out)[0] + f".{name}.log"
    print(f"# {SERVERS[name]}: {shlex.join(argv)}", file=sys.stderr, flush=True)
    section = dict(command=shlex.join(argv), log=log, workloads={})
    with ServerProcess(argv, url, ready_path, log).start(args.ready_timeout) as server:
        section.update(listening_s=server.listening_s, ready_s=server.ready_s)
        section["warm_up"] = asyncio.run(warm_up(url, args.request_timeout))
        for w in workloads:
            idle = wait_idle(name, url)
            records, wall = asyncio.run(run_workload(url + "/v1/completions", w, args.request_timeout))
            section["workloads"][w.name] = dict(kind=w.kind, idle_before=idle, wall_s=wall, requests=records,
                                                summary=summarize(records, wall))
            print(f"# {SERVERS[name]} {w.name}: {section['workloads'][w.name]['summary']}", file=sys.stderr,
                  flush=True)
    section["peak_rss_bytes"] = server.peak_rss_bytes
    return section


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def summarize(records: list, wall_s: float) -> dict:
    """Figures of one workload on one server over its complete requests (status 200, all max_tokens tokens):
    TTFT and TPOT p50 / p99 (seconds; a single workload's p50 is its median), output tokens/s over ``wall_s``,
    and the counts of the checks: requests, complete, server-counted prompt tokens minus the reference count
    (mean), prompt tokens served from a prefix cache (sum)."""
    done = [r for r in records if r["complete"]]
    ttft = [r["ttft_s"] for r in done]
    tpot = [r["tpot_s"] for r in done if r["tpot_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in done)
    seen = [r["prompt_tokens"] - r["ref_prompt_tokens"] for r in records if r.get("prompt_tokens") is not None]
    return {k: _finite(v) for k, v in dict(
        requests=len(records), complete=len(done), ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
        tpot_p50_s=pct(tpot, 50), tpot_p99_s=pct(tpot, 99),
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else None,
        prompt_tokens_vs_reference=sum(seen) / len(seen) if seen else None,
        cached_tokens=sum(r.get("cached_tokens") or 0 for r in records)).items()}


ROWS = {"single": [("TTFT median, s", "ttft_p50_s", 1.0), ("TPOT median, ms", "tpot_p50_s", 1e3)],
        "trace": [("TTFT p50, s", "ttft_p50_s", 1.0), ("TTFT p99, s", "ttft_p99_s", 1.0),
                  ("TPOT p50, ms", "tpot_p50_s", 1e3), ("TPOT p99, ms", "tpot_p99_s", 1e3),
                  ("output tokens/s", "output_tokens_per_s", 1.0)]}


def _cell(value, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    value *= scale
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b not in (None, 0) else "-"


def table(servers: dict, workloads: list) -> str:
    """The markdown table of ``servers`` ({"dantinox": section, "llamacpp": section}, either may be missing):
    one row per workload and figure, then start-up and memory; the last column dantinox / llama-server."""
    ours, theirs = servers.get("dantinox") or {}, servers.get("llamacpp") or {}
    lines = ["| workload | figure | dantinox serve | llama-server | dantinox / llama-server |", "|---|---|---|---|---|"]

    def row(label: str, figure: str, a, b, scale: float = 1.0, ratio: bool = True) -> None:
        lines.append(f"| {label} | {figure} | {_cell(a, scale)} | {_cell(b, scale)} | "
                     f"{_ratio(a, b) if ratio else ''} |")

    for w in workloads:
        sums = [s["workloads"][w.name]["summary"] if w.name in s.get("workloads", {}) else {} for s in (ours, theirs)]
        lengths = sorted(r.prompt_tokens for r in w.requests)
        label = f"{w.name} ({len(w.requests)} req, prompts {lengths[0]}-{lengths[-1]} tok)"
        for figure, key, scale in ROWS[w.kind]:
            row(label, figure, sums[0].get(key), sums[1].get(key), scale)
            label = ""
        lines.append(f"|  | complete | {sums[0].get('complete', '-')}/{len(w.requests)} | "
                     f"{sums[1].get('complete', '-')}/{len(w.requests)} | |")
    row("server", "start to ready, s", ours.get("ready_s"), theirs.get("ready_s"))
    row("", "peak RSS, MiB", ours.get("peak_rss_bytes"), theirs.get("peak_rss_bytes"), 2.0 ** -20)
    return "\n".join(lines)


def checks(servers: dict, workloads: list) -> list:
    """Lines under the table: prompt token counts against the reference, prefix-cache reuse, and how many
    complete requests gave the same text on both servers."""
    out = []
    for name, section in servers.items():
        sums = [w["summary"] for w in section["workloads"].values()]
        diffs = [s["prompt_tokens_vs_reference"] for s in sums if s["prompt_tokens_vs_reference"] is not None]
        out.append(f"- {SERVERS[name]}: prompt tokens as the server counted them minus the reference tokenizer's: "
                   f"{', '.join(f'{x:+.1f}' for x in diffs) or '-'} (mean per workload); prompt tokens served "
                   f"from its prefix cache: {sum(s['cached_tokens'] for s in sums)}")
    if len(servers) == 2:
        same = total = 0
        for w in workloads:
            pairs = zip(*(servers[n]["workloads"][w.name]["requests"] for n in SERVERS))
            for a, b in pairs:
                if a["complete"] and b["complete"]:
                    total, same = total + 1, same + (a["text"] == b["text"])
        out.append(f"- identical greedy texts on both servers: {same} of {total} requests complete on both")
    return out


def host_info() -> dict:
    """CPU model, cores, load average and OS of this host, for the results file."""
    model = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return dict(cpu=model, cores=os.cpu_count(), load_average=os.getloadavg(), platform=platform.platform(),
                python=sys.version.split()[0])


def version_of(argv0: str) -> str:
    """The first line of ``argv0 --version`` (llama-server prints its build there), or ''."""
    try:
        done = subprocess.run([argv0, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [x for x in (done.stdout + done.stderr).splitlines() if "version" in x]
    return lines[0].strip() if lines else ""


def reuse_llamacpp(path: str, sha: str) -> dict:
    """llama-server's section of an earlier results file, if it was made with the same workloads (ValueError
    naming --llamacpp-from otherwise)."""
    with open(path) as f:
        earlier = json.load(f)
    if "llamacpp" not in earlier.get("servers", {}):
        raise ValueError(f"--llamacpp-from {path}: the file has no llama-server results")
    if earlier.get("workloads_sha256") != sha:
        raise ValueError(f"--llamacpp-from {path}: its workloads differ from this run's (seed, lengths, rates, "
                         f"bands, corpus or tokenizer); run with the same workload flags")
    return earlier["servers"]["llamacpp"]


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        info = run_info(args.run_dir)
        workloads = build_workloads(args, info)
        sha = fingerprint(workloads)
        servers = {"llamacpp": reuse_llamacpp(args.llamacpp_from, sha)} if args.llamacpp_from else {}
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   host=host_info(), argv=[sys.argv[0], *(sys.argv[1:] if argv is None else argv)],
                   workloads_sha256=sha, workloads=[workload_json(w) for w in workloads], servers=servers)
    if args.llama_server:
        results["llama_server_version"] = version_of(args.llama_server)
    for name in [n for n in SERVERS if args.only in (None, n) and n not in servers]:
        servers[name] = run_server(name, args, info, workloads)
        write_json(args.out, results)  # kept after each server, in case the next one fails
    results["servers"] = servers = {n: servers[n] for n in SERVERS if n in servers}
    write_json(args.out, results)
    print(table(servers, workloads))
    print("\n".join(["", *checks(servers, workloads), "", "Commands:",
                     *(f"    {servers[n]['command']}" for n in servers)]))
    print(f"\nHost: {results['host']['cpu']}, {results['host']['cores']} cores, load average at start "
          f"{results['host']['load_average'][0]:.2f}; every request's timings: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
