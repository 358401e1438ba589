"""Served n-gram speculation against plain serving on SmolLM2-135M-Instruct, in one process (issue 20).

    python benchmarks/serve_speculative.py [--rounds 3] [--new-tokens 200] [--concurrency 1 4]
           [--spec-tokens 4] [--ngram-max 4] [--task repeat|chat] [--verify-cost C] [--gguf FILE] [--json OUT]

The model is imported as benchmarks/bench_speculative.py imports it (float32, max_context 1024) and served by
the in-process PagedEngine (block size 16, prefix caching off so every round prefills, multi-step decoding on,
the default 8 steps), once plain and once with ``EngineConfig.speculative = SpecConfig(k)``. The prompt is
input-grounded: "Repeat this passage: <400 tokens of ../shared/data/tinyshakespeare.txt>" in the model's chat
template, so the answer copies the prompt and prompt lookup finds what comes next. --concurrency C sends C such
requests at once (each its own passage), greedy, at most --new-tokens tokens each, stopping at the model's stop
ids; the speculative run is checked to give the plain run's tokens. --task chat sends a free question instead
(bench_speculative's CHAT prompt: nothing to copy, the case where speculation costs). Without --verify-cost
the engine measures a verify call's cost in plain steps itself (``dantinox.serving.verify_cost``) and its
switch-off rule stops speculating where it loses; --verify-cost C gives the cost by hand instead
(``SpecConfig.verify_costs``, serve's --spec-verify-cost).

Per (C, mode), medians over rounds in which the modes alternate (plain first in even rounds): served tokens/s
(generated tokens over the wall time from submitting to the last completion, prefill included) and decode
tokens/s (tokens after each request's first, over the time from the last first token to the last completion),
and for the speculative mode the acceptance (accepted / proposed) and verify calls. One untimed round per mode
first compiles what the timed rounds run. Numbers from a shared CPU host are noisy: quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speculative import CHAT, DATA, default_gguf, load  # noqa: E402

PASSAGE_TOKENS = 400
REPEAT = "Repeat this passage exactly, word for word:\n\n{passage}"


def passages(gen, count: int) -> list[list[int]]:
    """``count`` chat prompts "Repeat this passage ..." over distinct PASSAGE_TOKENS-token passages of DATA."""
    with open(DATA, encoding="utf-8") as f:
        text = f.read()
    out = []
    for i in range(count):
        piece = text[20000 + 30000 * i: 40000 + 30000 * i]
        passage = gen.tokenizer.decode(gen.tokenizer.encode(piece)[:PASSAGE_TOKENS])
        passage = passage[passage.index("\n\n") + 2:] if "\n\n" in passage[:400] else passage
        out.append(gen.chat_prompt_ids(REPEAT.format(passage=passage.strip())))
    return out


def serve_once(engine, prompts: list, n: int, stop_ids) -> dict:
    """Submit every prompt at once, step until done. Returns the figures and tokens of one run."""
    from dantinox.serving import SamplingOptions

    before = dict(engine.stats())
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingOptions(max_new_tokens=n, stop_token_ids=tuple(stop_ids))) for p in prompts]
    tokens = {rid: [] for rid in ids}
    first = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                first.setdefault(out.request_id, time.perf_counter())
                tokens[out.request_id] += out.new_token_ids
    end = time.perf_counter()
    total = sum(map(len, tokens.values()))
    stats = engine.stats()
    return dict(served=total / (end - start), decode=(total - len(ids)) / max(end - max(first.values()), 1e-9),
                tokens=[tokens[r] for r in ids],
                proposed=stats["spec_proposed_tokens"] - before["spec_proposed_tokens"],
                accepted=stats["spec_accepted_tokens"] - before["spec_accepted_tokens"],
                verify_calls=stats["spec_verify_calls"] - before["spec_verify_calls"])


def measured_cost(engine, rows: int) -> float:
    """The engine's measured c(B) for ``rows`` decode rows (``VerifyCostMeter``; 1.0 while unmeasured)."""
    from dantinox.serving.step_plan import bucket

    return engine.verify_meter.cost(bucket(min(rows, engine.decode_buckets[-1]), engine.decode_buckets))


def measure(gen, concurrency: int, args) -> list[dict]:
    """Rows for one concurrency: plain and speculative, alternating timed rounds."""
    from dantinox.serving import EngineConfig, PagedEngine
    from dantinox.serving.speculation import SpecConfig

    prompts = passages(gen, concurrency) if args.task == "repeat" else [gen.chat_prompt_ids(CHAT)] * concurrency
    base = dict(block_size=16, max_running=max(concurrency, 1), max_batched_tokens=256,
                enable_prefix_caching=False)
    costs = ((1, args.verify_cost),) if args.verify_cost else ()
    spec = SpecConfig(spec_tokens=args.spec_tokens, ngram_max=args.ngram_max, verify_costs=costs)
    engines = {"plain": PagedEngine(gen.model, EngineConfig(**base)),
               "speculative": PagedEngine(gen.model, EngineConfig(**base, speculative=spec))}
    stop = list(gen.stop_ids)
    reference = {}
    for m, engine in engines.items():   # compiles what the timed rounds run
        start = time.perf_counter()
        reference[m] = serve_once(engine, prompts, args.new_tokens, stop)
        print(f"C={concurrency} {m}: untimed round {time.perf_counter() - start:.0f} s", flush=True)
    assert reference["speculative"]["tokens"] == reference["plain"]["tokens"], "speculative tokens differ"
    runs = {m: [] for m in engines}
    for r in range(args.rounds):
        for m in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            runs[m].append(serve_once(engines[m], prompts, args.new_tokens, stop))
            print(f"C={concurrency} {m} round {r}: {runs[m][-1]['served']:.1f} served tok/s, "
                  f"{runs[m][-1]['decode']:.1f} decode tok/s", flush=True)
    rows = []
    for m, results in runs.items():
        row = dict(concurrency=concurrency, mode=m, tokens=sum(map(len, results[0]["tokens"])),
                   served_tok_s=statistics.median(x["served"] for x in results),
                   decode_tok_s=statistics.median(x["decode"] for x in results))
        if m == "speculative":
            row.update(proposed=results[0]["proposed"], accepted=results[0]["accepted"],
                       verify_calls=results[0]["verify_calls"], verify_cost=measured_cost(engines[m], concurrency))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--task", choices=("repeat", "chat"), default="repeat")
    parser.add_argument("--verify-cost", type=float, default=None)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gen = load(args.gguf or default_gguf(), os.path.join(tmp, "smollm2"))
        rows = [row for c in args.concurrency for row in measure(gen, c, args)]
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; k={args.spec_tokens}, "
          f"n-gram {args.ngram_max}..1, {args.new_tokens} new tokens, task {args.task}, medians of {args.rounds} "
          "rounds")
    print(f"{'C':>3} {'mode':<12} {'tokens':>6} {'served tok/s':>12} {'decode tok/s':>12}  acceptance")
    plain = {}
    for row in rows:
        extra = ""
        if row["mode"] == "plain":
            plain[row["concurrency"]] = row
        else:
            ref = plain[row["concurrency"]]
            rate = row["accepted"] / row["proposed"] if row["proposed"] else 0.0
            extra = (f"{row['accepted']}/{row['proposed']} ({100 * rate:.0f}%), {row['verify_calls']} verify calls, "
                     f"c = {row['verify_cost']:.2f}; "
                     f"x{row['served_tok_s'] / ref['served_tok_s']:.2f} served, "
                     f"x{row['decode_tok_s'] / ref['decode_tok_s']:.2f} decode")
        print(f"{row['concurrency']:>3} {row['mode']:<12} {row['tokens']:>6} {row['served_tok_s']:>12.1f} "
              f"{row['decode_tok_s']:>12.1f}  {extra}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
