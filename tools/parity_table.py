"""Print the parity table of docs/real-models.md: each fixture of tests/fixtures/parity/ imported with
``dantinox import`` and compared with transformers' recorded float32 logits (no torch needed).

    python tools/parity_table.py [--fixtures tests/fixtures/parity]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np

from dantinox import generate_result, verify_cache
from dantinox.cli import main as cli_main
from dantinox.train.run_dir import load_run


def row(fixtures: str, name: str, scratch: str) -> str:
    out = os.path.join(scratch, name)
    if cli_main(["import", os.path.join(fixtures, name), "--out", out]) != 0:
        return f"| {name} | import failed | | | | |"
    model = load_run(out)[0]
    with open(os.path.join(fixtures, name, "reference.json")) as f:
        ref = json.load(f)
    ids = ref["prompt_ids"] + ref["greedy_tokens"][:-1]
    logits = np.asarray(model(jnp.asarray([ids], jnp.int32))[0][0])
    diff = np.abs(logits - np.load(os.path.join(fixtures, name, "reference_logits.npy"))).max()
    greedy = generate_result(model, [ref["prompt_ids"]], len(ref["greedy_tokens"])).tokens[0].tolist()
    same = sum(a == b for a, b in zip(greedy, ref["greedy_tokens"]))
    report = verify_cache(model, ref["prompt_ids"], len(ref["greedy_tokens"]))
    return (f"| {name} | {ref['architecture']} | {ref['features']} | {diff:.1e} | {same}/{len(greedy)} | "
            f"{report.max_diff.max():.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", default=os.path.join("tests", "fixtures", "parity"))
    args = parser.parse_args()
    names = sorted(n for n in os.listdir(args.fixtures)
                   if os.path.isfile(os.path.join(args.fixtures, n, "reference.json")))
    lines = ["| fixture | architecture | what it exercises | max \\|logit diff\\| vs transformers | greedy tokens "
             "equal | max \\|cached - uncached\\| |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        lines += [row(args.fixtures, name, scratch) for name in names]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
