"""Gemma 3 (GGUF ``general.architecture = gemma3``): its metadata as a :class:`Gemma3Spec`, its tensor names,
and the transformers ``Gemma3ForCausalLM`` config the same model has (which ``hf_config`` / ``hf_gemma`` map to
the ModelConfig). ``ENABLED`` registers the architecture in ``gguf_architectures``; with it False the
architecture is refused with ``NOT_YET``.

Metadata (``gemma3.`` + key; defaults are llama.cpp's and transformers' Gemma 3 values):
  embedding_length E, block_count L, attention.head_count H, attention.head_count_kv K, attention.key_length D
  (256; value_length must equal it), feed_forward_length F, context_length, attention.layer_norm_rms_epsilon
  (1e-6), rope.freq_base (global layers, 1e6), rope.freq_base_swa (window layers, 1e4), rope.scaling.type
  (none or linear with rope.scaling.factor: global layers only, as transformers applies it),
  attention.sliding_window W (absent or 0: every layer global), attention.sliding_window_pattern (an array of
  L booleans, true for a window layer, or a period n: layer i is a window layer when i % n < n - 1; default 6),
  final_logit_softcapping (absent: none), attn_logit_softcapping (absent for Gemma 3).
The query pre-attention scalar is not stored: as llama.cpp, E / H for the 62-layer (27B) model and D for every
other size (transformers' published configs say the same). Embeddings are scaled by sqrt(E) (the model's,
not the file's), the MLP is GeGLU with tanh GELU, and the head is tied when there is no ``output.weight``.

Tensors: as Llama's plus four norms per layer; llama.cpp's converter stores every ``*norm.weight`` as 1 + w
(Gemma's RMSNorm multiplies by 1 + w), so HF's w is the stored value + NORM_OFFSET (float32; exact for the F32
norms of converted files up to the rounding of the converter's own addition).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import GGUFError
from .gguf_metadata import Metadata
from .gguf_shapes import check_block_count, check_shapes, tensor_shape

ENABLED = True   # the one switch: the model runs Gemma 3's layers (its windows as masks over a full-length cache)
NOT_YET = ("general.architecture='gemma3' (Gemma 3) is not supported in this build; supported: llama, qwen2, "
           "qwen3, phi3")
NORM_OFFSET = -1.0
BLOCK_NAMES = {  # GGUF name inside blk.N -> HF Gemma3 name inside model.layers.N
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LAYER_27B = 62   # llama.cpp: the one size whose query scalar is E / H


@dataclass(frozen=True)
class Gemma3Spec:
    """A Gemma 3 model's shape and attention settings (module docstring for each source key).

    layer_types: per layer "sliding_attention" (attends to the last ``sliding_window`` positions, RoPE base
    rope_theta_local) or "full_attention" (every position, rope_theta and rope_scaling). query_pre_attn_scalar:
    scores are q . k / sqrt(query_pre_attn_scalar). Soft-capping: c tanh(x / c) when set, None otherwise.
    """

    dim: int
    num_blocks: int
    n_heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab_size: int
    max_context: int
    norm_eps: float
    rope_theta: float
    rope_theta_local: float
    rope_scaling: dict | None
    sliding_window: int | None
    layer_types: tuple[str, ...]
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    tie_embeddings: bool


def layer_types(m: Metadata, layers: int, window: int | None) -> tuple[str, ...]:
    """Per-layer kinds from ``attention.sliding_window_pattern`` (module docstring). GGUFError naming the key
    for an array whose length is not the layer count, or a period < 1."""
    if not window:
        return ("full_attention",) * layers
    pattern = m.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            m.refuse("attention.sliding_window_pattern", f"[{len(pattern)} values]",
                     f"one boolean per layer ({m.key('block_count')}={layers})")
        flags = pattern
    else:
        period = m.int("attention.sliding_window_pattern", 6)
        flags = [i % period < period - 1 for i in range(layers)]
    return tuple("sliding_attention" if f else "full_attention" for f in flags)


def _rope_scaling(m: Metadata) -> dict | None:
    kind = m.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        m.refuse("rope.scaling.type", kind, "'none' or 'linear' for gemma3")
    return {"rope_type": "linear", "factor": m.float("rope.scaling.factor")}


def gemma3_spec(m: Metadata, tensors: dict) -> Gemma3Spec:
    """The Gemma3Spec of a gemma3 file (m: its Metadata; tensors: name -> gguf.ReaderTensor, shapes checked
    against the metadata first). Raises GGUFError naming the key at fault."""
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{m.path}: tensor token_embd.weight is missing")
    E, H, L = m.int("embedding_length"), m.int("attention.head_count"), check_block_count(m, tensors)
    K, D, F = m.int("attention.head_count_kv", H), m.int("attention.key_length", 256), m.int("feed_forward_length")
    if m.int("attention.value_length", D) != D:
        m.refuse("attention.value_length", m.get("attention.value_length"), f"equal to the key length {D}")
    V = tensor_shape(tensors["token_embd.weight"])[0]
    e, h, k = "embedding_length", "attention.head_count", "attention.head_count_kv"
    norm, head_norm = ((E, e),), ((D, "attention.key_length"),)
    check_shapes(m, tensors, {
        "token_embd.weight": ((V, None), (E, e)), "output.weight": ((V, None), (E, e)), "output_norm.weight": norm,
        "attn_q.weight": ((H * D, h), (E, e)), "attn_k.weight": ((K * D, k), (E, e)),
        "attn_v.weight": ((K * D, k), (E, e)), "attn_output.weight": ((E, e), (H * D, h)),
        "attn_q_norm.weight": head_norm, "attn_k_norm.weight": head_norm,
        **{name: norm for name in ("attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
                                   "post_ffw_norm.weight")},
        "ffn_gate.weight": ((F, "feed_forward_length"), (E, e)), "ffn_up.weight": ((F, "feed_forward_length"), (E, e)),
        "ffn_down.weight": ((E, e), (F, "feed_forward_length"))})
    window = m.int("attention.sliding_window", 0, minimum=0) or None
    caps = {name: (m.float(name) if m.has(name) else None)
            for name in ("final_logit_softcapping", "attn_logit_softcapping")}
    return Gemma3Spec(
        dim=E, num_blocks=L, n_heads=H, kv_heads=K, head_dim=D, mlp_hidden=F, vocab_size=V,
        max_context=m.int("context_length"), norm_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=m.float("rope.freq_base", 1e6), rope_theta_local=m.float("rope.freq_base_swa", 1e4),
        rope_scaling=_rope_scaling(m), sliding_window=window, layer_types=layer_types(m, L, window),
        query_pre_attn_scalar=float(E // H if L == LAYER_27B else D),
        final_logit_softcapping=caps["final_logit_softcapping"],
        attn_logit_softcapping=caps["attn_logit_softcapping"], tie_embeddings="output.weight" not in tensors)


def hf_config(m: Metadata, tensors: dict) -> dict:
    """The transformers Gemma3ForCausalLM config.json (Gemma3TextConfig fields) of a gemma3 file."""
    s = gemma3_spec(m, tensors)
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": s.dim,
        "intermediate_size": s.mlp_hidden, "num_hidden_layers": s.num_blocks, "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_context, "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta,
        "rope_local_base_freq": s.rope_theta_local, "rope_scaling": s.rope_scaling,
        "sliding_window": s.sliding_window, "layer_types": list(s.layer_types),
        "query_pre_attn_scalar": s.query_pre_attn_scalar, "final_logit_softcapping": s.final_logit_softcapping,
        "attn_logit_softcapping": s.attn_logit_softcapping, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": s.tie_embeddings, "attention_bias": False,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id", raw=True),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id", raw=True), "torch_dtype": "float32",
    }
