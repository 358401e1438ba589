"""The memory ledger of a candidate on one device: weights + KV pool + reserve against device memory.

Reuses dantinox.budget.memory: ``memory_split`` for the reserve (ceil(reserve_fraction x device bytes)) and
``kv_bytes_per_token`` for the pool (N blocks x P tokens x bytes per token, N = max_running x ceil(max_context / P),
the engine's default pool). Weights are counted by ``param_bytes(cfg, quantize)`` (variants.quantized_weight_bytes),
the int8 cache's scales included by ``kv_bytes_per_token`` and its float32 attention-sink rows, one set per sink
slot of the pool (R = ``dantinox.serving.sink_slots.slots_for(max_running)`` slots of ``kv_sink_bytes`` each, as the
engine allocates them): every figure is counted, none estimated (the ledger's ``estimated`` field stays in the plan
format and is False)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..budget.memory import kv_bytes_per_token, kv_sink_bytes, memory_split
from ..serving.paged_cache import pool_bytes
from ..serving.sink_slots import slots_for
from .variants import quantized_weight_bytes


@dataclass(frozen=True)
class Ledger:
    """Bytes of one replica. fits: total <= device. estimated: the KV bytes are an estimate."""

    device: int
    weights: int
    kv: int
    reserve: int
    kv_blocks: int
    estimated: bool = False

    @property
    def total(self) -> int:
        """weights + kv + reserve, bytes."""
        return self.weights + self.kv + self.reserve

    @property
    def fits(self) -> bool:
        """total <= device."""
        return self.total <= self.device

    def to_dict(self) -> dict:
        """The fields plus total and fits (JSON-ready)."""
        return dict(asdict(self), total=self.total, fits=self.fits)


def kv_bytes_per_token_for(cfg, kv_dtype: str) -> tuple[int, bool]:
    """(bytes one token takes in the cache across layers, estimated?)."""
    try:
        return kv_bytes_per_token(cfg, kv_dtype), False
    except (ValueError, KeyError) as err:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not allowed: float32, bfloat16 or int8 ({err})") from None


def memory_ledger(cfg, candidate, weights_f32_bytes: int, device_bytes: int,
                  reserve_fraction: float = 0.1) -> Ledger:
    """The candidate's ledger per replica. Raises ValueError for a bad device size or dtype, or a block size
    that splits the per-channel key groups (kv_keys="channel" with an int8 candidate)."""
    weights, w_estimated = quantized_weight_bytes(cfg, weights_f32_bytes, candidate.quantize)
    try:
        reserve = memory_split(cfg, device_bytes, weights, reserve_fraction).reserve_bytes
    except ValueError:  # weights + reserve exceed the device: the ledger shows by how much
        reserve = memory_split(cfg, device_bytes, 0, reserve_fraction).reserve_bytes
    per_token, estimated = kv_bytes_per_token_for(cfg, candidate.kv_dtype)
    blocks = candidate.max_running * -(-cfg.max_context // candidate.block_size)
    sinks = kv_sink_bytes(cfg, candidate.kv_dtype)
    kv = blocks * candidate.block_size * per_token + (slots_for(candidate.max_running) * sinks if sinks else 0)
    variant = cfg.replace(cache_dtype=candidate.kv_dtype)
    if variant.channel_keys:   # raises ValueError for a block_size that is not a multiple of kv_key_group
        kv = pool_bytes(variant, blocks, candidate.block_size, slots_for(candidate.max_running),
                        candidate.max_running)
    return Ledger(device_bytes, weights, kv, reserve, blocks, estimated or w_estimated)
