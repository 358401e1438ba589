"""GGUF architectures -> the transformers config and tensor names of the same model's Hugging Face twin.

``ARCHITECTURES`` maps ``general.architecture`` to a :class:`GGUFArchitecture`; the config it builds from the
file's ``{arch}.*`` metadata is the config.json of the transformers class a Hugging Face directory of the same
model has, so ``hf_config.import_spec`` gives the same ModelConfig for both:

  llama  LlamaForCausalLM (Llama, TinyLlama, SmolLM2, Mistral: llama.cpp writes Mistral files as llama);
         MistralForCausalLM when ``llama.attention.sliding_window`` > 0; Llama 3.x's ``rope_freqs.weight``
         becomes rope_scaling "llama3" (``gguf_rope``). llama.cpp's converter reorders the q / k rows for its
         adjacent-pair RoPE (``rope_rows_permuted``: undone by the reader).
  qwen2  Qwen2ForCausalLM: biases on q, k, v (``attn_q.bias`` ...).
  qwen3  Qwen3ForCausalLM: RMSNorm per query / key head (``attn_q_norm`` / ``attn_k_norm``); head size
         ``attention.key_length``.
  phi3   Phi3ForCausalLM: fused ``attn_qkv`` [(H + 2K) D, E] (or separate q / k / v) and ``ffn_up`` [2F, E]
         (gate rows first), ``attention.sliding_window`` on every layer when > 0. Refused: LongRoPE
         (``rope_factors_long`` / ``rope_factors_short`` tensors, ``rope.scaling.attn_factor``, scaling type
         ``longrope``) and partial rotary embeddings (``rope.dimension_count`` < head size, Phi-4-mini): the
         model has neither.
  gemma3 Gemma3ForCausalLM (``gguf_gemma3``): four norms per block stored as 1 + w, QK norm, per-layer windows
         from ``attention.sliding_window_pattern``, local and global RoPE bases.

qwen2, qwen3 and phi3 rotate halves as HF does (llama.cpp's NEOX RoPE), so their rows are as HF stores them.
Shared keys (``{arch}.`` + block_count, context_length, embedding_length, feed_forward_length,
attention.head_count(_kv), attention.key_length / value_length, rope.dimension_count, rope.freq_base,
attention.layer_norm_rms_epsilon, rope.scaling.*) map to the HF fields of the same meaning; every key that
would change the function and has no HF counterpart here is refused naming it (mixture-of-experts counts,
per-layer head counts, key / value heads of different sizes, yarn's ext_factor / log_multiplier), and the
tensors' shapes are checked against the metadata first (``gguf_shapes``). Shape letters: E width, F MLP width,
H query heads, K KV heads, D head size, V vocabulary, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import GGUFError
from .gguf_metadata import Metadata
from .gguf_rope import llama3_rope_scaling
from .gguf_shapes import BLOCK, Expected, check_block_count, check_shapes, tensor_shape

TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
LLAMA_BLOCK = {  # GGUF name inside blk.N -> HF name inside model.layers.N
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QWEN2_BLOCK = {**LLAMA_BLOCK, "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias"}
QWEN3_BLOCK = {**LLAMA_BLOCK, "attn_q_norm.weight": "self_attn.q_norm.weight",
               "attn_k_norm.weight": "self_attn.k_norm.weight"}
PHI3_BLOCK = {**{k: v for k, v in LLAMA_BLOCK.items() if k != "ffn_gate.weight"},
              "attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}


@dataclass(frozen=True)
class GGUFArchitecture:
    """One supported ``general.architecture``.

    config(m, tensors) -> the HF config dict (m: the file's Metadata; tensors: GGUF name -> gguf.ReaderTensor,
    shapes checked, data read only for small factor tensors). block_names: GGUF name inside ``blk.N`` -> HF name
    inside ``model.layers.N``. rope_rows_permuted: llama.cpp's converter reordered q / k rows (llama only).
    norm_offset: added to every ``*norm.weight`` tensor to get HF's value (Gemma's files hold 1 + w).
    consumed: tensors the config reads (not model weights).
    """

    name: str
    config: Callable[[Metadata, dict], dict]
    block_names: dict
    rope_rows_permuted: bool = False
    norm_offset: float = 0.0
    consumed: tuple[str, ...] = ()

    def hf_name(self, name: str) -> str | None:
        """The HF name of GGUF tensor ``name`` ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj
        .weight"); None for a name this architecture does not have."""
        if name in TOP_NAMES:
            return TOP_NAMES[name]
        match = BLOCK.match(name)
        if match and match.group(2) in self.block_names:
            return f"model.layers.{match.group(1)}.{self.block_names[match.group(2)]}"
        return None


def _refuse_unmapped(m: Metadata, tensors: dict) -> None:
    """Refuse keys and tensors every supported architecture lacks, naming them."""
    for name in ("expert_count", "expert_used_count"):
        if m.get(name, 0):
            m.refuse(name, m.get(name), "0 (mixture-of-experts layers are not supported)")
    for name in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier"):
        if m.has(name):
            m.refuse(name, m.get(name), "absent (no Hugging Face rope parameter computes it)")
    if m.get("rope.scaling.attn_factor", 1.0) != 1.0:
        m.refuse("rope.scaling.attn_factor", m.get("rope.scaling.attn_factor"),
                 "1.0 (an attention scale of LongRoPE-style scaling, which is not supported)")


def rope_scaling(m: Metadata) -> dict | None:
    """The HF rope_scaling of ``{arch}.rope.scaling.type`` none / linear / yarn (with factor, original context,
    beta_fast / beta_slow and yarn_attn_factor as attention_factor when given); GGUFError naming another type."""
    kind = m.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": m.float("rope.scaling.factor")}
    if kind != "yarn":
        m.refuse("rope.scaling.type", kind, "'none', 'linear' or 'yarn' (an approximate model is never built)")
    out = {"rope_type": "yarn", "factor": m.float("rope.scaling.factor"),
           "original_max_position_embeddings": m.int("rope.scaling.original_context_length")}
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                    ("yarn_attn_factor", "attention_factor")):
        if m.has(f"rope.scaling.{key}"):
            out[hf] = m.float(f"rope.scaling.{key}")
    return out


def _sizes(m: Metadata, tensors: dict) -> dict:
    """E, H, K, D, F, V of the file (V: the embedding's rows), each checked; GGUFError naming the key."""
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{m.path}: tensor token_embd.weight is missing")
    heads, dim = m.int("attention.head_count"), m.int("embedding_length")
    head_dim = m.int("attention.key_length", dim // heads if dim >= heads else 0)
    if m.int("attention.value_length", head_dim) != head_dim:
        m.refuse("attention.value_length", m.get("attention.value_length"),
                 f"equal to {m.key('attention.key_length')}={head_dim} (one head size for keys and values)")
    vocab = tensor_shape(tensors["token_embd.weight"])[0]
    if m.has("vocab_size") and m.int("vocab_size") != vocab:
        m.refuse("vocab_size", m.get("vocab_size"), f"the rows of tensor token_embd.weight ({vocab})")
    return dict(E=dim, H=heads, K=m.int("attention.head_count_kv", heads), D=head_dim,
                F=m.int("feed_forward_length"), V=vocab)


def expected_shapes(s: dict, fused_mlp: bool = False) -> Expected:
    """The shape (size, key) per dimension of each tensor of the Llama family (``gguf_shapes``)."""
    E, H, K, D, F, V = (s[k] for k in "EHKDFV")
    e, h, k, f = "embedding_length", "attention.head_count", "attention.head_count_kv", "feed_forward_length"
    return {"token_embd.weight": ((V, None), (E, e)), "output.weight": ((V, None), (E, e)),
            "output_norm.weight": ((E, e),), "attn_norm.weight": ((E, e),), "ffn_norm.weight": ((E, e),),
            "attn_q.weight": ((H * D, h), (E, e)), "attn_k.weight": ((K * D, k), (E, e)),
            "attn_v.weight": ((K * D, k), (E, e)), "attn_qkv.weight": (((H + 2 * K) * D, h), (E, e)),
            "attn_output.weight": ((E, e), (H * D, h)), "attn_q.bias": ((H * D, h),),
            "attn_k.bias": ((K * D, k),), "attn_v.bias": ((K * D, k),),
            "attn_q_norm.weight": ((D, "attention.key_length"),), "attn_k_norm.weight": ((D, "attention.key_length"),),
            "ffn_gate.weight": ((F, f), (E, e)), "ffn_up.weight": (((2 if fused_mlp else 1) * F, f), (E, e)),
            "ffn_down.weight": ((E, e), (F, f))}


def llama_like_config(m: Metadata, tensors: dict, hf_class: str, fused_mlp: bool = False) -> dict:
    """The HF config of a Llama-family file as ``hf_class`` (shapes and layer count checked first)."""
    _refuse_unmapped(m, tensors)
    s = _sizes(m, tensors)
    check_shapes(m, tensors, expected_shapes(s, fused_mlp))
    rotary = m.int("rope.dimension_count", s["D"])
    if rotary != s["D"]:
        m.refuse("rope.dimension_count", rotary, f"the head size {s['D']} (partial rotary embeddings are not "
                 "supported)")
    return {
        "architectures": [hf_class], "model_type": hf_class.removesuffix("ForCausalLM").lower(),
        "hidden_size": s["E"], "intermediate_size": s["F"], "num_hidden_layers": check_block_count(m, tensors),
        "num_attention_heads": s["H"], "num_key_value_heads": s["K"], "head_dim": s["D"], "vocab_size": s["V"],
        "max_position_embeddings": m.int("context_length"),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": m.float("rope.freq_base", 10000.0), "rope_scaling": rope_scaling(m),
        "tie_word_embeddings": "output.weight" not in tensors, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id", raw=True),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id", raw=True), "torch_dtype": "float32",
    }


def _no_window(m: Metadata) -> None:
    if m.get("attention.sliding_window", 0):
        m.refuse("attention.sliding_window", m.get("attention.sliding_window"),
                 f"0 or absent for {m.arch} (its per-layer windows are not implemented)")


def _llama_config(m: Metadata, tensors: dict) -> dict:
    config = llama_like_config(m, tensors, "LlamaForCausalLM")
    window = m.int("attention.sliding_window", 0, minimum=0)
    if window:
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    if "rope_freqs.weight" in tensors:
        if config["rope_scaling"] is not None:
            m.refuse("rope.scaling.type", m.get("rope.scaling.type"), "'none' beside tensor rope_freqs.weight")
        factors = np.asarray(tensors["rope_freqs.weight"].data, np.float32)
        try:
            config["rope_scaling"] = llama3_rope_scaling(factors, config["head_dim"], config["rope_theta"])
        except ValueError as err:
            raise GGUFError(f"{m.path}: tensor rope_freqs.weight (per-frequency RoPE factors) is not supported: "
                            f"{err}") from None
    return config


def _qwen2_config(m: Metadata, tensors: dict) -> dict:
    _no_window(m)
    return {**llama_like_config(m, tensors, "Qwen2ForCausalLM"), "attention_bias": True}


def _qwen3_config(m: Metadata, tensors: dict) -> dict:
    _no_window(m)
    return llama_like_config(m, tensors, "Qwen3ForCausalLM")


def _phi3_config(m: Metadata, tensors: dict) -> dict:
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in tensors:
            raise GGUFError(f"{m.path}: tensor {name} (Phi-3 LongRoPE scaling) is not supported: dantinox's model "
                            "has no LongRoPE (the 4k-context Phi-3 files, without it, import)")
    config = llama_like_config(m, tensors, "Phi3ForCausalLM", fused_mlp=True)
    config["sliding_window"] = m.int("attention.sliding_window", 0, minimum=0) or None
    if m.has("rope.scaling.original_context_length"):
        config["original_max_position_embeddings"] = m.int("rope.scaling.original_context_length")
    return config


def _registry() -> dict[str, GGUFArchitecture]:
    from . import gguf_gemma3

    archs = [GGUFArchitecture("llama", _llama_config, LLAMA_BLOCK, rope_rows_permuted=True,
                              consumed=("rope_freqs.weight",)),
             GGUFArchitecture("qwen2", _qwen2_config, QWEN2_BLOCK),
             GGUFArchitecture("qwen3", _qwen3_config, QWEN3_BLOCK),
             GGUFArchitecture("phi3", _phi3_config, PHI3_BLOCK)]
    if gguf_gemma3.ENABLED:
        archs.append(GGUFArchitecture("gemma3", gguf_gemma3.hf_config, gguf_gemma3.BLOCK_NAMES,
                                      norm_offset=gguf_gemma3.NORM_OFFSET))
    return {a.name: a for a in archs}


ARCHITECTURES = _registry()
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def check_architecture(arch) -> None:
    """GGUFError (one line, without the path) unless ``general.architecture`` is supported; Gemma 3 has its own
    line while its switch (``gguf_gemma3.ENABLED``) is off."""
    from . import gguf_gemma3

    if arch in ARCHITECTURES:
        return
    if arch == "gemma3":
        raise GGUFError(gguf_gemma3.NOT_YET)
    raise GGUFError(f"general.architecture={arch!r} is not supported: one of {', '.join(SUPPORTED_ARCHITECTURES)}")
