"""Model variants a candidate deployment may use: the KV cache dtype and the weight quantization.

``apply_variant`` returns the model to serve for (kv_dtype, quantize). KV dtypes are those ModelConfig accepts
(float32, bfloat16, and int8 once the quantized KV cache is in this version); weight quantization "none" is
always available, "bf16" / "int8" only where ``dantinox.weight_quant`` exists (the quantized-path issue). A
variant this version cannot build raises ValueError naming it, and the planner drops the candidate with that
reason instead of guessing its cost or quality.
"""

from __future__ import annotations

import dataclasses

QUANTIZE = ("none", "bf16", "int8")


def weight_bytes_factor(quantize: str) -> float:
    """Weight bytes relative to float32: none 1, bf16 1/2, int8 1/4 (+ per-channel scales, ignored)."""
    return {"none": 1.0, "bf16": 0.5, "int8": 0.25}[quantize]


def apply_variant(model, cfg, kv_dtype: str = "float32", quantize: str = "none"):
    """(model, cfg) for the variant. Raises ValueError for an unknown or unavailable kv_dtype / quantize."""
    from flax import nnx

    from ..config import ConfigError

    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r} is not allowed: one of {QUANTIZE}")
    if kv_dtype != cfg.cache_dtype:
        try:
            from ..kv_dtype import with_kv_dtype  # the quantized-path issue (int8 KV cache)
        except ImportError:
            with_kv_dtype = _rebuilt_with_cache_dtype
        try:
            model = with_kv_dtype(model, kv_dtype, "kv_dtype")
        except (ConfigError, ValueError) as err:
            raise ValueError(f"kv_dtype={kv_dtype!r} is not available in this version: {err}") from None
        cfg = model.cfg
    if quantize != "none":
        try:
            from ..weight_quant import quantize_weights  # the quantized-path issue
        except ImportError:
            raise ValueError(f"quantize={quantize!r} is not available in this version (dantinox.weight_quant is "
                             "missing)") from None
        model = quantize_weights(nnx.clone(model), quantize)  # in place: the float model stays as it was
    return model, cfg


def _rebuilt_with_cache_dtype(model, kv_dtype: str, flag: str):
    """The model rebuilt for cache_dtype=kv_dtype with the same parameters (before dantinox.kv_dtype)."""
    from flax import nnx

    from ..model import Transformer

    rebuilt = Transformer(dataclasses.replace(model.cfg, cache_dtype=kv_dtype), rngs=nnx.Rngs(0))
    nnx.update(rebuilt, nnx.state(model))
    return rebuilt


def quantized_weight_bytes(cfg, weights_f32_bytes: int, quantize: str) -> tuple[int, bool]:
    """(weight bytes under ``quantize``, estimated?): counted by dantinox.planner.param_bytes where it knows
    quantized weights, else float32 bytes x weight_bytes_factor (an estimate)."""
    if quantize == "none":
        return int(weights_f32_bytes), False
    try:
        from ..planner import param_bytes

        return int(param_bytes(cfg, quantize)), False
    except TypeError:  # this planner's param_bytes takes no quantize argument
        return int(weights_f32_bytes * weight_bytes_factor(quantize)), True
