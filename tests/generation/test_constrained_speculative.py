"""Speculative decoding under a grammar (issue 21 item 4): on a tiny model with random weights, greedy
speculation with a JSON schema, a regex or a grammar gives ``constrained_result``'s tokens, token for token,
also next to an unconstrained row, while proposals are verified and accepted; sampled speculation stays valid
(checked with ``jsonschema``); the draft cuts a proposal at the first token the grammar forbids, writes each
position's mask as a fresh matcher would and rolls the matcher back (default tier: host only, no compile);
``accept_proposals``'s limit accepts no proposal past it; ``Generator`` and
``dantinox generate --speculative ngram --json-schema F`` take the two together."""

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from chat_util import TEXT, chat_tokenizer, save_tiny_chat_run
from cli_util import run_main

from dantinox.generation.constrained_decode import ConstrainedRows, constrained_result
from dantinox.generation.constrained_speculative import _draft, constrained_speculative_result
from dantinox.generation.generator import Generator
from dantinox.generation.grammar import grammar_vocabulary, regex_constraint
from dantinox.generation.sampling import make_sampling_params
from dantinox.generation.speculative import accept_proposals
from dantinox.generation.speculative_generate import SpecSettings, SpecStats

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "string", "maxLength": 12},
                         "b": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 6}}}
REGEX = r"([a-z]{1,3} ){2,8}[0-9]{2}"
LARK = 'start: ("la " | "via " | "selva ")~2..12 "ok"'
SETTINGS = SpecSettings(spec_tokens=3, ngram_max=3)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return Generator(save_tiny_chat_run(tmp_path_factory.mktemp("spec") / "run", max_context=128), warmup=False)


@pytest.mark.slow   # compiles the verify step: about 4 s on the shared 2-core host, over the default tier's 2 s
def test_greedy_speculation_under_a_grammar_equals_constrained_greedy(gen):
    ids = [gen.encode(TEXT[:30]), gen.encode(TEXT[10:50])]
    schema, regex, grammar = (gen.constraint(**{k: v}) for k, v in
                              (("json_schema", SCHEMA), ("regex", REGEX), ("grammar", LARK)))
    for constraints in ([schema, None], [regex, grammar]):   # a free row next to a constrained one, two grammars
        plain = constrained_result(gen.model, ids, constraints, 60, eos_id=list(gen.stop_ids))
        spec, stats = constrained_speculative_result(gen.model, ids, constraints, 60, settings=SETTINGS,
                                                     eos_id=list(gen.stop_ids))
        np.testing.assert_array_equal(spec.tokens, plain.tokens)
        np.testing.assert_array_equal(spec.lengths, plain.lengths)
        assert spec.finish_reasons == plain.finish_reasons
        assert stats.verify_calls > 0 and sum(stats.accepted) > 0 and stats.iterations < int(plain.lengths.max())


@pytest.mark.slow   # 8 sampled rows
def test_sampled_speculation_under_a_schema_is_valid(gen):
    constraint = gen.constraint(json_schema=SCHEMA)
    ids = [gen.encode(TEXT[:30])] * 8
    result, stats = constrained_speculative_result(gen.model, ids, [constraint] * 8, 60, settings=SETTINGS,
                                                   temperature=1.0, seed=5, eos_id=list(gen.stop_ids))
    assert stats.verify_calls > 0
    for row, n, reason in zip(result.tokens, result.lengths, result.finish_reasons):
        assert reason == "stop"
        text = gen.tokenizer.decode([t for t in row[:n].tolist() if t not in gen.stop_ids])
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.slow   # one compile, about 3 s on the shared host
def test_accept_proposals_accepts_nothing_past_its_limit():
    logits = jax.random.normal(jax.random.key(0), (3, 4, 11))
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)     # proposals the greedy rule accepts in full
    limit = jnp.array([0, 2, 3], jnp.int32)
    sampling = make_sampling_params(3, [0.0, 0.0, 1.0])      # rows 0 and 1 greedy, row 2 sampled
    tokens, accepted = jax.jit(accept_proposals)(logits, best[:, :3], jax.random.key(1), sampling, limit)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert accepted.tolist()[:2] == [0, 2] and accepted[2] <= 3
    for b in (0, 1):   # the accepted proposals, then the argmax at the limit
        np.testing.assert_array_equal(tokens[b, :limit[b] + 1], best[b, :limit[b] + 1])


def test_draft_cuts_the_proposal_at_the_first_forbidden_token_and_leaves_the_matcher_as_it_was():
    tokenizer = chat_tokenizer()
    stop = tokenizer.hf.token_to_id("<|im_end|>")
    constraint = regex_constraint("(la|via|selva)( (la|via|selva)){0,5}", grammar_vocabulary(tokenizer, (stop,)))
    rows = ConstrainedRows([constraint, None], (stop,), tokenizer.vocab_size, 10, stop)
    prefix, good = tokenizer.encode("la"), tokenizer.encode(" via selva")
    rows.matchers[0] = constraint.matcher(prefix)   # row 0 has written "la"
    rows.refresh(0)
    before = rows.mask[0].copy()
    proposals = good + tokenizer.encode("xyz") + good
    k = len(proposals)
    masks = np.zeros((2, k + 1, rows.mask.shape[1]), np.int32)
    assert _draft(rows, 0, proposals, masks[0]) == len(good)
    assert _draft(rows, 1, proposals, masks[1]) == k and np.all(masks[1] == -1)    # a free row keeps all k
    assert rows.matchers[0].consumed == len(prefix)                                 # rolled back
    np.testing.assert_array_equal(rows.matchers[0].mask(), before)
    for j in range(len(good) + 1):   # position j's mask: a fresh matcher's after the same tokens
        np.testing.assert_array_equal(masks[0, j], constraint.matcher(prefix + good[:j]).mask())
    assert _draft(rows, 0, good[:3] + [stop] + good, masks[1]) == 3    # the target may end the row, not a draft
    assert rows.matchers[0].advance(good[0])   # the matcher goes on from where it was


@pytest.mark.slow   # a CLI run on the bundled model and the switch-off measurement
def test_generator_and_cli_speculate_under_a_schema(gen, tmp_path, capsys):
    plain = gen.complete(TEXT[:30], 60, temperature=0, json_schema=SCHEMA)
    spec = gen.complete(TEXT[:30], 60, temperature=0, json_schema=SCHEMA, speculative="ngram", spec_tokens=3)
    assert spec[:3] == plain[:3] and isinstance(spec.spec, SpecStats) and gen.spec_stats is spec.spec
    jsonschema.validate(json.loads(spec.text), SCHEMA)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    outs = []
    for extra in ([], ["--speculative", "ngram", "--spec-tokens", "3"]):
        status, out, err = run_main(["generate", "--prompt", "Nel mezzo", "--max_new_tokens", "40", "--temperature",
                                     "0", "--json-schema", str(schema), *extra], capsys)
        assert status == 0, err
        outs.append(out)
    assert outs[0] == outs[1] and "proposed tokens accepted" in err, err
    jsonschema.validate(json.loads(outs[1][len("Nel mezzo"):]), SCHEMA)
