"""A transformers ``config.json`` dict -> the dantinox ModelConfig that computes the same function.

Supported ``architectures`` (transformers class names) and what each maps to:

  LlamaForCausalLM     GQA/MHA/MQA, SwiGLU, RMSNorm; rope_scaling none, "linear", "llama3" or "yarn"
  MistralForCausalLM   as Llama plus ``sliding_window`` (ModelConfig.sliding_window: a query sees the last W
                       positions, itself included, as transformers' sliding-window mask)
  Qwen2ForCausalLM     as Llama plus a bias on the q, k and v projections (ModelConfig.qkv_bias)
  Qwen3ForCausalLM     as Llama plus an RMSNorm over each query and key head (ModelConfig.qk_norm); head_dim
                       may differ from hidden_size / num_attention_heads
  Phi3ForCausalLM      as Mistral (``sliding_window`` on every layer when set) with fused weights (qkv_proj,
                       gate_up_proj: split by rows in ``hf_weights``); partial_rotary_factor must be 1 and
                       rope_scaling none (Phi-3's LongRoPE "longrope" / "su" is refused)
  Gemma3ForCausalLM    Gemma 3's text decoder (model_type gemma3_text) and Gemma2ForCausalLM without attention
                       soft-capping: four (1 + w) norms per block, GeGLU, scaled embeddings, QK norm (Gemma 3),
                       the query pre-attention scalar, final-logit soft-capping, per-layer sliding windows and
                       local / global RoPE bases (``hf_gemma``)
  DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
                       multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1):
                       q_lora_rank -> q_latent_dim, kv_lora_rank -> kv_latent_dim, qk_nope_head_dim ->
                       head_size, qk_rope_head_dim -> rope_head_dim, v_head_dim -> v_head_size; only when every
                       layer is dense (first_k_dense_replace >= num_hidden_layers); with a rope_scaling
                       that has mscale_all_dim, the softmax scale is multiplied by yarn_mscale(factor,
                       mscale_all_dim)^2 as transformers' DeepSeek attention does

Anything else that would change the function is refused with :class:`CheckpointError` naming the field and
value: another architecture, mixture-of-experts layers, an activation other than SiLU, biases the model does
not have, partial rotary embeddings, a rope_scaling type not listed above (dynamic, longrope, ...), Qwen's
per-layer sliding windows. Fields that do not change the
function (dropout, initializer range, torch dtype, token ids) are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import ConfigError, ModelConfig
from .errors import CheckpointError
from .hf_gemma import GEMMA, NORM_OFFSET, gemma_fields
from .hf_gemma import MODEL_TYPES as GEMMA_MODEL_TYPES

LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
ARCHITECTURES = LLAMA_LIKE + GEMMA + DEEPSEEK
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", **GEMMA_MODEL_TYPES}
DEFAULT_MAX_CONTEXT = 8192      # static cache slots when the checkpoint allows more and --max_context is not given
DEEPSEEK_LATENT_EPS = 1e-6      # transformers' DeepSeek q_a_layernorm / kv_a_layernorm ignore rms_norm_eps


@dataclass(frozen=True)
class ImportSpec:
    """What an import needs beyond the ModelConfig.

    cfg: the dantinox ModelConfig. architecture: the transformers class name. rope_interleaved: the checkpoint
    rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek) where dantinox rotates halves (x_i, x_{i+R/2}),
    so the weight converter permutes the rotary output rows of the query and RoPE-key projections.
    context_note: a line for the user when max_context was capped below the checkpoint's, else None.
    norm_offset: added (float32) to every RMSNorm weight to give the scale dantinox multiplies by: 1 for
    Gemma, whose norms multiply by 1 + w; 0 otherwise.
    """

    cfg: ModelConfig
    architecture: str
    rope_interleaved: bool
    context_note: str | None = None
    norm_offset: float = 0.0


def refuse(name: str, value: Any, why: str) -> None:
    """Raise CheckpointError for config.json field ``name`` holding ``value``."""
    raise CheckpointError(f"config.json: {name}={value!r} is not supported: {why}")


def import_spec(hf: Mapping[str, Any], dtype: str = "float32", max_context: int | None = None) -> ImportSpec:
    """The ImportSpec of a transformers config dict.

    dtype: "float32" or "bfloat16", the run's compute and cache dtype (weights stay float32 in the run
    directory). max_context: static cache slots S (default: the checkpoint's max_position_embeddings, at most
    DEFAULT_MAX_CONTEXT). Raises CheckpointError naming the first field that dantinox cannot run exactly, or a
    ModelConfig validation failure.
    """
    if not isinstance(hf, Mapping):
        raise CheckpointError(f"config.json: expected a JSON object, got {type(hf).__name__}")
    arch = _architecture(hf)
    common = _common_fields(hf, arch)   # sizes checked first: the architecture's fields read them
    if arch in GEMMA:
        fields, interleaved = gemma_fields(hf, arch, _rope_parameters), False
    else:
        fields, interleaved = (_deepseek_fields(hf, arch) if arch in DEEPSEEK else (_llama_fields(hf, arch), False))
    limit = _int(hf, "max_position_embeddings")
    chosen = max_context or min(limit, DEFAULT_MAX_CONTEXT)
    if chosen > limit:
        raise CheckpointError(f"--max_context={chosen} is not allowed: at most the checkpoint's "
                              f"max_position_embeddings={limit}")
    note = (f"max_context={chosen} cache slots (the checkpoint allows {limit}; set --max_context to change it)"
            if chosen < limit and max_context is None else None)
    fields.update({k: v for k, v in common.items() if k not in fields}, max_context=chosen, compute_dtype=dtype,
                  cache_dtype=dtype)
    try:
        return ImportSpec(ModelConfig(**fields), arch, interleaved, note, NORM_OFFSET if arch in GEMMA else 0.0)
    except ConfigError as err:
        raise CheckpointError(f"config.json: {err}") from err


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures")
    if archs is None and hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        refuse("architectures", archs, f"exactly one of {list(ARCHITECTURES)}")
    return archs[0]


def _int(hf: Mapping[str, Any], name: str, default: Any = None) -> int:
    value = hf.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        refuse(name, value, "a positive integer")
    return value


def _common_fields(hf: Mapping[str, Any], arch: str) -> dict:
    """Fields every supported architecture shares: sizes, norm eps, activation, tied head, RoPE base (Gemma's
    activation, tied default and RoPE: ``hf_gemma``, whose fields take precedence)."""
    gemma = arch in GEMMA
    if not gemma and hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", hf.get("hidden_act"), "'silu' (dantinox's MLP is SwiGLU)")
    if hf.get("mlp_bias", False):
        refuse("mlp_bias", hf["mlp_bias"], "false (dantinox's MLP has no biases)")
    eps = hf.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        refuse("rms_norm_eps", eps, "a positive number")
    tied = hf.get("tie_word_embeddings", gemma)   # transformers' default: tied for Gemma, untied otherwise
    if not isinstance(tied, bool):
        refuse("tie_word_embeddings", tied, "true or false")
    out = dict(dim=_int(hf, "hidden_size"), n_heads=_int(hf, "num_attention_heads"),
               num_blocks=_int(hf, "num_hidden_layers"), vocab_size=_int(hf, "vocab_size"),
               mlp_hidden=_int(hf, "intermediate_size"), norm_eps=float(eps), tie_embeddings=tied)
    if not gemma:
        out["rope_theta"] = float(_rope_parameters(hf)[0])
    return out


def _rope_parameters(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from either spelling: ``rope_theta`` + ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5). scaling is None for the default type, else a dict with "type"."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        refuse("rope_scaling", scaling, "null or an object")
    params.update(scaling or {})
    theta = hf.get("rope_theta", params.pop("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        refuse("rope_theta", theta, "a positive number")
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse("partial_rotary_factor", partial, "1.0 (every head dim rotates)")
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"type": "linear", "factor": params.get("factor")}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, {"type": "llama3", **{k: params.get(k) for k in keys}}
    if kind == "yarn":
        return theta, _yarn(hf, params)
    refuse("rope_scaling.rope_type", kind, "'default', 'linear', 'llama3' or 'yarn' (other scalings are not "
           "implemented, and an approximate model is never built)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(hf: Mapping[str, Any], params: dict) -> dict:
    """The resolved YaRN parameters, with transformers' defaults: original context from the top-level
    ``original_max_position_embeddings`` if present, else the rope parameters', else max_position_embeddings;
    factor from the ratio of the two when missing; beta_fast 32, beta_slow 1, truncate true; attention_factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, else mscale(factor)."""
    original = (hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings"))
    factor = params.get("factor") or (hf.get("max_position_embeddings", 0) / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor))
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": params.get("beta_fast") or 32, "beta_slow": params.get("beta_slow") or 1,
            "attention_factor": attention_factor, "truncate": params.get("truncate", True)}


def _llama_fields(hf: Mapping[str, Any], arch: str) -> dict:
    """Attention fields of Llama, Mistral, Qwen2, Qwen3 and Phi-3."""
    heads = _int(hf, "num_attention_heads")
    kv = _int(hf, "num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or _int(hf, "hidden_size") // heads
    attention = "mha" if kv == heads else "mqa" if kv == 1 else "gqa"
    if hf.get("attention_bias", False) and arch != "Qwen2ForCausalLM":
        refuse("attention_bias", hf["attention_bias"], f"false for {arch} (dantinox's output projection has "
               "no bias)")
    fields = dict(attention=attention, kv_heads=None if attention != "gqa" else kv, head_size=head_dim,
                  qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
                  rope_scaling=_rope_parameters(hf)[1])
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        fields["sliding_window"] = hf.get("sliding_window")
    elif arch.startswith("Qwen") and hf.get("use_sliding_window", False):
        refuse("use_sliding_window", True, f"false for {arch} (its per-layer windows are not implemented)")
    elif hf.get("sliding_window") is not None and arch == "LlamaForCausalLM":
        refuse("sliding_window", hf["sliding_window"], "null for LlamaForCausalLM")
    types = hf.get("layer_types")
    if types is not None and set(types) - {"full_attention"} and arch not in ("MistralForCausalLM", "Phi3ForCausalLM"):
        refuse("layer_types", sorted(set(types)), "only 'full_attention' layers")
    return fields


def _deepseek_fields(hf: Mapping[str, Any], arch: str) -> tuple[dict, bool]:
    """MLA fields of DeepSeek-V2/V3 (dense layers only) and whether the RoPE pairs are interleaved."""
    layers, dense = _int(hf, "num_hidden_layers"), hf.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or dense < layers:
        refuse("first_k_dense_replace", dense, f">= num_hidden_layers={layers}: layers {dense}..{layers - 1} "
               "would be mixture-of-experts, which dantinox does not run")
    heads = _int(hf, "num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        refuse("num_key_value_heads", hf["num_key_value_heads"], f"equal to num_attention_heads={heads} for "
               "MLA (every head up-projects its own key and value)")
    if hf.get("attention_bias", False):
        refuse("attention_bias", hf["attention_bias"], f"false for {arch}")
    scaling = _rope_parameters(hf)[1]
    q_rank, nope, rope = hf.get("q_lora_rank"), _int(hf, "qk_nope_head_dim"), _int(hf, "qk_rope_head_dim")
    fields = dict(attention="mla", kv_heads=None, head_size=nope, rope_head_dim=rope,
                  v_head_size=_int(hf, "v_head_dim"), kv_latent_dim=_int(hf, "kv_lora_rank"),
                  q_latent_dim=None if q_rank is None else _int(hf, "q_lora_rank"),
                  mla_norm_eps=DEEPSEEK_LATENT_EPS, rope_scaling=scaling)
    raw = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    if scaling is not None and raw.get("mscale_all_dim"):  # DeepSeek's softmax scale times mscale^2
        fields["attention_scale"] = (nope + rope) ** -0.5 * yarn_mscale(raw["factor"], raw["mscale_all_dim"]) ** 2
    interleaved = arch == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True))
    return fields, interleaved
