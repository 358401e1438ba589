"""The bundled Divina Commedia model: loads as package data, generates Dante-like text, its cache is exact,
and its recorded held-out loss meets the issue's aim (<= 1.6 nats per character)."""

import json
import os

import pytest

from dantinox.cli import entrypoint as cli
from dantinox.generation.generator import Generator
from dantinox.quality.verify import verify_cache
from dantinox.runs.bundled import bundled_run_dir


@pytest.fixture(scope="module")
def gen():
    return Generator(warmup=False)   # compiles what the tests use (warmup: test_generator_warmup.py, the CLI test)


def test_bundled_run_directory_is_complete_and_small():
    run = bundled_run_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "model_summary.json", "training_log.csv"):
        assert os.path.isfile(os.path.join(run, name)), name
    size = sum(os.path.getsize(os.path.join(run, f)) for f in os.listdir(run))
    assert size <= 8 * 1024 * 1024
    summary = json.load(open(os.path.join(run, "model_summary.json")))
    assert summary["val_nats_per_char"] <= 1.6


def test_bundled_model_writes_italian_verse(gen):
    text = gen.generate("Nel mezzo del cammin", 150, seed=1)
    words = text.split()
    assert len(words) > 15
    common = {"e", "che", "di", "la", "il", "per", "non", "a", "in", "si", "mi", "sí", "lo", "io", "l'", "del"}
    assert sum(w.strip(",.;:!?«»") in common for w in words) >= 3, text
    assert "\n" in text  # verse lines
    assert gen.generate("Nel mezzo del cammin", 60, temperature=0) == gen.generate(
        "Nel mezzo del cammin", 60, temperature=0, use_cache=False)


def test_bundled_model_cache_is_exact(gen):
    report = verify_cache(gen.model, gen.encode("Nel mezzo del cammin di nostra vita"), 120)
    assert report.passed, report.max_diff.max()


def test_cli_generate_uses_the_bundled_model(capsys):
    assert cli.main(["generate", "--prompt", "Nel mezzo del cammin", "--max_new_tokens", "40"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Nel mezzo del cammin") and len(out.out) > 40
    assert "bundled" in out.err
