"""The config.json of Gemma 3 (``Gemma3ForCausalLM``, model_type ``gemma3_text``) and Gemma 2
(``Gemma2ForCausalLM``) -> the ModelConfig fields that compute the same function.

What the Gemma decoder adds to Llama's, and the field each becomes (transformers' ``modeling_gemma3`` /
``modeling_gemma2``; Gemma Team 2024, "Gemma 2", section 2; Gemma Team 2025, "Gemma 3 Technical Report",
section 2):
  four RMSNorms per block (input, post-attention, pre-feedforward, post-feedforward) -> sandwich_norms; each
      Gemma norm multiplies by (1 + w): ``hf_weights`` stores 1 + w (float32, as transformers computes it), so
      the model's RMSNorm is unchanged (ImportSpec.norm_offset = 1)
  hidden_activation gelu_pytorch_tanh                    -> mlp_activation "gelu_tanh" (GeGLU)
  embeddings times sqrt(hidden_size)                     -> embed_scale
  query_pre_attn_scalar s (scores q . k / sqrt(s))       -> attention_scale = s ** -0.5
  final_logit_softcapping c                              -> final_logit_softcap
  Gemma 3: q_norm / k_norm per head                      -> qk_norm
  layer_types, or sliding_window_pattern n (layer i slides when (i + 1) % n != 0; Gemma 3's default 6,
      Gemma 2's 2), and sliding_window W                 -> layer_types, sliding_window
  Gemma 3: rope_theta and rope_scaling for the full layers, rope_local_base_freq for the sliding ones
      (transformers 4), or rope_parameters {"full_attention": ..., "sliding_attention": ...} (transformers 5)
                                                         -> rope_theta, rope_scaling, rope_local_theta
Defaults for absent keys are transformers' (Gemma3TextConfig / Gemma2Config). Refused, naming the field:
attn_logit_softcapping (Gemma 2's attention-score soft-capping: the cache's attention has no soft-capping, and
an approximate model is never built), use_bidirectional_attention, attention_bias, another activation, scaled
RoPE on the sliding layers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .errors import CheckpointError

GEMMA = ("Gemma3ForCausalLM", "Gemma2ForCausalLM")
MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}   # transformers' ACT2FN name -> ModelConfig.mlp_activation
DEFAULTS = {  # transformers' defaults for keys a config.json may leave out
    "Gemma3ForCausalLM": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, pattern=6,
                              rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, final_logit_softcapping=None,
                              attn_logit_softcapping=None),
    "Gemma2ForCausalLM": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, pattern=2,
                              rope_theta=10_000.0, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
}
NORM_OFFSET = 1.0   # Gemma's RMSNorm scales by 1 + w


def _refuse(name: str, value: Any, why: str) -> None:
    raise CheckpointError(f"config.json: {name}={value!r} is not supported: {why}")


def _positive(hf: Mapping[str, Any], name: str, default: Any, optional: bool = False):
    value = hf.get(name, default)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        _refuse(name, value, "a positive number" + (" or null" if optional else ""))
    return value


def gemma_fields(hf: Mapping[str, Any], arch: str, rope_parameters) -> dict:
    """The attention, MLP, norm and RoPE fields of a Gemma 3 / Gemma 2 config (module docstring).

    rope_parameters(config) -> (theta, scaling or None): ``hf_config``'s reader of one rope parameter set
    (either spelling). Raises CheckpointError naming the first field dantinox cannot run exactly."""
    d = DEFAULTS[arch]
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads", heads)
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
        _refuse("num_key_value_heads", kv, f"a divisor of num_attention_heads={heads}")
    if hf.get("attention_bias", False):
        _refuse("attention_bias", hf["attention_bias"], f"false for {arch}")
    if hf.get("use_bidirectional_attention"):
        _refuse("use_bidirectional_attention", hf["use_bidirectional_attention"], "false (a causal decoder)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        _refuse("hidden_activation", act, f"one of {sorted(ACTIVATIONS)} for {arch} (GeGLU with tanh GELU)")
    cap = hf.get("attn_logit_softcapping", d["attn_logit_softcapping"])
    if cap is not None:
        _refuse("attn_logit_softcapping", cap, "null (attention-score soft-capping is not implemented; an "
                "approximate model is never built)")
    attention = "mha" if kv == heads else "mqa" if kv == 1 else "gqa"
    window, types = _windows(hf, arch)
    theta, scaling, local = _rope(hf, arch, rope_parameters, "sliding_attention" in (types or ()))
    return dict(attention=attention, kv_heads=kv if attention == "gqa" else None,
                head_size=hf.get("head_dim") or d["head_dim"], qkv_bias=False, qk_norm=arch == "Gemma3ForCausalLM",
                mlp_activation=ACTIVATIONS[act], sandwich_norms=True,
                embed_scale=math.sqrt(hf.get("hidden_size")),
                attention_scale=_positive(hf, "query_pre_attn_scalar", d["query_pre_attn_scalar"]) ** -0.5,
                final_logit_softcap=_positive(hf, "final_logit_softcapping", d["final_logit_softcapping"], True),
                sliding_window=window, layer_types=types, rope_theta=float(theta), rope_scaling=scaling,
                rope_local_theta=local)


def _windows(hf: Mapping[str, Any], arch: str) -> tuple[int | None, tuple | None]:
    """(sliding_window, layer_types): from layer_types, else sliding_window_pattern; (None, None) when no
    layer slides."""
    layers = hf.get("num_hidden_layers")
    window = hf.get("sliding_window", DEFAULTS[arch]["sliding_window"])
    types = hf.get("layer_types")
    if types is None:
        n = hf.get("sliding_window_pattern", DEFAULTS[arch]["pattern"])
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            _refuse("sliding_window_pattern", n, "a positive integer (every n-th layer is global)")
        types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        _refuse("layer_types", types, f"a list of num_hidden_layers={layers} entries")
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        _refuse("layer_types", bad, "entries 'full_attention' or 'sliding_attention'")
    if "sliding_attention" not in types:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        _refuse("sliding_window", window, "a positive integer (the sliding layers' window)")
    return window, tuple(types)


def _rope(hf: Mapping[str, Any], arch: str, rope_parameters, sliding: bool):
    """(theta, scaling, local theta or None) of the full and the sliding layers (module docstring)."""
    params = hf.get("rope_parameters")
    if arch != "Gemma3ForCausalLM":
        theta, scaling = rope_parameters({"rope_theta": DEFAULTS[arch]["rope_theta"], **hf})
        return theta, scaling, None
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", DEFAULTS[arch]["rope_theta"])
        local.setdefault("rope_theta", DEFAULTS[arch]["rope_local_base_freq"])
        theta, scaling = rope_parameters({"rope_parameters": full})
        local_theta, local_scaling = rope_parameters({"rope_parameters": local})
        where = "rope_parameters.sliding_attention"
    else:
        theta, scaling = rope_parameters({"rope_theta": DEFAULTS[arch]["rope_theta"], **hf})
        local_theta = _positive(hf, "rope_local_base_freq", DEFAULTS[arch]["rope_local_base_freq"])
        local_scaling, where = None, "rope_local_base_freq"
    if local_scaling is not None:
        _refuse(where, local, "plain RoPE on the sliding layers (rope_type 'default')")
    return theta, scaling, float(local_theta) if sliding else None
