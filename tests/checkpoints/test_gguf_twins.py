"""Every Llama-family parity fixture through its GGUF twin (``gguf_twin.write_gguf_twin``: written at test time
with the gguf package's GGUFWriter as llama.cpp's converter would write the same model), in the default tier:

- float32 twins (architectures llama, qwen2, qwen3, and phi3 written from the llama and mistral fixtures with
  fused q | k | v and gate | up) imported with ``dantinox import FILE.gguf`` give transformers' stored float32
  logits at every position (max |diff| <= 1e-4, as the parity tests require of the Hugging Face directories) and
  the same ModelConfig as the fixture's Hugging Face directory;
- block twins (a format per fixture: Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL, Q4_1; matrices whose input width does not
  divide 32 stay F32, as llama.cpp's quantizer leaves them) imported with their blocks kept give the logits of
  the same file imported with ``--dtype float32`` (dequantized by the gguf package): the kernel and the
  architecture's weight layout (Qwen2's biases beside q / k / v blocks, Phi-3's fused blocks) change nothing.
The DeepSeek fixtures have no GGUF twin: GGUF's ``deepseek2`` architecture is not read."""

from __future__ import annotations

import json
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf_twin import write_gguf_twin
from paths import FIXTURES

from dantinox.cli.entrypoint import main
from dantinox.runs.run_dir import load_run

Q = gguf.GGMLQuantizationType
PARITY = os.path.join(FIXTURES, "parity")
TOLERANCE = 1e-4
# (fixture, written as phi3, block format of the block twin, the transformers class the import must report)
TWINS = [("llama", False, Q.Q8_0, "LlamaForCausalLM"), ("llama3", False, Q.Q4_0, "LlamaForCausalLM"),
         ("mistral", False, Q.Q5_0, "MistralForCausalLM"), ("qwen2", False, Q.Q5_1, "Qwen2ForCausalLM"),
         ("qwen3", False, Q.IQ4_NL, "Qwen3ForCausalLM"), ("llama", True, Q.Q4_1, "Phi3ForCausalLM"),
         ("mistral", True, Q.Q8_0, "Phi3ForCausalLM")]
IDS = [f"{name}{'-as-phi3' if phi3 else ''}" for name, phi3, _, _ in TWINS]


def reference(name: str):
    with open(os.path.join(PARITY, name, "reference.json")) as f:
        ref = json.load(f)
    return ref, np.load(os.path.join(PARITY, name, "reference_logits.npy"))


def imported(source, out, *flags):
    assert main(["import", str(source), "--out", str(out), *flags]) == 0
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "model_summary.json")) as f:
        summary = json.load(f)
    return load_run(out)[0], config, summary


def logits(model, ids):
    return np.asarray(model(jnp.asarray([ids], jnp.int32))[0][0])


@pytest.mark.parametrize("name, phi3, _fmt, architecture", TWINS, ids=IDS)
def test_float_twin_gives_transformers_logits_and_the_hf_config(name, phi3, _fmt, architecture, tmp_path, capsys):
    path = tmp_path / "twin.gguf"
    write_gguf_twin(os.path.join(PARITY, name), path, phi3=phi3)
    model, config, summary = imported(path, tmp_path / "gguf")
    _, hf_config, _ = imported(os.path.join(PARITY, name), tmp_path / "hf")
    assert summary["architecture"] == architecture and summary["weight_format"] == "float32"
    assert config == hf_config
    ref, ref_logits = reference(name)
    got = logits(model, ref["prompt_ids"] + ref["greedy_tokens"][:-1])
    diff = np.abs(got - ref_logits).max(axis=-1)
    assert diff.max() <= TOLERANCE, f"max |logit diff| {diff.max():.2e} at position {diff.argmax()}"
    prompt = len(ref["prompt_ids"])
    assert got[prompt - 1:].argmax(-1).tolist() == ref["greedy_tokens"]   # the greedy continuation


@pytest.mark.parametrize("name, phi3, fmt, architecture", TWINS, ids=IDS)
def test_block_twin_gives_the_dequantized_logits(name, phi3, fmt, architecture, tmp_path, capsys):
    path = tmp_path / "twin.gguf"
    write_gguf_twin(os.path.join(PARITY, name), path, qtypes=lambda _: fmt, phi3=phi3)
    assert os.path.getsize(path) < 300_000
    blocks, _, summary = imported(path, tmp_path / "blocks")
    floats, _, _ = imported(path, tmp_path / "floats", "--dtype", "float32")
    assert summary["architecture"] == architecture and summary["weight_format"] == f"GGUF blocks {fmt.name}"
    ref, _ = reference(name)
    ids = ref["prompt_ids"] + ref["greedy_tokens"][:-1]
    want = logits(floats, ids)
    assert np.abs(logits(blocks, ids) - want).max() <= 1e-5 * np.abs(want).max()
