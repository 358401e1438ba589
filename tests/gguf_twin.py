"""The GGUF twin of a tiny Hugging Face parity fixture (tests/fixtures/parity/NAME), written with the ``gguf``
package's GGUFWriter the way llama.cpp's converter writes the same model: the ``{arch}.*`` hyperparameter keys,
the tokenizer as metadata (byte-level BPE: tokens, merges, token types), the chat template, the tensors under
GGUF names, q / k rows permuted to llama.cpp's pair order for ``llama`` files only, Llama 3's rope scaling as
``rope_freqs.weight`` (the factors computed from the published formula), and, when asked, matrices quantized
into block formats (``gguf.quants.quantize``; random valid blocks for formats it cannot produce).

Architectures: llama / mistral fixtures -> ``llama`` (Mistral's window as ``llama.attention.sliding_window``),
qwen2 -> ``qwen2``, qwen3 -> ``qwen3``, gemma3 -> ``gemma3`` (its four norms per block and q / k norms stored as
1 + w, as llama.cpp's converter stores them; its window layers as a ``sliding_window_pattern`` array, the
sliding layers' RoPE base as ``rope.freq_base_swa``, the full layers' linear scaling as ``rope.scaling.*``;
GGUF has no key for query_pre_attn_scalar, which llama.cpp takes to be the head size); ``phi3=True`` writes a
Llama-family fixture as ``phi3`` instead (fused ``attn_qkv`` and ``ffn_up`` = gate | up rows, no permutation),
which computes the same function.
Independent of dantinox: only json, numpy, safetensors and gguf are used."""

import json
import math
import os

import gguf
import numpy as np
from gguf.quants import quantize
from gguf_util import RANDOM_BLOCKS, llama_cpp_permute, random_blocks
from safetensors.numpy import load_file

Q = gguf.GGMLQuantizationType
ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
GEMMA3_NAMES = {**LAYER_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def _json(fixture, name):
    path = os.path.join(fixture, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rope(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or {})
    params.update(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def llama3_rope_freqs(head_dim: int, rope: dict) -> np.ndarray:
    """Llama 3's factor per frequency, as llama.cpp's converter computes them (float32 [head_dim / 2])."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _tokenizer(w, fixture):
    data = _json(fixture, "tokenizer.json")
    vocab = data["model"]["vocab"]
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    types = [1] * len(tokens)
    for added in data.get("added_tokens", []):
        while len(tokens) <= added["id"]:
            tokens.append(None)
            types.append(1)
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)


def _gemma3_metadata(w, config, head_dim):
    """Gemma 3's keys beyond the shared ones: windows, the two RoPE bases and scaling, soft-capping."""
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    full, local = (dict(config["rope_parameters"][k]) for k in ("full_attention", "sliding_attention"))
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(config["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(config["final_logit_softcapping"])


def _metadata(w, config, arch, head_dim, phi3):
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    if arch == "gemma3":
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        return _gemma3_metadata(w, config, head_dim)
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = _rope(config)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if config.get("sliding_window") or phi3:
        w.add_sliding_window(config.get("sliding_window") or 0)


def _quantized(w, name, array, qtype, rng):
    """Add a matrix as ``qtype`` blocks (F32 when its input width does not divide the block size)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == Q.F32 or array.ndim != 2 or array.shape[1] % block:
        w.add_tensor(name, np.ascontiguousarray(array, np.float32))
    elif qtype.name in RANDOM_BLOCKS:
        w.add_tensor(name, random_blocks(qtype, *array.shape, rng), raw_dtype=qtype)
    else:
        w.add_tensor(name, quantize(np.ascontiguousarray(array, np.float32), qtype), raw_dtype=qtype)


def write_gguf_twin(fixture: str, path, qtypes=None, phi3: bool = False, extra=None) -> dict:
    """Write the GGUF twin of ``fixture`` to ``path``. qtypes: GGUF tensor name -> GGMLQuantizationType for
    matrices (default F32; a callable name -> type also works). extra(writer): called after the hyperparameter
    keys, to add keys or tensors (bad-input tests). Returns the fixture's config dict."""
    config = _json(fixture, "config.json")
    arch = "phi3" if phi3 else ARCH[config["architectures"][0]]
    H, K = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // H
    pick = qtypes if callable(qtypes) else (lambda name: (qtypes or {}).get(name, Q.F32))
    tensors = load_file(os.path.join(fixture, "model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, config, arch, head_dim, phi3)
    if extra is not None:
        extra(w)
    _tokenizer(w, fixture)
    gen = _json(fixture, "generation_config.json")
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    if eos is not None:
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    template = os.path.join(fixture, "chat_template.jinja")
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            w.add_chat_template(f.read())
    rope = _rope(config)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(head_dim, rope))
    rng = np.random.default_rng(0)
    out = {}
    for name, array in tensors.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = array + np.float32(1) if arch == "gemma3" and name.endswith("norm.weight") else array
            continue
        _, _, n, rest = name.split(".", 3)
        if arch == "gemma3":
            out[f"blk.{n}.{GEMMA3_NAMES[rest]}"] = array + np.float32(1) if rest.endswith("norm.weight") else array
            continue
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            array = llama_cpp_permute(array, H)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            array = llama_cpp_permute(array, K)
        out[f"blk.{n}.{LAYER_NAMES[rest]}"] = array
    if phi3:
        for n in range(config["num_hidden_layers"]):
            p = f"blk.{n}."
            out[p + "attn_qkv.weight"] = np.concatenate([out.pop(p + f"attn_{x}.weight") for x in "qkv"])
            out[p + "ffn_up.weight"] = np.concatenate([out.pop(p + "ffn_gate.weight"), out.pop(p + "ffn_up.weight")])
    for name, array in out.items():
        _quantized(w, name, array, pick(name), rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config
