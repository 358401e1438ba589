"""dantinox: fast, memory-honest text generation with small decoder-only transformers, built around the KV cache."""

from . import _xla_setup  # noqa: F401  (XLA flags and the persistent compilation cache, before jax is used)
from .cache import (CapacityError, KVCache, LayerKV, QuantLayerKV, bytes_per_token_per_layer, cache_nbytes,
                    init_cache)
from .compile_count import CompileCounter, compile_totals
from .config import PRESETS, ConfigError, ModelConfig
from .diffusion import DiffusionResult, DualCache, diffusion_generate, diffusion_generate_result, init_dual_cache
from .generate import GenerationResult, generate, generate_result, stream_tokens
from .generator import Generator, bundled_run_dir
from .kv_dtype import KVDtypeError, parse_kv_dtype, with_kv_dtype
from .mla import LatentKV, MLAttention, QuantLatentKV
from .model import Transformer, build_model
from .planner import (CapacityPlan, MemorySplit, kv_bytes_per_token, kv_cache_bytes, max_batch_size,
                      memory_split, param_bytes, plan_capacity)
from .sampling import SamplingParams, make_sampling_params, sample_next
from .verify import VerifyReport, verify_cache
from .weight_quant import quantize_weights

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "CapacityError", "CapacityPlan", "CompileCounter", "ConfigError", "DiffusionResult", "DualCache",
    "GenerationResult", "Generator", "KVCache", "KVDtypeError", "LatentKV", "LayerKV", "MLAttention",
    "MemorySplit", "ModelConfig", "QuantLatentKV", "QuantLayerKV", "SamplingParams", "Transformer",
    "VerifyReport", "build_model", "bundled_run_dir", "bytes_per_token_per_layer", "cache_nbytes",
    "compile_totals", "diffusion_generate", "diffusion_generate_result", "generate", "generate_result",
    "init_cache", "init_dual_cache", "kv_bytes_per_token", "kv_cache_bytes", "make_sampling_params",
    "max_batch_size", "memory_split", "param_bytes", "parse_kv_dtype", "plan_capacity", "sample_next",
    "stream_tokens", "verify_cache", "with_kv_dtype", "quantize_weights",
]
