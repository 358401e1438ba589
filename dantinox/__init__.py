"""dantinox: fast, memory-honest text generation with small decoder-only transformers, built around the KV cache."""

from . import _launch  # noqa: F401  (first: the dantinox command's Ctrl-C while JAX imports is one line, exit 130)
from . import xla as _xla_setup  # noqa: F401  (XLA flags and the persistent compilation cache, before jax is used)
from ._version import __version__  # noqa: F401  (dantinox.__version__)
from .budget.memory import (CapacityPlan, MemorySplit, kv_bytes_per_token, kv_cache_bytes, max_batch_size,
                            memory_split, param_bytes, plan_capacity)
from .config import PRESETS, ConfigError, ModelConfig
from .generation.decode import GenerationResult, generate_result, stream_tokens
from .generation.diffusion import (DiffusionResult, DualCache, diffusion_generate, diffusion_generate_result,
                                   init_dual_cache)
from .generation.generator import Generator
from .generation.paradigm import generate
from .generation.sampling import SamplingParams, make_sampling_params, sample_next
from .kv.static import CapacityError, KVCache, LatentKV, LayerKV, QuantLatentKV, QuantLayerKV, cache_nbytes
from .kv.sizes import bytes_per_token_per_layer
from .kv.cache import init_cache
from .model.mla import MLAttention
from .model.transformer import Transformer, build_model
from .parallel.mesh import MeshError, make_mesh
from .parallel.sharding import shard_cache, shard_model
from .quality.verify import VerifyReport, verify_cache
from .quant.kv_dtype import KVDtypeError, parse_kv_dtype, with_kv_dtype
from .quant.weights import quantize_weights
from .runs.bundled import bundled_run_dir
from .xla import CompileCounter, compile_totals

__all__ = [
    "PRESETS", "CapacityError", "CapacityPlan", "CompileCounter", "ConfigError", "DiffusionResult", "DualCache",
    "GenerationResult", "Generator", "KVCache", "KVDtypeError", "LatentKV", "LayerKV", "MLAttention",
    "MemorySplit", "ModelConfig", "QuantLatentKV", "QuantLayerKV", "SamplingParams", "Transformer",
    "VerifyReport", "build_model", "bundled_run_dir", "bytes_per_token_per_layer", "cache_nbytes",
    "compile_totals", "diffusion_generate", "diffusion_generate_result", "generate", "generate_result",
    "init_cache", "init_dual_cache", "kv_bytes_per_token", "kv_cache_bytes", "make_sampling_params",
    "max_batch_size", "memory_split", "param_bytes", "parse_kv_dtype", "plan_capacity", "sample_next",
    "stream_tokens", "verify_cache", "with_kv_dtype", "quantize_weights",
    "MeshError", "make_mesh", "shard_cache", "shard_model",  # multi-device (docs/how-to/multi-device.md)
]
