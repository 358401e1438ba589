"""Structured outputs in the static path (issue 21): JSON schemas, regexes, grammars and choices through
``Generator.generate`` on a tiny model with random weights (the worst case for validity), every output checked
by an independent reference (``jsonschema``, Python's ``re``, ``ast``); the mask leaves free rows exactly as they
were; the host-stepped loop draws the same tokens as the compiled loop without a constraint; no recompilation
across grammars; bad constraints raise GrammarError naming the argument."""

import ast
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from chat_util import TEXT, chat_tokenizer, save_tiny_chat_run

import dantinox as dx
from dantinox.generation.constrained_decode import constrained_result
from dantinox.generation.generator import Generator
from dantinox.generation.grammar import (GrammarError, all_allowed_mask, choice_constraint, grammar_vocabulary,
                                         json_schema_constraint, mask_words, regex_constraint)
from dantinox.generation.sampling import apply_token_mask

SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6},
                                                  "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}}}},
    "arrays with bounds": {
        "type": "object", "additionalProperties": False, "required": ["tags", "scores"],
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1,
                                "maxItems": 3},
                       "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "minItems": 2, "maxItems": 2}}},
    "enums": {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "level": {"enum": [1, 2, 3, None]}}},
    "numbers with ranges": {
        "type": "object", "additionalProperties": False, "required": ["t", "n", "p"],
        # multipleOf bounds the digits: a random model never ends an unbounded fraction by itself
        "properties": {"t": {"type": "number", "minimum": -10.5, "maximum": 40, "multipleOf": 0.25},
                       "n": {"type": "integer", "minimum": 1, "maximum": 12},
                       "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.125}}},
    "optional fields": {
        "type": "object", "additionalProperties": False, "required": ["id"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 1000},
                       "note": {"type": "string", "maxLength": 6}, "flag": {"type": "boolean"}}},
}
# [0-9], not \d: the grammar engine's \d is Unicode's digits (Rust regex), newer than Python's table
REGEXES = [r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]{0,5})?", r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"]
# A Lark grammar with nesting bounded by its levels; REFERENCE_RE is the same language written by hand.
LARK = r'''
start: sum
sum: term (" + " term)~0..2
term: NUMBER | "(" product ")"
product: NUMBER (" * " NUMBER)~0..2
NUMBER: /[1-9][0-9]{0,2}/
'''
NUMBER = r"[1-9][0-9]{0,2}"
TERM = rf"(?:{NUMBER}|\({NUMBER}(?: \* {NUMBER}){{0,2}}\))"
REFERENCE_RE = rf"{TERM}(?: \+ {TERM}){{0,2}}"
GENERATIONS = 20   # per schema, regex and grammar in the default tier; the slow tier runs 200
MAX_NEW = 96
PROMPT = TEXT[:30]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    run = save_tiny_chat_run(tmp_path_factory.mktemp("structured") / "run", max_context=128)
    return Generator(run, warmup=False)


def _batch(gen, n, seed, **constraint):
    """n sampled completions of PROMPT under one constraint, as one batch (one row per completion)."""
    constraint = gen.constraint(**constraint)
    ids = [gen.encode(PROMPT)] * n
    result = constrained_result(gen.model, ids, [constraint] * n, MAX_NEW, temperature=1.0, seed=seed,
                                eos_id=list(gen.stop_ids))
    texts = []
    for row, length, reason in zip(result.tokens, result.lengths, result.finish_reasons):
        shown = int(length) - (int(row[length - 1]) in gen.stop_ids)
        texts.append((gen.tokenizer.decode(row[:shown].tolist()), reason))
    return texts


def check_json(gen, n: int, seed: int = 0):
    for name, schema in SCHEMAS.items():
        for text, reason in _batch(gen, n, seed, json_schema=schema):
            assert reason == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)


def check_regex_and_grammar(gen, n: int, seed: int = 0):
    for pattern in REGEXES:
        for text, reason in _batch(gen, n, seed, regex=pattern):
            assert reason == "stop" and re.fullmatch(pattern, text), (pattern, text)
    for text, reason in _batch(gen, n, seed, grammar=LARK):
        assert reason == "stop" and re.fullmatch(REFERENCE_RE, text), text
        ast.parse(text, mode="eval")  # and it is an arithmetic expression


def test_json_schemas_always_valid(gen):
    check_json(gen, GENERATIONS)


def test_regex_and_grammar_always_match(gen):
    check_regex_and_grammar(gen, GENERATIONS)


@pytest.mark.slow
def test_json_regex_grammar_valid_200_each(gen):
    check_json(gen, 200, seed=1)
    check_regex_and_grammar(gen, 200, seed=1)


def test_generator_api_choice_gbnf_and_compile_count(gen):
    """Generator.generate / complete take json_schema, regex and grammar (Lark or GBNF); after the first
    constrained call at a batch size, other grammars compile nothing."""
    first = gen.complete(PROMPT, MAX_NEW, temperature=0.0, json_schema=SCHEMAS["enums"])
    assert first.finish_reason == "stop"
    jsonschema.validate(json.loads(first.text), SCHEMAS["enums"])
    with dx.CompileCounter() as counted:
        yes_no = gen.generate(PROMPT, 10, temperature=1.0, grammar='root ::= "yes" | "no"')
        date = gen.generate(PROMPT, 20, temperature=0.7, top_p=0.9, seed=3, regex=REGEXES[1])
        nested = gen.complete(PROMPT, MAX_NEW, temperature=1.0, seed=4, json_schema=json.dumps(SCHEMAS["nested "
                                                                                                       "objects"]))
    assert counted.compilations == 0, counted
    assert yes_no in ("yes", "no") and re.fullmatch(REGEXES[1], date)
    jsonschema.validate(json.loads(nested.text), SCHEMAS["nested objects"])


def test_without_constraint_the_host_loop_draws_the_compiled_loops_tokens(gen):
    ids = gen.encode(PROMPT)
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=20, seed=9)):
        want = dx.generate(gen.model, ids, 30, **sampling)
        got = constrained_result(gen.model, ids, [None], 30, **sampling)
        assert got.tokens[0].tolist() == want.tolist()


def test_mask_leaves_free_rows_unchanged_and_masks_the_rest(gen):
    """apply_token_mask against a numpy reference; an all-ones row is returned bit for bit."""
    V = gen.cfg.vocab_size
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, V)).astype(np.float32) * 5
    mask = all_allowed_mask(3, V)
    allowed = rng.random((2, V)) < 0.3
    for b in (1, 2):
        bits = np.zeros(mask_words(V) * 32, np.uint8)
        bits[:V] = allowed[b - 1]
        mask[b] = np.packbits(bits, bitorder="little").view(np.int32)
    out = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
    assert np.array_equal(out[0], logits[0])
    for b in (1, 2):
        assert np.array_equal(out[b], np.where(allowed[b - 1], logits[b], np.float32(-1e30)))


def test_mixed_batch_free_row_equals_its_solo_run(gen):
    """A constrained row and a free row in one batch: the free row draws exactly the tokens it draws alone."""
    ids = [gen.encode(PROMPT), gen.encode(TEXT[5:20])]
    constraint = gen.constraint(json_schema=SCHEMAS["optional fields"])
    mixed = constrained_result(gen.model, ids, [constraint, None], 60, temperature=1.0, seed=2)
    free = dx.generate(gen.model, ids, 60, temperature=1.0, seed=2)
    assert mixed.tokens[1].tolist() == free[1].tolist() and mixed.finish_reasons == ["stop", "length"]
    jsonschema.validate(json.loads(gen.tokenizer.decode(mixed.tokens[0, :mixed.lengths[0]].tolist())),
                        SCHEMAS["optional fields"])


def test_length_cut_leaves_a_valid_prefix(gen):
    text = gen.complete(PROMPT, 3, temperature=1.0, json_schema=SCHEMAS["nested objects"])
    assert text.finish_reason == "length" and text.tokens == 3
    assert text.text.startswith("{") and ('{"name": "'.startswith(text.text) or text.text.startswith('{"name": "'))


def test_choice_matcher_steps_and_ends():
    tokenizer = chat_tokenizer()
    vocabulary = grammar_vocabulary(tokenizer, (261,))
    assert grammar_vocabulary(tokenizer, (261,)) is vocabulary  # built once
    matcher = choice_constraint(["red", "green", "blue"], vocabulary).matcher()
    first = np.unpackbits(matcher.mask().view(np.uint8), bitorder="little")[:tokenizer.vocab_size]
    assert {tokenizer.decode([t])[0] for t in np.flatnonzero(first)} == {"r", "g", "b"}
    for token in tokenizer.encode("red"):
        assert matcher.advance(token)
    assert matcher.accepting and matcher.stopped
    assert np.flatnonzero(np.unpackbits(matcher.mask().view(np.uint8), bitorder="little")).tolist() == [261]
    assert not matcher.ends_here((261,)) and matcher.ends_here(())


def test_run_without_stop_ids_ends_when_the_grammar_is_complete(tmp_path):
    """A run with no stop ids gets a virtual end token V that no row can draw: a finished grammar ends the row."""
    run = save_tiny_chat_run(tmp_path / "plain", template=None, max_context=64)
    plain = Generator(run, warmup=False)
    assert plain.stop_ids == ()
    done = plain.complete(PROMPT, 30, temperature=1.0, regex="(si|no)")
    assert done.finish_reason == "stop" and done.text in ("si", "no") and done.tokens == len(
        plain.encode(done.text))


def test_bad_constraints_name_the_argument(gen):
    vocabulary = grammar_vocabulary(gen.tokenizer, gen.stop_ids)
    cases = [(dict(json_schema={"type": "objectx"}), "json_schema", "invalid json schema"),
             (dict(json_schema="{not json"), "json_schema", "not valid JSON"),
             (dict(json_schema={"type": "array", "uniqueItems": True}), "json_schema", "not supported"),
             (dict(regex="[a-"), "regex", "invalid regex"),
             (dict(grammar="start: undefined_rule"), "grammar", "invalid grammar"),
             (dict(json_schema={"type": "object"}, regex="a"), "regex", "at most one")]
    for kwargs, field, words in cases:
        with pytest.raises(GrammarError, match=words) as err:
            gen.generate(PROMPT, 5, **kwargs)
        assert err.value.field == field
    with pytest.raises(GrammarError, match="non-empty list"):
        choice_constraint([], vocabulary)
    with pytest.raises(ValueError, match="use_cache=False"):
        gen.generate(PROMPT, 5, use_cache=False, regex="a+")
    assert regex_constraint("a+", vocabulary).kind == "regex"
    assert json_schema_constraint(True, vocabulary).kind == "json_schema"

