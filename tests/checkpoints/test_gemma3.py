"""Gemma 3 in the default tier, on the tiny random ``Gemma3ForCausalLM`` of tests/fixtures/parity/gemma3 (made by
tools/make_parity_fixtures.py with transformers; its 43 positions pass the 8-token window of its sliding layer 0,
its layer 1 is global with linear rope scaling and its own base):

- imported with ``dantinox import``, its float32 logits are transformers' at every position (max |diff| <= 1e-4)
  and its greedy tokens transformers' greedy tokens;
- the fixture exercises each Gemma feature: turning any one off in the config moves the logits far past the
  tolerance (so each is computed as transformers computes it, not merely present);
- cached logits equal the uncached forward at every position across the window edge: ``verify_cache`` (prefill
  then decode) and a chunked prefill whose chunks straddle the window edge, for the float32 cache and the
  int8 caches (per-token keys with sinks, per-channel keys in groups of 4), each cache against the uncached
  forward of the same codec;
- the paged pool (what ``serve`` runs) gives the static cache's logits through ragged chunks across the window
  edge, for the same three caches, and the serving engine answers a batch of prompts longer than the window
  with the static greedy tokens;
- its GGUF twin (``gguf_twin.write_gguf_twin``, written as llama.cpp's converter writes a gemma3 file) imports
  to the same ModelConfig except the query scale (GGUF has no key for query_pre_attn_scalar: llama.cpp, and so
  dantinox, takes the head size) and to the same logits as the Hugging Face import given that scale; its Q8_0
  twin with the blocks kept gives the logits of the same file dequantized (``--dtype float32``);
- the transformers 4 spelling of the config (rope_theta, rope_local_base_freq, rope_scaling,
  sliding_window_pattern) maps to the same ModelConfig, Gemma 2's config maps to its fields, and what cannot
  run exactly is refused naming the field;
- the chat template: Gemma's turn format when the checkpoint carries none (one line names it, and
  <end_of_turn> becomes a stop token), ``--chat-template FILE`` for any import, a broken file refused in one
  line.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward, uncached_logits
from gguf_twin import write_gguf_twin
from paths import FIXTURES
from serving_util import chunked_paged_run, drain, greedy, make_engine, solo, static_logits

from dantinox import generate_result, verify_cache
from dantinox.checkpoints.errors import CheckpointError
from dantinox.checkpoints.hf_config import import_spec
from dantinox.cli.entrypoint import main
from dantinox.kv.cache import init_cache
from dantinox.kv.pool import init_pool
from dantinox.quant.kv_dtype import with_config
from dantinox.runs.chat import load_chat_format
from dantinox.runs.run_dir import load_run

FIXTURE = os.path.join(FIXTURES, "parity", "gemma3")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(FIXTURE, "reference.json")) as f:
        ref = json.load(f)
    return ref, np.load(os.path.join(FIXTURE, "reference_logits.npy"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3") / "run"
    assert main(["import", FIXTURE, "--out", str(out)]) == 0
    return out, load_run(out)[0]


def hf_config() -> dict:
    with open(os.path.join(FIXTURE, "config.json")) as f:
        return json.load(f)


def full_logits(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray([ids], jnp.int32))[0][0])


def test_logits_and_greedy_tokens_are_transformers(imported, reference):
    _, model = imported
    ref, ref_logits = reference
    cfg = model.cfg
    assert cfg.sliding_window == 8 and cfg.layer_types == ("sliding_attention", "full_attention")
    assert len(ref["prompt_ids"]) > cfg.sliding_window
    diff = np.abs(full_logits(model, ref["prompt_ids"] + ref["greedy_tokens"][:-1]) - ref_logits).max(axis=-1)
    assert diff.max() <= TOLERANCE, f"max |logit diff| {diff.max():.2e} at position {diff.argmax()}"
    tokens = generate_result(model, [ref["prompt_ids"]], len(ref["greedy_tokens"])).tokens[0].tolist()
    assert tokens == ref["greedy_tokens"]


@pytest.mark.parametrize("change", [dict(embed_scale=None), dict(rope_local_theta=None),
                                    dict(final_logit_softcap=None), dict(mlp_activation="silu"),
                                    dict(attention_scale=None), dict(layer_types=None), dict(rope_scaling=None)],
                         ids=lambda c: next(iter(c)))
def test_each_gemma_feature_moves_the_logits(imported, reference, change):
    _, model = imported
    ref, ref_logits = reference
    ids = ref["prompt_ids"] + ref["greedy_tokens"][:-1]
    changed = with_config(model, model.cfg.replace(**change))
    assert np.abs(full_logits(changed, ids) - ref_logits).max() > 100 * TOLERANCE


def test_gemma_norms_are_stored_as_one_plus_w(imported):
    from safetensors.numpy import load_file

    _, model = imported
    hf = load_file(os.path.join(FIXTURE, "model.safetensors"))
    pairs = {"final_norm": "model.norm", "blocks.1.attn_post_norm": "model.layers.1.post_attention_layernorm",
             "blocks.1.mlp_norm": "model.layers.1.pre_feedforward_layernorm",
             "blocks.0.mlp_post_norm": "model.layers.0.post_feedforward_layernorm",
             "blocks.0.attn.q_norm": "model.layers.0.self_attn.q_norm"}
    for ours, theirs in pairs.items():
        module = model
        for part in ours.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        np.testing.assert_array_equal(np.asarray(module.scale[...]), np.float32(1) + hf[theirs + ".weight"])


CACHES = {"float32": dict(cache_dtype="float32"), "int8-token": dict(cache_dtype="int8", kv_keys="token"),
          "int8-channel": dict(cache_dtype="int8", kv_keys="channel", kv_key_group=4)}


@pytest.mark.parametrize("cache", CACHES)
def test_cached_equals_uncached_across_the_window_edge(imported, reference, cache):
    _, model = imported
    ref, _ = reference
    model = with_config(model, model.cfg.replace(**CACHES[cache]))
    report = verify_cache(model, ref["prompt_ids"], len(ref["greedy_tokens"]), tolerance=TOLERANCE)
    assert report.passed, f"{cache}: max |cached - uncached| {report.max_diff.max():.2e}"
    if cache == "float32":
        assert report.tokens == ref["greedy_tokens"]
    seq = ref["prompt_ids"] + ref["greedy_tokens"][:-1]
    want = uncached_logits(model, [seq])[0, :len(seq)]
    kv, got, at = init_cache(model.cfg, 1), [], 0
    for size in (5, 6, 7, 3, 9, 1, 1, 11):   # chunks crossing slot 8 and later window edges, then decode steps
        logits, kv, _ = forward(model, np.array([seq[at:at + size]]), use_cache=True, kv_caches=kv, cache_index=at)
        got.append(np.asarray(logits[0]))
        at += size
    got = np.concatenate(got)
    assert at == len(seq) and np.abs(got - want).max() <= TOLERANCE, float(np.abs(got - want).max())


@pytest.mark.parametrize("cache", CACHES)
def test_paged_pool_equals_the_static_cache_across_the_window_edge(imported, cache):
    _, model = imported
    model = with_config(model, model.cfg.replace(**CACHES[cache]))
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 258, n).tolist() for n in (5, 11, 17)]   # chunked_paged_run's lengths; window 8
    P = 4
    tables = np.zeros((3, model.cfg.max_context // P), np.int32)
    perm = 1 + rng.permutation(12)
    tables[0, :2], tables[1, :3], tables[2, :5] = perm[:2], perm[2:5], perm[5:10]
    got, _ = chunked_paged_run(model, init_pool(model.cfg, 13, P, 4, 4), seqs, tables)
    for b, seq in enumerate(seqs):
        want = static_logits(model, seq)
        assert np.abs(got[b] - want).max() <= TOLERANCE, (cache, b, float(np.abs(got[b] - want).max()))


def test_the_serving_engine_answers_with_the_static_greedy_tokens(imported):
    _, model = imported
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 256, n).tolist() for n in (12, 9, 20)]   # all longer than the window of 8
    engine = make_engine(model)
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    done = drain(engine)
    for rid, prompt in zip(ids, prompts):
        want = solo(model, prompt, 10)
        assert done[rid][0] == (want[0] if np.ndim(want) == 2 else want)


def test_gguf_twin_is_the_hf_model_with_llama_cpp_query_scale(imported, reference, tmp_path):
    _, hf_model = imported
    ref, _ = reference
    ids = ref["prompt_ids"] + ref["greedy_tokens"][:-1]
    path = tmp_path / "twin.gguf"
    write_gguf_twin(FIXTURE, path)
    assert main(["import", str(path), "--out", str(tmp_path / "float")]) == 0
    model, cfg, _, summary = load_run(tmp_path / "float")
    assert summary["architecture"] == "Gemma3ForCausalLM" and summary["weight_format"] == "float32"
    assert cfg == hf_model.cfg.replace(attention_scale=cfg.head_size ** -0.5)
    want = full_logits(with_config(hf_model, cfg), ids)
    assert np.abs(full_logits(model, ids) - want).max() <= 1e-6
    write_gguf_twin(FIXTURE, path, qtypes=lambda _: gguf.GGMLQuantizationType.Q8_0)
    assert main(["import", str(path), "--out", str(tmp_path / "blocks")]) == 0
    assert main(["import", str(path), "--out", str(tmp_path / "dequantized"), "--dtype", "float32"]) == 0
    blocks, _, _, summary = load_run(tmp_path / "blocks")
    assert summary["weight_format"] == "GGUF blocks Q8_0"
    want = full_logits(load_run(tmp_path / "dequantized")[0], ids)
    assert np.abs(full_logits(blocks, ids) - want).max() <= 1e-5 * np.abs(want).max()


def test_transformers_4_spelling_maps_to_the_same_config():
    new = hf_config()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
               sliding_window_pattern=2)
    assert import_spec(old).cfg == import_spec(new).cfg
    assert import_spec(new).norm_offset == 1.0


def test_gemma2_config_maps_to_its_fields():
    gemma2 = {k: v for k, v in hf_config().items() if k not in ("rope_parameters", "layer_types", "model_type")}
    gemma2.update(architectures=["Gemma2ForCausalLM"], rope_theta=10000.0, attn_logit_softcapping=None,
                  final_logit_softcapping=30.0)
    cfg = import_spec(gemma2).cfg
    assert cfg.layer_types == ("sliding_attention", "full_attention")   # Gemma 2: every other layer slides
    assert not cfg.qk_norm and cfg.sandwich_norms and cfg.rope_local_theta is None and cfg.rope_theta == 1e4
    assert cfg.final_logit_softcap == 30.0 and cfg.attention_scale == 24 ** -0.5


@pytest.mark.parametrize("changes, field", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_parameters.sliding_attention"),
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar=0"),
    (dict(attention_bias=True), "attention_bias=True")])
def test_what_cannot_run_exactly_is_refused_naming_the_field(changes, field):
    with pytest.raises(CheckpointError, match="config.json: " + re.escape(field)):
        import_spec({**hf_config(), **changes})


def without_template(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    os.remove(src / "chat_template.jinja")
    return src


def test_gemma_turn_format_when_the_checkpoint_carries_none(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["import", str(without_template(tmp_path)), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("chat template:")] == [
        "chat template: Gemma's turn format (built in: the checkpoint carries none; --chat-template FILE "
        "overrides it)"]
    model, _, tokenizer, summary = load_run(out)
    assert summary["chat_template"].startswith("Gemma's turn format")
    text = load_chat_format(out, tokenizer).template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_chat_template_flag_overrides_for_every_import(tmp_path, capsys):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    for source in (FIXTURE, os.path.join(FIXTURES, "parity", "llama")):
        out = tmp_path / os.path.basename(source)
        assert main(["import", source, "--out", str(out), "--chat-template", str(template)]) == 0
        assert f"chat template: {template} (--chat-template)" in capsys.readouterr().out
        tokenizer = load_run(out)[2]
        assert load_chat_format(out, tokenizer).template.render([{"role": "user", "content": "Hi"}]) == \
            "user: Hi\nassistant:"


@pytest.mark.parametrize("text, why", [("{% for m in messages %}", "fails to render"),
                                       ("{{ raise_exception('no') }}", "refused the conversation: no")])
def test_a_chat_template_that_fails_to_render_is_refused_in_one_line(tmp_path, capsys, text, why):
    template = tmp_path / "bad.jinja"
    template.write_text(text)
    out = tmp_path / "run"
    assert main(["import", FIXTURE, "--out", str(out), "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert f"--chat-template {template} fails to render" in err and why in err and err.count("\n") == 1
    assert not out.exists()
