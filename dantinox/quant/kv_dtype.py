"""Choosing the KV cache dtype of a loaded model: ``--kv-dtype float32|bfloat16|int8`` (and fp32, f32, bf16).

The cache dtype is part of the model's config (``ModelConfig.cache_dtype``), and the attention layers read it
(an int8 cache makes them quantize keys and values before attending), so switching it means a model object
for the new config holding the same parameters. ``with_kv_dtype`` builds that; ``parse_kv_dtype`` checks a
user's flag value. Used by ``dantinox generate / verify / serve`` and by any caller that loads a run and
wants another cache dtype (``dantinox eval``).
"""

from __future__ import annotations

from flax import nnx

from ..config import CACHE_DTYPES, DTYPE_ALIASES, ConfigError, ModelConfig, canonical_dtype
from .block_linear import apply_block_layout, block_layout
from .weights import quantize_weights, weights_setting

KV_DTYPE_CHOICES = tuple(sorted(CACHE_DTYPES)) + tuple(sorted(DTYPE_ALIASES))


class KVDtypeError(ValueError):
    """A --kv-dtype value outside the allowed set, or a cache dtype the model's config cannot hold."""


def parse_kv_dtype(value: str, flag: str = "--kv-dtype") -> str:
    """The canonical cache dtype name ("float32", "bfloat16" or "int8") for a user's value (any case,
    aliases fp32 / f32 / bf16). Raises KVDtypeError naming ``flag``, the value and the allowed values."""
    try:
        return canonical_dtype("cache_dtype", value, CACHE_DTYPES)
    except ConfigError:
        raise KVDtypeError(f"{flag} {value!r} is not allowed: one of {', '.join(KV_DTYPE_CHOICES)}") from None


def config_with_kv_dtype(cfg: ModelConfig, value: str | None, flag: str = "--kv-dtype") -> ModelConfig:
    """cfg with cache_dtype set from ``value`` (None keeps cfg). Raises KVDtypeError for a bad value, or
    when the config cannot hold that cache (e.g. int8 with paradigm="diffusion"), naming the combination."""
    if value is None:
        return cfg
    dtype = parse_kv_dtype(value, flag)
    try:
        return cfg.replace(cache_dtype=dtype)
    except ConfigError as err:
        raise KVDtypeError(f"{flag} {value} cannot be used with this model: {err}") from None


def with_kv_dtype(model, value: str | None, flag: str = "--kv-dtype"):
    """The model itself when ``value`` is None or already its cache dtype; otherwise a new model of the same
    class for ``config_with_kv_dtype(model.cfg, value)`` holding the same parameter arrays (shared, not
    copied). Raises KVDtypeError as ``config_with_kv_dtype``."""
    return with_config(model, config_with_kv_dtype(model.cfg, value, flag))


def with_config(model, cfg: ModelConfig):
    """The model itself when ``cfg`` is its config; otherwise a new model of the same class for ``cfg`` holding
    the same parameter arrays (shared, not copied). ``cfg`` must describe the same parameters (e.g. another
    cache dtype or kv_sink_tokens); nnx raises when the shapes differ."""
    if cfg == model.cfg:
        return model
    weights, layout = weights_setting(model), block_layout(model)  # quantized weights: a twin with the same modules
    twin = nnx.eval_shape(lambda: _with_weights(type(model)(cfg, rngs=nnx.Rngs(0)), weights, layout))
    nnx.update(twin, nnx.state(model))
    return twin


def _with_weights(model, weights: str | None, layout: dict):
    """``model`` with its weights rewritten as ``weights`` (quantize_weights) or into the block ``layout``."""
    apply_block_layout(model, layout)
    return quantize_weights(model, weights)
