"""GGUF architectures beyond the mapping itself (tests/checkpoints/test_gguf_twins.py checks that): bad input
refused with one line naming the key or tensor (an unknown architecture or tokenizer kind refused while the
metadata is parsed, before any tensor description; metadata that disagrees with the tensors; what Phi-3 and
Llama files hold that the model cannot run), Llama 3's rope parameters recovered from ``rope_freqs.weight``
against the published formula, and Gemma 3's mapping (imported; refused with its switch off)."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
from gguf_twin import llama3_rope_freqs, write_gguf_twin
from gguf_util import write_tiny_gguf
from paths import FIXTURES

from dantinox.checkpoints import gguf_architectures, gguf_gemma3
from dantinox.checkpoints.errors import GGUFError
from dantinox.checkpoints.gguf_metadata import Metadata
from dantinox.checkpoints.gguf_rope import llama3_rope_scaling
from dantinox.checkpoints.gguf_source import open_reader, read_metadata
from dantinox.cli import entrypoint as cli

PARITY = os.path.join(FIXTURES, "parity")


def bad_import(tmp_path, capsys, path) -> str:
    """The one error line of ``dantinox import`` (exit 2, no run directory left)."""
    out = tmp_path / "run"
    assert cli.main(["import", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert not out.exists() and err.count("\n") == 1, err
    return err


def patch_uint32(path, key: str, value: int) -> None:
    """Set the uint32 metadata value of ``key`` in place (GGUF: key string, value type 4, value)."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4   # GGUFValueType.UINT32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))


def twin(tmp_path, name="llama", **options):
    path = tmp_path / f"{name}.gguf"
    write_gguf_twin(os.path.join(PARITY, name), path, **options)
    return path


@pytest.mark.parametrize("arch, expected", [
    ("mamba", "general.architecture='mamba' is not supported: one of llama, qwen2, qwen3, phi3, gemma3")])
def test_an_unsupported_architecture_is_refused_before_the_tensors(tmp_path, capsys, arch, expected):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch=arch)
    path.write_bytes(path.read_bytes()[:200])   # cut inside the metadata: the tensor descriptions are gone
    assert expected in bad_import(tmp_path, capsys, path)


def test_a_tokenizer_kind_neither_bpe_nor_sentencepiece_is_refused_before_the_tensors(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    kind = b"tokenizer.ggml.model" + struct.pack("<IQ", 8, 4)   # a string value of 4 bytes
    assert data.count(kind + b"gpt2") == 1
    path.write_bytes(data.replace(kind + b"gpt2", kind + b"bert")[:data.index(kind) + 200])
    err = bad_import(tmp_path, capsys, path)
    assert "tokenizer.ggml.model='bert' is not supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)" in err


@pytest.mark.parametrize("key, value, expected", [
    ("llama.block_count", 3, "llama.block_count=3 disagrees with the file's tensors, which hold blocks 0..1"),
    ("llama.attention.head_count", 8, "llama.attention.head_count=8 disagrees with tensor blk.0.attn_output.weight "
                                      "of shape [48, 64] (the metadata implies [48, 128])"),
    ("llama.attention.head_count_kv", 1, "llama.attention.head_count_kv=1 disagrees with tensor blk.0.attn_k.weight"),
    ("llama.embedding_length", 32, "llama.embedding_length=32 disagrees with tensor"),
    ("llama.feed_forward_length", 64, "llama.feed_forward_length=64 disagrees with tensor blk.0.ffn_")])
def test_metadata_that_disagrees_with_the_tensors_names_the_key(tmp_path, capsys, key, value, expected):
    path = twin(tmp_path, "llama3")   # llama3: 4 heads of 16 (attention.key_length) in a width of 48
    patch_uint32(path, key, value)
    assert expected in bad_import(tmp_path, capsys, path)


def test_what_phi3_and_llama_files_hold_beyond_the_model_is_refused_naming_it(tmp_path, capsys):
    path = twin(tmp_path, phi3=True)
    patch_uint32(path, "phi3.rope.dimension_count", 8)
    assert ("phi3.rope.dimension_count=8 is not supported: the head size 16 (partial rotary embeddings are not "
            "supported)") in bad_import(tmp_path, capsys, path)
    path = twin(tmp_path, phi3=True, extra=lambda w: w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32)))
    assert "tensor rope_factors_long.weight (Phi-3 LongRoPE scaling) is not supported" in bad_import(
        tmp_path, capsys, path)
    path = twin(tmp_path, phi3=True, extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE))
    assert "phi3.rope.scaling.type='longrope' is not supported: 'none', 'linear' or 'yarn'" in bad_import(
        tmp_path, capsys, path)
    path = twin(tmp_path, extra=lambda w: w.add_expert_count(8))
    assert "llama.expert_count=8 is not supported: 0 (mixture-of-experts" in bad_import(tmp_path, capsys, path)
    rope = np.array([1, 3, 1, 3, 1, 3, 1, 3], np.float32)   # no monotone llama3 curve
    path = twin(tmp_path, extra=lambda w: w.add_tensor("rope_freqs.weight", rope))
    assert "tensor rope_freqs.weight (per-frequency RoPE factors) is not supported" in bad_import(
        tmp_path, capsys, path)


@pytest.mark.parametrize("head_dim, theta, params", [
    (16, 500000.0, (8.0, 1.0, 4.0, 32)),      # the llama3 fixture: no factor strictly between 1 and 8
    (128, 500000.0, (8.0, 1.0, 4.0, 8192)),   # Llama 3.1 8B
    (64, 500000.0, (32.0, 1.0, 4.0, 8192)),   # Llama 3.2 1B
    (128, 500000.0, (8.0, 1.0, 2.5, 4096))])  # not Meta's high_freq_factor: recovered from the curve
def test_llama3_parameters_are_recovered_from_rope_freqs(head_dim, theta, params):
    factor, low, high, original = params
    factors = llama3_rope_freqs(head_dim, dict(rope_theta=theta, factor=factor, low_freq_factor=low,
                                               high_freq_factor=high, original_max_position_embeddings=original))
    assert llama3_rope_scaling(factors, head_dim, theta) == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": original}
    assert llama3_rope_scaling(np.ones(head_dim // 2, np.float32), head_dim, theta) is None
    with pytest.raises(ValueError, match="head_dim / 2"):
        llama3_rope_scaling(factors[:-1], head_dim, theta)


def write_gemma3(path, layers=6, pattern=None, tied=True):
    """A tiny Gemma 3 file as llama.cpp's converter writes one (norms stored as 1 + w)."""
    E, H, K, D, F, V = 32, 2, 1, 16, 64, 40
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(8)
    w.add_final_logit_softcapping(30.0)
    if pattern is not None:
        w.add_array("gemma3.attention.sliding_window_pattern", pattern)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_scores([0.0] * V)
    rng = np.random.default_rng(0)
    t = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", t(V, E))
    w.add_tensor("output_norm.weight", 1 + t(E))
    if not tied:
        w.add_tensor("output.weight", t(V, E))
    for i in range(layers):
        shapes = {"attn_norm": (E,), "post_attention_norm": (E,), "ffn_norm": (E,), "post_ffw_norm": (E,),
                  "attn_q": (H * D, E), "attn_k": (K * D, E), "attn_v": (K * D, E), "attn_output": (E, H * D),
                  "attn_q_norm": (D,), "attn_k_norm": (D,), "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", t(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gemma3_inputs(path):
    reader = open_reader_unchecked(path)
    return Metadata(read_metadata(reader), "gemma3", str(path)), {t.name: t for t in reader.tensors}


def open_reader_unchecked(path):
    """The plain gguf reader (dantinox's refuses gemma3 while parsing, as it should)."""
    return gguf.GGUFReader(str(path))


def test_gemma3_is_mapped_and_refused_with_its_switch_off(tmp_path, capsys, monkeypatch):
    path = tmp_path / "gemma3.gguf"
    write_gemma3(path, layers=7)
    m, tensors = gemma3_inputs(path)
    spec = gguf_gemma3.gemma3_spec(m, tensors)
    assert (spec.dim, spec.n_heads, spec.kv_heads, spec.head_dim, spec.mlp_hidden, spec.vocab_size) == (32, 2, 1, 16,
                                                                                                       64, 40)
    assert spec.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (spec.sliding_window, spec.rope_theta, spec.rope_theta_local) == (8, 1e6, 1e4)
    assert (spec.query_pre_attn_scalar, spec.final_logit_softcapping, spec.attn_logit_softcapping) == (16, 30.0, None)
    assert spec.tie_embeddings and spec.norm_eps == 1e-6
    config = gguf_gemma3.hf_config(m, tensors)
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["layer_types"][5] == "full_attention"
    arch = gguf_architectures.ARCHITECTURES["gemma3"]
    assert arch.hf_name("blk.3.post_ffw_norm.weight") == "model.layers.3.post_feedforward_layernorm.weight"
    assert arch.hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert arch.norm_offset == -1.0 and not arch.rope_rows_permuted
    monkeypatch.setattr(gguf_gemma3, "ENABLED", False)   # the switch: gemma3 leaves the registry
    monkeypatch.setattr(gguf_architectures, "ARCHITECTURES", gguf_architectures._registry())
    with pytest.raises(GGUFError, match="Gemma 3"):
        open_reader(path)


def test_gemma3_window_metadata_that_disagrees_with_the_layers_names_the_key(tmp_path):
    path = tmp_path / "gemma3.gguf"
    write_gemma3(path, layers=6, pattern=[True, False, True])
    m, tensors = gemma3_inputs(path)
    with pytest.raises(GGUFError, match=r"gemma3.attention.sliding_window_pattern='\[3 values\]' is not supported: "
                                        r"one boolean per layer \(gemma3.block_count=6\)"):
        gguf_gemma3.gemma3_spec(m, tensors)
    write_gemma3(path, layers=4, pattern=[True, True, False, True])
    m, tensors = gemma3_inputs(path)
    assert gguf_gemma3.gemma3_spec(m, tensors).layer_types[2] == "full_attention"
