"""Cold versus warm process start of `dantinox generate` on the bundled model.

Each run is a fresh process. "cold" uses an empty persistent XLA compilation cache (DANTINOX_XLA_CACHE points
at a new temporary directory), "warm" reuses the directory the cold run filled, so every compilation becomes
a cache load. Prints wall seconds of the whole command (median of --repeats) and what the command reports
about its own load + warm-up.

Run:  python benchmarks/bench_startup.py [--repeats 3] [--max_new_tokens 100]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def run_once(cache_dir: str, max_new_tokens: int) -> tuple[float, str]:
    """Wall seconds of one `dantinox generate` process and its stderr report line."""
    env = dict(os.environ, DANTINOX_XLA_CACHE=cache_dir)
    cmd = [sys.executable, "-m", "dantinox.cli", "generate", "--prompt", "Nel mezzo del cammin",
           "--max_new_tokens", str(max_new_tokens), "--temperature", "0"]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    report = re.search(r"loaded and warmed up in .*", out.stderr)
    return seconds, report.group(0) if report else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=100)
    args = parser.parse_args()
    cold, warm, reports = [], [], {}
    for _ in range(args.repeats):
        cache_dir = tempfile.mkdtemp(prefix="dantinox-xla-")
        try:
            seconds, reports["cold"] = run_once(cache_dir, args.max_new_tokens)
            cold.append(seconds)
            seconds, reports["warm"] = run_once(cache_dir, args.max_new_tokens)
            warm.append(seconds)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    print("| process start | wall s (median) | min | max | the command's own report |")
    print("|---|---|---|---|---|")
    for name, times in (("cold (empty XLA cache)", cold), ("warm (persistent cache)", warm)):
        key = name.split()[0]
        print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | "
              f"{reports[key]} |")
    print(f"warm / cold: {statistics.median(warm) / statistics.median(cold):.2f}")


if __name__ == "__main__":
    main()
