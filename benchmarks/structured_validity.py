"""How often SmolLM2-135M-Instruct's constrained outputs are valid, and constrained against free tokens/s
(issue 21's "50 on SmolLM2").

    python benchmarks/structured_validity.py --run_dir runs/smollm2 [--n 56] [--batch 8] [--max-tokens 256]

For each case of CASES (five JSON schemas: nested objects, arrays with bounds, enums, numbers with ranges,
optional fields; a regex; a Lark grammar) the script asks the model for the output through its chat template
with a realistic request (one of the case's prompts per row, cycled), --n generations in batches of --batch
rows through ``constrained_decode.constrained_result`` (one compiled step for every case), sampling at
temperature 1 with a seed per batch. Every output is checked by an independent reference: ``jsonschema``
validation of ``json.loads`` of the text, Python's ``re.fullmatch`` of the regex, and for the grammar a regex
written by hand for the same language (REFERENCE_RE) plus Python's ``eval`` of the arithmetic. A row cut by
--max-tokens (finish "length") counts as not valid.

Prints a markdown table: per case n, valid, finished ("stop") / cut ("length"), median tokens, tokens/s
(generated tokens over the wall time of the case's batches, prefill included, compilation not); then the
end-to-end tokens/s of the free compiled loop (``generate_result``, stopping at the stop ids) against the
constrained loop on the same prompts (the nested-objects prompts) with the same max tokens, in alternating
rounds in one process. --speculative adds greedy constrained decoding with and without n-gram speculation
(``constrained_speculative``), B = 1, the same prompts, in turns.
The model runs with a static cache of --context slots (as benchmarks/structured_mask.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dantinox

import jax  # noqa: E402
import jsonschema  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "address"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "address": {"type": "object", "additionalProperties": False,
                                     "required": ["street", "city", "zip"],
                                     "properties": {"street": {"type": "string", "maxLength": 40},
                                                    "city": {"type": "string", "minLength": 1, "maxLength": 20},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
RECIPE = {"type": "object", "additionalProperties": False, "required": ["dish", "ingredients", "minutes"],
          "properties": {"dish": {"type": "string", "maxLength": 30},
                         "ingredients": {"type": "array", "minItems": 2, "maxItems": 5,
                                         "items": {"type": "string", "maxLength": 20}},
                         "minutes": {"type": "array", "minItems": 1, "maxItems": 3,
                                     "items": {"type": "integer", "minimum": 1, "maximum": 240}}}}
REVIEW = {"type": "object", "additionalProperties": False, "required": ["sentiment", "topic", "stars"],
          "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                         "topic": {"type": "string", "enum": ["food", "service", "price", "place"]},
                         "stars": {"enum": [1, 2, 3, 4, 5]}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "celsius", "humidity", "wind"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "celsius": {"type": "number", "minimum": -40, "maximum": 50},
                          "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                          "wind": {"type": "number", "exclusiveMinimum": 0, "maximum": 200, "multipleOf": 0.5}}}
CONTACT = {"type": "object", "additionalProperties": False, "required": ["name"],
           "properties": {"name": {"type": "string", "maxLength": 30},
                          "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,12}\\.(com|org|it)$"},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "vip": {"type": "boolean"}}}
DATE = r"(1[0-9]|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
LARK = r'''
start: sum
sum: term (" + " term)~0..3
term: NUMBER | "(" product ")"
product: NUMBER (" * " NUMBER)~1..2
NUMBER: /[1-9][0-9]{0,2}/
'''
_NUMBER = r"[1-9][0-9]{0,2}"
_TERM = rf"(?:{_NUMBER}|\({_NUMBER}(?: \* {_NUMBER}){{1,2}}\))"
REFERENCE_RE = rf"{_TERM}(?: \+ {_TERM}){{0,3}}"   # LARK's language, written by hand


def _json(ask, things):
    return [f"{ask.format(t)} Answer with a JSON object only." for t in things]


# name: (constraint argument, its value, prompts, checker of the text)
CASES = {
    "nested objects": ("json_schema", PERSON, _json(
        "Invent a person who lives in {}: their name and postal address (street, city, zip).",
        ["Florence", "Boston", "Lyon", "Munich", "Osaka", "Toronto", "Madrid", "Cairo"]), None),
    "arrays with bounds": ("json_schema", RECIPE, _json(
        "Give me a short recipe for {}: the dish, its ingredients and the minutes each step takes.",
        ["pancakes", "risotto", "guacamole", "tomato soup", "omelette", "pesto pasta", "hummus", "fried rice"]),
        None),
    "enums": ("json_schema", REVIEW, _json(
        "Classify this restaurant review by sentiment, topic and stars: \"{}\"",
        ["The pasta was wonderful.", "Way too expensive for what you get.", "The waiter ignored us for an hour.",
         "Nice view over the river.", "Cold soup and rude staff.", "Fair prices, average food.",
         "Best pizza in town!", "The room was noisy but the service was quick."]), None),
    "numbers with ranges": ("json_schema", WEATHER, _json(
        "Report today's weather in {}: the city, temperature in Celsius, humidity in percent and wind in km/h.",
        ["Rome", "Oslo", "Dubai", "Seattle", "Lima", "Sydney", "Nairobi", "Reykjavik"]), None),
    "optional fields": ("json_schema", CONTACT, _json(
        "Make a contact card for {}, with an e-mail address and age if you know them.",
        ["my dentist", "a new colleague", "Dante Alighieri", "a plumber", "my aunt Maria", "a famous chef",
         "the school principal", "a taxi driver"]), None),
    "regex (date)": ("regex", DATE, [
        f"On what date did {e}? Answer with the date only, as YYYY-MM-DD." for e in
        ["the first Moon landing happen", "the Berlin Wall fall", "World War II end in Europe",
         "the Titanic sink", "the French Revolution begin", "Italy become a republic",
         "the first iPhone go on sale", "the Euro banknotes enter circulation"]], "regex"),
    "grammar (Lark arithmetic)": ("grammar", LARK, [
        f"Write an arithmetic expression with + and * that equals {n}. Answer with the expression only."
        for n in (10, 24, 42, 7, 100, 56, 15, 81)], "grammar"),
}


def is_valid(case: str, text: str, finish: str) -> bool:
    """The independent check of one output (module docstring); a row cut by max tokens is not valid."""
    kind, value, _, _ = CASES[case]
    if finish != "stop":
        return False
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "grammar":
        return re.fullmatch(REFERENCE_RE, text) is not None and isinstance(eval(text, {"__builtins__": {}}), int)
    try:
        jsonschema.validate(json.loads(text), value)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def load(run_dir: str, context: int):
    """(Generator, model with a ``context``-slot static cache) of ``run_dir``."""
    from dantinox.generation.generator import Generator
    from dantinox.model.transformer import Transformer

    gen = Generator(run_dir, warmup=False)
    model = gen.model
    if gen.cfg.max_context != context:
        model = Transformer(gen.cfg.replace(max_context=context), rngs=nnx.Rngs(0))
        nnx.update(model, nnx.state(gen.model, nnx.Param))
    return gen, model


def prompt_batches(gen, prompts, n: int, B: int) -> list[list[list[int]]]:
    """ceil(n / B) batches of B chat-prompt id lists, the prompts cycled."""
    ids = [gen.chat_prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    rows = [ids[i % len(ids)] for i in range(-(-n // B) * B)]
    return [rows[i:i + B] for i in range(0, len(rows), B)]


def run_case(gen, model, case: str, n: int, B: int, max_tokens: int) -> dict:
    """Generate n outputs of one case (batches of B); returns its row of the table and the texts."""
    from dantinox.generation.constrained_decode import constrained_result

    kind, value, prompts, _ = CASES[case]
    constraint = gen.constraint(**{kind: value})
    stops = list(gen.stop_ids)
    texts, finishes, lengths, seconds = [], [], [], 0.0
    batches = prompt_batches(gen, prompts, n, B)
    constrained_result(model, batches[0], [constraint] * B, 2, eos_id=stops)  # compiles this prompt bucket
    for seed, batch in enumerate(batches):
        start = time.perf_counter()
        result = constrained_result(model, batch, [constraint] * B, max_tokens, temperature=1.0, seed=seed,
                                    eos_id=stops)
        seconds += time.perf_counter() - start
        for row, length, reason in zip(result.tokens, result.lengths, result.finish_reasons):
            shown = int(length) - (reason == "stop" and int(row[int(length) - 1]) in stops)
            texts.append(gen.tokenizer.decode(row[:shown].tolist()))
            finishes.append(reason)
            lengths.append(int(length))
    texts, finishes, lengths = texts[:n], finishes[:n], lengths[:n]
    valid = [is_valid(case, t, f) for t, f in zip(texts, finishes)]
    return {"n": n, "valid": sum(valid), "stop": finishes.count("stop"), "length": finishes.count("length"),
            "median_tokens": statistics.median(lengths), "tok_s": sum(lengths) / seconds,
            "bad": [t for t, ok in zip(texts, valid) if not ok], "sample": texts[0]}


def free_vs_constrained(gen, model, B: int, max_tokens: int, rounds: int) -> dict:
    """tokens/s of the free compiled loop and the constrained loop on the nested-objects prompts (B rows, the
    same max tokens, both stopping at the stop ids), best of ``rounds`` rounds taken in turns."""
    from dantinox.generation.constrained_decode import constrained_result
    from dantinox.generation.decode import generate_result

    kind, value, prompts, _ = CASES["nested objects"]
    constraint, stops = gen.constraint(**{kind: value}), list(gen.stop_ids)
    batch = prompt_batches(gen, prompts, B, B)[0]
    kinds = {"free": lambda: generate_result(model, batch, max_tokens, temperature=1.0, seed=0, eos_id=stops),
             "constrained": lambda: constrained_result(model, batch, [constraint] * B, max_tokens, temperature=1.0,
                                                       seed=0, eos_id=stops)}
    for fn in kinds.values():
        fn()  # compile
    best, tokens = dict.fromkeys(kinds, float("inf")), {}
    for _ in range(rounds):
        for name, fn in kinds.items():
            start = time.perf_counter()
            result = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            tokens[name] = int(np.sum(result.lengths))
    return {name: (tokens[name], tokens[name] / best[name]) for name in kinds}


def speculative_vs_plain(gen, model, max_tokens: int, rounds: int) -> dict:
    """Greedy constrained decoding with and without n-gram speculation (k = 4) on each nested-objects prompt
    at B = 1, in turns: {"plain" | "ngram": (tokens, tokens/s)}, "same": whether every text is the same, and
    the speculative SpecStats summed over the prompts."""
    from dantinox.generation.constrained_decode import constrained_result
    from dantinox.generation.constrained_speculative import constrained_speculative_result
    from dantinox.generation.speculative_generate import SpecSettings

    kind, value, prompts, _ = CASES["nested objects"]
    constraint, stops = gen.constraint(**{kind: value}), list(gen.stop_ids)
    batches = prompt_batches(gen, prompts, len(prompts), 1)
    kinds = {"plain": lambda ids: constrained_result(model, ids, [constraint], max_tokens, eos_id=stops),
             "ngram": lambda ids: constrained_speculative_result(model, ids, [constraint], max_tokens,
                                                                 settings=SpecSettings(), eos_id=stops)[0]}
    for fn in kinds.values():
        fn(batches[0])  # compile
    seconds, tokens, texts = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0), {name: [] for name in kinds}
    for _ in range(rounds):
        for ids in batches:
            for name, fn in kinds.items():
                start = time.perf_counter()
                result = fn(ids)
                seconds[name] += time.perf_counter() - start
                tokens[name] += int(result.lengths[0])
                texts[name].append(result.tokens[0, :result.lengths[0]].tolist())
    out = {name: (tokens[name] // rounds, tokens[name] / seconds[name]) for name in kinds}
    out["same"] = texts["plain"] == texts["ngram"]
    _, out["stats"] = constrained_speculative_result(model, batches[0], [constraint], max_tokens, eos_id=stops)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run_dir", default="runs/smollm2")
    parser.add_argument("--n", type=int, default=56, help="generations per case")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of free against constrained")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--speculative", action="store_true",
                        help="also time greedy constrained decoding with n-gram speculation against without")
    args = parser.parse_args()
    from structured_mask import ensure_run_dir

    ensure_run_dir(args.run_dir)
    gen, model = load(args.run_dir, args.context)
    print(f"SmolLM2-135M-Instruct, context {args.context}, B = {args.batch}, max tokens {args.max_tokens}, "
          f"temperature 1, {jax.devices()[0]}, load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| case | n | valid | finished / cut | median tokens | tokens/s |\n|---|---|---|---|---|---|", flush=True)
    for case in args.cases:
        row = run_case(gen, model, case, args.n, args.batch, args.max_tokens)
        print(f"| {case} | {row['n']} | {row['valid']} | {row['stop']} / {row['length']} | "
              f"{row['median_tokens']:.0f} | {row['tok_s']:.1f} |", flush=True)
        print(f"  sample: {row['sample'][:120]!r}; not valid: {[t[:80] for t in row['bad'][:3]]}", flush=True)
    e2e = free_vs_constrained(gen, model, args.batch, args.max_tokens, args.rounds)
    print(f"end to end, nested-objects prompts, B = {args.batch}: free {e2e['free'][1]:.1f} tok/s "
          f"({e2e['free'][0]} tokens), constrained {e2e['constrained'][1]:.1f} tok/s ({e2e['constrained'][0]} "
          f"tokens), ratio {e2e['constrained'][1] / e2e['free'][1]:.2f}; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    if args.speculative:
        spec = speculative_vs_plain(gen, model, args.max_tokens, args.rounds)
        stats = spec["stats"]
        print(f"greedy, B = 1, nested-objects prompts: constrained {spec['plain'][1]:.1f} tok/s, with "
              f"speculative ngram {spec['ngram'][1]:.1f} tok/s ({spec['plain'][0]} tokens a round), same texts: "
              f"{spec['same']}; prompt 0: {sum(stats.accepted)} of {sum(stats.proposed)} proposals accepted in "
              f"{stats.verify_calls} verify calls; load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
