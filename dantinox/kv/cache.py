"""A model's whole static cache: one layer per decoder block, allocated up front from the layers' specs.

``init_cache(cfg, B)`` is the pytree ``Transformer`` takes as ``kv_caches`` (``dantinox.kv.static`` has the
layer types and their writes): per layer ``LayerSpec.init_static(B, max_context)`` of ``dantinox.kv.spec``, so
its shapes, dtypes and bytes are the ones ``dantinox.kv.sizes`` counts. Shape letters: see
``dantinox.kv.attend``.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from .spec import layer_specs
from .static import KVCache


def init_cache(cfg: ModelConfig, batch_size: int) -> KVCache:
    """Allocate the whole cache up front, zeros in cfg.cache_dtype, one entry per layer: LayerKV(k, v) of
    [B, K, S, D] each, or for attention="mla" LatentKV(c_kv [B, S, C], k_rope [B, S, R]); for
    cache_dtype="int8" QuantLayerKV / QuantLatentKV (int8 rows, float32 scales [..., S, 1], float32 sinks), or
    with per-channel keys ChannelQuantLayerKV (``dantinox.kv.channel_layout``). S = max_context. Outside a trace
    on the CPU the pages are left to the operating system (``dantinox.kv.zero_pages``).

    Raises ValueError if batch_size is not a positive integer.
    """
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r} is not allowed: a positive integer")
    return tuple(spec.init_static(int(batch_size), spec.slots(cfg.max_context)) for spec in layer_specs(cfg))


def cache_shapes(cfg: ModelConfig, batch_size: int, slots: int | None = None) -> tuple:
    """Per layer, the shapes of its static arrays in field order for ``batch_size`` rows of ``slots`` slots
    (default max_context; fewer: a cache cut by ``first_slots``, whose sinks keep min(A, slots) rows); a sliding
    layer's ring (``LayerSpec.ring``) is never cut and keeps its R slots."""
    S = cfg.max_context if slots is None else int(slots)
    return tuple(tuple(shape for shape, _ in spec.static_shapes(int(batch_size), spec.ring or S))
                 for spec in layer_specs(cfg))
