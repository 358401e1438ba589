"""Print the parity table of docs/how-to/import-models.md: each fixture of tests/fixtures/parity/ imported with
``dantinox import`` and compared with transformers' recorded float32 logits (no torch needed).

    python tools/parity_table.py [--fixtures tests/fixtures/parity]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np

from dantinox import generate_result, verify_cache
from dantinox.cli.entrypoint import main as cli_main
from dantinox.runs.run_dir import load_run


def imported(fixtures: str, name: str, out: str, dtype: str):
    with contextlib.redirect_stdout(io.StringIO()):
        if cli_main(["import", os.path.join(fixtures, name), "--out", out, "--dtype", dtype]) != 0:
            raise SystemExit(f"import of {name} failed")
    return load_run(out)[0]


def row(fixtures: str, name: str, scratch: str) -> str:
    """One table row: float32 max |diff|, greedy agreement, cached vs uncached; bfloat16 max |diff|."""
    with open(os.path.join(fixtures, name, "reference.json")) as f:
        ref = json.load(f)
    ids = jnp.asarray([ref["prompt_ids"] + ref["greedy_tokens"][:-1]], jnp.int32)
    want = np.load(os.path.join(fixtures, name, "reference_logits.npy"))
    model = imported(fixtures, name, os.path.join(scratch, name), "float32")
    diff = np.abs(np.asarray(model(ids)[0][0]) - want).max()
    greedy = generate_result(model, [ref["prompt_ids"]], len(ref["greedy_tokens"])).tokens[0].tolist()
    same = sum(a == b for a, b in zip(greedy, ref["greedy_tokens"]))
    report = verify_cache(model, ref["prompt_ids"], len(ref["greedy_tokens"]))
    bf16 = imported(fixtures, name, os.path.join(scratch, name + "-bf16"), "bfloat16")
    bf16_diff = np.abs(np.asarray(bf16(ids)[0][0]) - want).max()
    return (f"| {name} | {ref['architecture']} | {ref['features']} | {diff:.1e} | {same}/{len(greedy)} | "
            f"{report.max_diff.max():.1e} | {bf16_diff:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", default=os.path.join("tests", "fixtures", "parity"))
    args = parser.parse_args()
    names = sorted(n for n in os.listdir(args.fixtures)
                   if os.path.isfile(os.path.join(args.fixtures, n, "reference.json")))
    lines = ["| fixture | architecture | what it exercises | max \\|logit diff\\| vs transformers (float32) | greedy "
             "tokens equal | max \\|cached - uncached\\| | --dtype bfloat16: max \\|logit diff\\| |",
             "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        lines += [row(args.fixtures, name, scratch) for name in names]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
