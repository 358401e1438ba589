"""The bytes of a model's KV cache: the per-layer specs' figures (``dantinox.kv.spec``) summed over its layers.

This is the one place cache bytes are computed: the budget (``dantinox.budget``), the capacity plan
(``dantinox.plan``), ``dantinox budget`` / ``eval`` / ``serve``'s start-up line and the paged pool's sizing all
call these functions, and the specs derive every figure from the same field list that allocates the arrays,
so a printed byte count is what ``init_cache`` / ``init_pool`` allocate (tests/kv/test_sizes.py).

Static cache: ``cache_bytes(cfg, B, S)``, B sequences of S slots each (every field: rows, scales, key groups,
the residual ring, the float32 sinks). Paged pool: N blocks of P tokens (``page_bytes``), R sink slots
(``sink_slot_bytes``: one sequence's float32 sinks) and Q residual slots (``residual_slot_bytes``: one
running sequence's per-channel key ring), ``pool_bytes(cfg, N, P, R, Q)``. Per token: ``token_bytes`` (a key
group's scale row shared by its G tokens counts 1 / G per token). Every function takes an optional cache
``dtype`` name (default ``cfg.cache_dtype``) to price the same model with another cache.
"""

from __future__ import annotations

from ..config import ModelConfig, canonical_dtype, CACHE_DTYPES
from .spec import LayerSpec, layer_specs


def with_dtype(cfg: ModelConfig, dtype: str | None) -> ModelConfig:
    """cfg with cache_dtype = ``dtype`` (an alias such as "bf16" accepted), or cfg itself for None.
    Raises ConfigError for an unknown dtype name or one the model cannot hold (a diffusion model in int8)."""
    if dtype is None:
        return cfg
    name = canonical_dtype("cache_dtype", dtype, CACHE_DTYPES)
    return cfg if name == cfg.cache_dtype else cfg.replace(cache_dtype=name)


def specs(cfg: ModelConfig, dtype: str | None = None) -> tuple[LayerSpec, ...]:
    """The layer specs of ``cfg`` with its cache in ``dtype`` (default cfg.cache_dtype)."""
    return layer_specs(with_dtype(cfg, dtype))


def token_bytes(cfg: ModelConfig, dtype: str | None = None) -> float:
    """Bytes one token takes over all layers (int when every field is per token; a per-channel key cache
    adds 4 K D / G per layer and token for its group scales). Sinks and residual rings are per sequence."""
    total = sum(spec.token_bytes() for spec in specs(cfg, dtype))
    return int(total) if float(total).is_integer() else total


def cache_bytes(cfg: ModelConfig, batch: int, slots: int, dtype: str | None = None) -> int:
    """Bytes of a static cache of ``batch`` sequences of ``slots`` slots (``init_cache`` at slots =
    max_context, or a cache cut to ``slots``): batch x the sum over layers of ``LayerSpec.sequence_bytes``."""
    return int(batch) * sum(spec.sequence_bytes(int(slots)) for spec in specs(cfg, dtype))


def sequence_fixed_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes one sequence holds whatever its length (the float32 sinks and the residual ring, every layer)."""
    return sink_slot_bytes(cfg, dtype) + residual_slot_bytes(cfg, dtype)


def page_bytes(cfg: ModelConfig, block_size: int, dtype: str | None = None) -> int:
    """Bytes one paged block of ``block_size`` tokens takes over all layers (its block fields)."""
    return sum(spec.page_bytes(int(block_size)) for spec in specs(cfg, dtype))


def sink_slot_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of one sink slot over all layers: one sequence's float32 sink rows (0 for a float cache)."""
    return sum(spec.sink_slot_bytes() for spec in specs(cfg, dtype))


def residual_slot_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of one residual slot over all layers (per-channel keys' float32 rings; 0 otherwise)."""
    return sum(spec.residual_slot_bytes() for spec in specs(cfg, dtype))


def pool_bytes(cfg: ModelConfig, num_blocks: int, block_size: int, sink_slots: int = 0, residual_slots: int = 0,
               dtype: str | None = None) -> int:
    """Bytes of a paged pool of N = num_blocks blocks of P = block_size tokens with R = sink_slots sink slots and
    Q = residual_slots residual slots: N page_bytes + R sink_slot_bytes + Q residual_slot_bytes (what
    ``dantinox.kv.paged.init_pool`` allocates; sink or residual slots of a pool that has none cost 0)."""
    return (int(num_blocks) * page_bytes(cfg, block_size, dtype) + int(sink_slots) * sink_slot_bytes(cfg, dtype)
            + int(residual_slots) * residual_slot_bytes(cfg, dtype))


def tier_block_bytes(cfg: ModelConfig, block_size: int, first: bool = False, draft_cfg: ModelConfig | None = None,
                     dtype: str | None = None) -> int:
    """Bytes one prefix block takes in a KV tier (host memory, or a disk file's payload: ``dantinox.kv.tiers``):
    its page (``page_bytes``; with a draft model sharing the pool, the draft's page too) and, for a prefix's first
    block of an int8 pool (``first``), one sink slot's rows."""
    nbytes = page_bytes(cfg, block_size, dtype) + (sink_slot_bytes(cfg, dtype) if first else 0)
    return nbytes + (page_bytes(draft_cfg, block_size) if draft_cfg is not None else 0)


def blocks_for_memory(cfg: ModelConfig, memory_bytes: int, block_size: int, sink_slots: int = 0,
                      residual_slots: int = 0) -> int:
    """How many blocks of ``block_size`` tokens fit in ``memory_bytes`` of KV memory (floor), after
    ``sink_slots`` sink slots and ``residual_slots`` residual slots. Raises ValueError if not one block fits."""
    per_block = page_bytes(cfg, block_size)
    sinks, residual = sink_slot_bytes(cfg), residual_slot_bytes(cfg)
    count = max(int(memory_bytes) - int(sink_slots) * sinks - int(residual_slots) * residual, 0) // per_block
    if count < 1:
        raise ValueError(f"kv memory {int(memory_bytes)} bytes holds no block: one block of {block_size} "
                         f"tokens takes {per_block} bytes for this model"
                         + (f", after {int(sink_slots)} sink slots of {sinks} bytes" if sink_slots and sinks else ""))
    return count


def bytes_by_kind(cfg: ModelConfig, slots: int, dtype: str | None = None) -> dict[str, int]:
    """One sequence of ``slots`` slots split by layer kind ("full", "sliding", "latent"): {kind: bytes} over
    the layers of that kind (``dantinox budget`` and ``serve``'s start-up line show it)."""
    out: dict[str, int] = {}
    for spec in specs(cfg, dtype):
        out[spec.kind] = out.get(spec.kind, 0) + spec.sequence_bytes(int(slots))
    return out


def nominal_token_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes one token takes over all layers with one scale per row: 2 K D elements per layer for MHA / GQA /
    MQA, C + R for MLA, and for int8 a float32 scale per row (2 K (D + 4), or C + R + 8). Per-channel keys are
    counted as if their key scales were per token: exact when the key group G equals D, a per-token figure
    otherwise (``token_bytes`` and ``cache_bytes`` count their groups and ring as allocated). The figure a run
    directory's summary and the budget's per-token column print."""
    rows = with_dtype(cfg, dtype)
    if rows.channel_keys:
        rows = rows.replace(kv_keys="token")
    return int(token_bytes(rows))


def bytes_per_token_per_layer(cfg: ModelConfig, dtype: str | None = None) -> int:
    """``nominal_token_bytes`` of one layer (the first layer's spec): 2 K D elements for MHA / GQA / MQA, C + R
    for MLA; int8 adds a float32 scale per row. dtype: cache dtype name (default cfg.cache_dtype). Raises
    ConfigError for an unknown dtype name."""
    rows = with_dtype(cfg, dtype)
    if rows.channel_keys:
        rows = rows.replace(kv_keys="token")
    return int(layer_specs(rows)[0].token_bytes())


def sink_bytes_per_layer(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of one sequence's float32 sink rows in one layer (``dantinox.kv.sinks``): A x 2 K D x 4 (MLA:
    A x (C + R) x 4), 0 for float caches. dtype: cache dtype name (default cfg.cache_dtype)."""
    return specs(cfg, dtype)[0].sink_slot_bytes()
