"""``dantinox import`` of Hugging Face directories: bad input (one line, exit 2, nothing left behind), shards
with an index, bfloat16 tensors, the extra run-directory files, and the refusals of hf_config."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from cli_util import run_main
from paths import FIXTURES

from dantinox import ConfigError, ModelConfig
from dantinox.checkpoints import CheckpointError, convert_weights, import_spec
from dantinox.checkpoints.hf_dir import read_hf_dir, read_safetensors
from dantinox.checkpoints.run_dir_writer import read_chat_template, read_generation_config
from dantinox.runs.run_dir import load_run

FIXTURES = os.path.join(FIXTURES, "parity")


def copy_fixture(name: str, tmp_path) -> str:
    dst = tmp_path / f"src-{name}"
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    os.remove(dst / "reference_logits.npy")
    return str(dst)


def edit_config(src: str, **changes) -> None:
    path = os.path.join(src, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def run_import(capsys, src: str, out, *extra) -> tuple[int, str]:
    rc, _, err = run_main(["import", src, "--out", str(out), *extra], capsys)
    return rc, err.strip()


def assert_refused(capsys, tmp_path, src: str, *needles: str) -> None:
    """Exit 2, one line naming every needle, and no run directory (or temporary one) left behind."""
    out = tmp_path / "runs" / "new"
    rc, err = run_import(capsys, src, out)
    assert rc == 2 and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    assert not out.exists()
    assert not (tmp_path / "runs").exists() or os.listdir(tmp_path / "runs") == []


def test_dir_without_config(capsys, tmp_path):
    src = copy_fixture("llama", tmp_path)
    os.remove(os.path.join(src, "config.json"))
    assert_refused(capsys, tmp_path, src, "config.json")


def test_dir_without_weights(capsys, tmp_path):
    src = copy_fixture("llama", tmp_path)
    os.remove(os.path.join(src, "model.safetensors"))
    assert_refused(capsys, tmp_path, src, "no *.safetensors")


def test_missing_shard_listed_in_index(capsys, tmp_path):
    src = copy_fixture("llama", tmp_path)
    names = list(read_safetensors(os.path.join(src, "model.safetensors")))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    os.rename(os.path.join(src, "model.safetensors"), os.path.join(src, "model-00001-of-00002.safetensors"))
    assert_refused(capsys, tmp_path, src, "model-00002-of-00002.safetensors", "missing")


def test_tensor_shape_mismatch_names_tensor_expected_and_found(capsys, tmp_path):
    src = copy_fixture("qwen2", tmp_path)
    path = os.path.join(src, "model.safetensors")
    tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:16]
    safetensors.numpy.save_file(tensors, path)
    assert_refused(capsys, tmp_path, src, name, "[16, 64]", "[32, 64]")


def test_truncated_safetensors(capsys, tmp_path):
    src = copy_fixture("llama", tmp_path)
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert_refused(capsys, tmp_path, src, "model.safetensors", "truncated")


@pytest.mark.parametrize("fixture, changes, needles", [
    ("deepseek_v3", dict(first_k_dense_replace=1), ("first_k_dense_replace=1", "mixture-of-experts")),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
     ("rope_type", "'dynamic'")),
    ("llama", dict(architectures=["GPT2LMHeadModel"]), ("architectures", "GPT2LMHeadModel")),
    ("llama", dict(hidden_act="gelu"), ("hidden_act", "gelu")),
    ("llama", dict(attention_bias=True), ("attention_bias",)),
    ("qwen3", dict(use_sliding_window=True), ("use_sliding_window",)),
    ("deepseek_v2", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}),
     ("rope_type", "'longrope'")),
    ("llama", dict(partial_rotary_factor=0.5), ("partial_rotary_factor", "0.5")),
])
def test_configs_that_cannot_run_exactly_are_refused(capsys, tmp_path, fixture, changes, needles):
    src = copy_fixture(fixture, tmp_path)
    edit_config(src, **changes)
    assert_refused(capsys, tmp_path, src, *needles)


def test_existing_out_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rc, err = run_import(capsys, os.path.join(FIXTURES, "llama"), out)
    assert rc == 2 and "already exists" in err and os.listdir(out) == []


def test_sharded_bfloat16_checkpoint_imports_the_same_weights(capsys, tmp_path):
    src = copy_fixture("llama3", tmp_path)
    tensors = {k: np.array(v) for k, v in read_safetensors(os.path.join(src, "model.safetensors")).items()}
    os.remove(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, part in shards.items():
        safetensors.numpy.save_file({n: tensors[n].astype(ml_dtypes.bfloat16) for n in part},
                                    os.path.join(src, shard))
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {n: s for s, part in shards.items() for n in part}}, f)
    rc, err = run_import(capsys, src, tmp_path / "run")
    assert rc == 0, err
    model, cfg, _, _ = load_run(tmp_path / "run")
    want = tensors["model.layers.1.self_attn.o_proj.weight"].astype(ml_dtypes.bfloat16).astype(np.float32).T
    np.testing.assert_array_equal(np.asarray(model.blocks[1].attn.out.kernel[...]), want)
    assert cfg.rope_scaling == (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                ("original_max_position_embeddings", 32.0), ("type", "llama3"))


def test_run_dir_keeps_template_generation_defaults_and_pads_the_tokenizer(capsys, tmp_path):
    rc, err = run_import(capsys, os.path.join(FIXTURES, "qwen2"), tmp_path / "run", "--dtype", "bfloat16")
    assert rc == 0, err
    with open(os.path.join(FIXTURES, "qwen2", "chat_template.jinja")) as f:
        assert read_chat_template(tmp_path / "run") == f.read()
    # generation_config.json's eos_token_id, then tokenizer_config.json's eos_token <|im_end|> (K11)
    assert read_generation_config(tmp_path / "run")["eos_token_ids"] == [257, 256]
    _, cfg, tokenizer, summary = load_run(tmp_path / "run")
    assert (cfg.compute_dtype, cfg.cache_dtype, cfg.qkv_bias) == ("bfloat16", "bfloat16", True)
    assert tokenizer.vocab_size == cfg.vocab_size == 264           # 258 ids padded with unused specials
    assert tokenizer.decode(tokenizer.encode("Paris, é")) == "Paris, é"
    assert summary["architecture"] == "Qwen2ForCausalLM"


def test_deepseek_rope_deinterleave_is_needed():
    """Guard against a parity test that cannot fail: importing DeepSeek without the RoPE permutation changes
    the q_up and down kernels' rotary columns (and, in test_parity_fixtures, the logits)."""
    ckpt = read_hf_dir(os.path.join(FIXTURES, "deepseek_v2"))
    spec = import_spec(ckpt.config)
    assert spec.rope_interleaved
    right = convert_weights(ckpt.tensors, spec)
    wrong = convert_weights(ckpt.tensors, spec.__class__(spec.cfg, spec.architecture, False))
    assert not np.array_equal(right["blocks.0.attn.q_up.kernel"], wrong["blocks.0.attn.q_up.kernel"])
    np.testing.assert_array_equal(np.sort(right["blocks.0.attn.down.kernel"], axis=1),
                                  np.sort(wrong["blocks.0.attn.down.kernel"], axis=1))


@pytest.mark.parametrize("changes, field", [
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling"),
    (dict(rope_scaling={"type": "linear"}), "rope_scaling"),
    (dict(qkv_bias=True, attention="mla", kv_heads=None, kv_latent_dim=16), "qkv_bias"),
    (dict(v_head_size=8), "v_head_size"),
    (dict(qk_norm="yes"), "qk_norm"),
])
def test_new_config_fields_are_validated(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_preset("tiny", **changes)


def test_switching_to_mla_drops_the_projection_extras():
    cfg = ModelConfig.from_preset("tiny", qkv_bias=True, qk_norm=True).replace(attention="mla", kv_latent_dim=16)
    assert (cfg.qkv_bias, cfg.qk_norm) == (False, False)


def test_yarn_resolves_transformers_defaults():
    spec = import_spec({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 48, "num_attention_heads": 4,
                        "num_hidden_layers": 1, "vocab_size": 64, "intermediate_size": 96, "head_dim": 24,
                        "max_position_embeddings": 64, "rope_theta": 1e6,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}})
    yarn = dict(spec.cfg.rope_scaling)
    assert (yarn["beta_fast"], yarn["beta_slow"], yarn["truncate"]) == (32.0, 1.0, True)
    assert yarn["attention_factor"] == pytest.approx(0.1 * np.log(4.0) + 1.0)
    assert spec.cfg.attention_scale is None                       # only DeepSeek's mscale_all_dim changes it


def test_rope_scaling_round_trips_through_json():
    cfg = ModelConfig.from_preset("tiny", rope_scaling={"type": "linear", "factor": 2})
    again = ModelConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg and hash(again) == hash(cfg)


def test_import_spec_refuses_in_one_line():
    with pytest.raises(CheckpointError, match="architectures"):
        import_spec({"architectures": ["BertModel"]})


def rewrite_tensors(src: str, edit) -> None:
    path = os.path.join(src, "model.safetensors")
    tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
    edit(tensors)
    safetensors.numpy.save_file(tensors, path)


def test_tensor_without_a_place_is_refused(capsys, tmp_path):
    src = copy_fixture("deepseek_v3", tmp_path)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    rewrite_tensors(src, lambda t: t.update({name: np.zeros((32, 64), np.float32)}))
    assert_refused(capsys, tmp_path, src, name, "no place")


def test_tied_config_with_a_different_head_is_refused(capsys, tmp_path):
    src = copy_fixture("llama", tmp_path)
    rewrite_tensors(src, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1.0}))
    assert_refused(capsys, tmp_path, src, "lm_head.weight", "tie_word_embeddings")


def test_tokenizer_with_more_ids_than_the_embedding_is_refused(capsys, tmp_path):
    src = copy_fixture("llama", tmp_path)
    edit_config(src, vocab_size=200)
    rewrite_tensors(src, lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"][:200]}))
    assert_refused(capsys, tmp_path, src, "tokenizer.json has 258 ids", "vocab_size=200")
