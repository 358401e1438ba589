"""Masked-diffusion decoding speed: no cache vs DualCache (both refresh policies) vs threshold parallel decoding.

    python benchmarks/bench_diffusion.py [--run_dir R] [--gen_len 256] [--block_size 32] [--threshold 0.9 0.7]
                                         [--prompt_lens 16 64 128]

On the bundled diffusion model (dantinox/bundled/dante-diffusion) by default. Prints, for one prompt from the
held-out text (the last 10% of the corpus) of each length in --prompt_lens (one table per length: the
no-cache forward spans prompt + gen_len slots while a cached step spans block_size, so the ratio grows with
the prompt), greedy decoding tokens/s of each method as a ratio to the no-cache run (best of --repeats timed
runs after a warm-up, so compilation is excluded), the model forwards run (gen_len / forwards = tokens
committed per forward), and the fraction of its tokens equal to the no-cache output. Then, on --prompts
held-out prompts of the first length decoded as one batch (rows equal their batch-1 runs,
tests/generation/test_diffusion.py), how often the final tokens differ from the no-cache run under each refresh policy,
reported and not asserted (--prompts 0 skips it).

The bundled model has max_context 256, so a prompt plus gen_len 256 does not fit: the benchmark raises
max_context to prompt_slots + gen_len at load time (the weights do not depend on it; positions past 255 were
never seen in training, which affects the text, not the speed comparison).
Methods: LLaDA (Nie et al. 2025) low-confidence remasking; Fast-dLLM (Wu et al. 2025) DualCache (section 3.2)
and threshold parallel decoding (section 3.3).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dantinox.generation.diffusion import diffusion_generate_result  # noqa: E402
from dantinox.generation.prompts import bucket_length  # noqa: E402
from dantinox.model.transformer import Transformer  # noqa: E402
from dantinox.runs.bundled import bundled_run_dir  # noqa: E402
from dantinox.runs.run_dir import load_run  # noqa: E402
from dantinox.train.data import read_text, split_text  # noqa: E402

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "divina_commedia.txt")


def load(run_dir: str, context: int):
    """The run's model rebuilt with max_context = context (same weights), and its tokenizer."""
    from flax import nnx

    model, cfg, tokenizer, _ = load_run(run_dir)
    if context > cfg.max_context:
        wide = Transformer(cfg.replace(max_context=context), rngs=nnx.Rngs(0))
        nnx.update(wide, nnx.state(model, nnx.Param))
        model = wide
    return model, tokenizer


def held_out_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens at evenly spaced offsets of the held-out text (last 10% of characters)."""
    ids = tokenizer.encode(split_text(read_text(CORPUS), 0.1)[1])
    starts = np.linspace(0, len(ids) - length - 1, n).astype(int)
    return [list(ids[s:s + length]) for s in starts]


def timed(model, prompt, repeats: int, **kw):
    """(best seconds, DiffusionResult) over `repeats` runs after one warm-up."""
    result = diffusion_generate_result(model, prompt, **kw)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = diffusion_generate_result(model, prompt, **kw)
        best = min(best, time.perf_counter() - t0)
    return best, result


def speed_table(model, prompt, args) -> None:
    base = dict(gen_len=args.gen_len, block_size=args.block_size, steps_per_block=args.block_size)
    methods = [("no cache", dict(use_cache=False)),
               ("DualCache refresh=block", dict(refresh="block")),
               ("DualCache refresh=prompt_once", dict(refresh="prompt_once"))]
    for t in args.threshold:
        methods += [(f"parallel (threshold {t}), no cache", dict(use_cache=False, threshold=t)),
                    (f"DualCache block + parallel {t}", dict(refresh="block", threshold=t)),
                    (f"DualCache prompt_once + parallel {t}", dict(refresh="prompt_once", threshold=t))]
    print(f"gen_len {args.gen_len}, block_size {args.block_size}, prompt {len(prompt[0])} tokens, batch 1, "
          f"greedy; best of {args.repeats}")
    print(f"{'method':<44} {'tok/s':>8} {'x no cache':>10} {'forwards':>8} {'agreement':>9}")
    ref_tokens, ref_rate = None, None
    for name, kw in methods:
        seconds, result = timed(model, prompt, args.repeats, **base, **kw)
        rate = args.gen_len / seconds
        if ref_tokens is None:
            ref_tokens, ref_rate = result.tokens, rate
        agree = float(np.mean(result.tokens == ref_tokens))
        print(f"{name:<44} {rate:>8.1f} {rate / ref_rate:>9.2f}x {result.forward_calls:>8} {agree:>9.3f}")


def staleness_report(model, prompts, args) -> None:
    kw = dict(gen_len=args.gen_len, block_size=args.block_size, steps_per_block=args.block_size)
    ref = diffusion_generate_result(model, prompts, **kw, use_cache=False).tokens
    print(f"\n{len(prompts)} held-out prompts of {len(prompts[0])} tokens, batched, fixed schedule "
          f"(1 token per step), vs no cache:")
    print(f"{'refresh policy':<16} {'prompts differing':>18} {'token agreement':>16}")
    for refresh in ("block", "prompt_once"):
        out = diffusion_generate_result(model, prompts, **kw, refresh=refresh).tokens
        differ = int(np.sum(np.any(out != ref, axis=1)))
        print(f"{refresh:<16} {differ:>11} of {len(prompts):<4} {float(np.mean(out == ref)):>16.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", default=bundled_run_dir("dante-diffusion"))
    p.add_argument("--gen_len", type=int, default=256)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--threshold", type=float, nargs="+", default=[0.9], metavar="T",
                   help="confidence thresholds for parallel decoding, three rows each")
    p.add_argument("--prompt_lens", type=int, nargs="+", default=[16], metavar="N",
                   help="prompt lengths in tokens, one speed table each")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    longest = max(bucket_length(n, 1 << 20) for n in args.prompt_lens)
    model, tokenizer = load(args.run_dir, longest + args.gen_len)
    for n, length in enumerate(args.prompt_lens):
        if n:
            print()
        speed_table(model, held_out_prompts(tokenizer, 1, length), args)
    if args.prompts > 0:
        staleness_report(model, held_out_prompts(tokenizer, args.prompts, args.prompt_lens[0]), args)


if __name__ == "__main__":
    main()
