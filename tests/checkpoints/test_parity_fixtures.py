"""Parity with transformers: each tiny checkpoint of tests/fixtures/parity/ (made by
tools/make_parity_fixtures.py with torch + transformers; no torch here) is imported with ``dantinox import``
and must give transformers' float32 logits at every position (max |diff| <= 1e-4), the same 20 greedy tokens,
and cached logits equal to uncached ones (dantinox verify)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from paths import FIXTURES

from dantinox import generate_result, verify_cache
from dantinox.cli.entrypoint import main
from dantinox.runs.run_dir import load_run

FIXTURES = os.path.join(FIXTURES, "parity")
pytestmark = pytest.mark.slow   # imports and verifies every parity checkpoint
NAMES = sorted(n for n in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, n, "reference.json")))
TOLERANCE = 1e-4


def imported(name: str, tmp_path):
    out = tmp_path / name
    assert main(["import", os.path.join(FIXTURES, name), "--out", str(out)]) == 0
    model, cfg, tokenizer, summary = load_run(out)
    with open(os.path.join(FIXTURES, name, "reference.json")) as f:
        ref = json.load(f)
    ref_logits = np.load(os.path.join(FIXTURES, name, "reference_logits.npy"))
    return out, model, ref, ref_logits


@pytest.mark.parametrize("name", NAMES)
def test_logits_tokens_and_cache_match_transformers(name, tmp_path):
    out, model, ref, ref_logits = imported(name, tmp_path)
    ids = ref["prompt_ids"] + ref["greedy_tokens"][:-1]
    logits = np.asarray(model(jnp.asarray([ids], jnp.int32))[0][0])
    diff = np.abs(logits - ref_logits).max(axis=-1)
    assert diff.max() <= TOLERANCE, f"{name}: max |logit diff| {diff.max():.2e} at position {diff.argmax()}"
    result = generate_result(model, [ref["prompt_ids"]], len(ref["greedy_tokens"]))
    assert result.tokens[0].tolist() == ref["greedy_tokens"]
    report = verify_cache(model, ref["prompt_ids"], len(ref["greedy_tokens"]), tolerance=TOLERANCE)
    assert report.passed, f"{name}: cached vs uncached max diff {report.max_diff.max():.2e}"
    assert report.tokens == ref["greedy_tokens"]


def test_fixtures_cover_every_architecture():
    archs = set()
    for name in NAMES:
        with open(os.path.join(FIXTURES, name, "reference.json")) as f:
            archs.add(json.load(f)["architecture"])
    assert archs == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForCausalLM"}


def test_generator_loads_an_imported_run(tmp_path):
    """``dx.Generator("runs/NAME")`` works as for a trained run: text in, transformers' greedy text out."""
    from dantinox import Generator

    out, _, ref, _ = imported("mistral", tmp_path)
    gen = Generator(out)
    assert gen.encode(ref["prompt"]) == ref["prompt_ids"]
    text = gen.generate(ref["prompt"], max_new_tokens=len(ref["greedy_tokens"]), temperature=0.0)
    assert text == gen.tokenizer.decode(ref["greedy_tokens"])
