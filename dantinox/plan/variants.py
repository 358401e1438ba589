"""Model variants a candidate deployment may use: the KV cache dtype and the weight quantization.

``apply_variant`` returns the model to serve for (kv_dtype, quantize). KV dtypes are those ModelConfig accepts
(float32, bfloat16, int8); weight quantization is "none", "bf16", "int8", "int4" or "q8_0"
(``dantinox.quant.weights``; int4 / q8_0 are ggml Q4_1 / Q8_0 blocks, run by the block kernel, on one device
only). A variant that cannot be built raises ValueError naming it, and the planner drops the candidate with that reason
instead of guessing its cost or quality.
"""

from __future__ import annotations

from flax import nnx

from ..budget.memory import param_bytes
from ..config import ConfigError
from ..quant.kv_dtype import with_kv_dtype
from ..quant.weights import quantize_weights

QUANTIZE = ("none", "bf16", "int8", "int4", "q8_0")


def weight_bytes_factor(quantize: str) -> float:
    """Weight bytes relative to float32: none 1, bf16 1/2, int8 1/4 (+ per-channel scales, ignored), int4
    (Q4_1: 20 bytes per 32 weights) 5/32, q8_0 (34 bytes per 32) 17/64."""
    return {"none": 1.0, "bf16": 0.5, "int8": 0.25, "int4": 20 / 128, "q8_0": 34 / 128}[quantize]


def apply_variant(model, cfg, kv_dtype: str = "float32", quantize: str = "none"):
    """(model, cfg) for the variant. Raises ValueError for an unknown kv_dtype or quantize, naming it."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r} is not allowed: one of {QUANTIZE}")
    if kv_dtype != cfg.cache_dtype:
        try:
            model = with_kv_dtype(model, kv_dtype, "kv_dtype")
        except (ConfigError, ValueError) as err:
            raise ValueError(f"kv_dtype={kv_dtype!r} is not available: {err}") from None
        cfg = model.cfg
    if quantize != "none":
        model = quantize_weights(nnx.clone(model), quantize)  # in place: the float model stays as it was
    return model, cfg


def quantized_weight_bytes(cfg, weights_f32_bytes: int, quantize: str) -> tuple[int, bool]:
    """(weight bytes under ``quantize``, estimated?): counted by ``dantinox.budget.memory.param_bytes`` from the
    quantized parameter tree, so never an estimate (the flag stays in the plan format and is always False)."""
    if quantize == "none":
        return int(weights_f32_bytes), False
    return int(param_bytes(cfg, quantize)), False
