"""The memory ledger of a candidate on one device: weights + KV pool + reserve against device memory.

Reuses dantinox.budget.memory: ``memory_split`` for the reserve (ceil(reserve_fraction x device bytes)) and
``kv_bytes_per_token`` for the pool (N blocks x P tokens x bytes per token, N = max_running x ceil(max_context
/ P), the engine's default pool). Weights are counted by ``param_bytes(cfg, quantize)`` where the planner
knows quantized weights, else estimated from the float32 bytes (variants.quantized_weight_bytes). A KV dtype
the planner does not know yet (int8 before the quantized cache lands) is estimated as 1 byte per element plus
one float32 scale per token, head and layer for keys and values, and marked as an estimate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..budget.memory import kv_bytes_per_token, memory_split
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
    except Exception:  # noqa: BLE001 - a dtype this version's planner does not know
        if kv_dtype != "int8":
            raise ValueError(f"kv_dtype={kv_dtype!r} is not allowed: float32, bfloat16 or int8") from None
        per_float = kv_bytes_per_token(cfg, "float32")
        heads = cfg.num_blocks * 2 * (cfg.kv_heads or cfg.n_heads)
        return per_float // 4 + heads * 4, True


def memory_ledger(cfg, candidate, weights_f32_bytes: int, device_bytes: int,
                  reserve_fraction: float = 0.1) -> Ledger:
    """The candidate's ledger per replica. Raises ValueError for a bad device size or dtype."""
    weights, w_estimated = quantized_weight_bytes(cfg, weights_f32_bytes, candidate.quantize)
    try:
        reserve = memory_split(cfg, device_bytes, weights, reserve_fraction).reserve_bytes
    except ValueError:  # weights + reserve exceed the device: the ledger shows by how much
        reserve = memory_split(cfg, device_bytes, 0, reserve_fraction).reserve_bytes
    per_token, estimated = kv_bytes_per_token_for(cfg, candidate.kv_dtype)
    blocks = candidate.max_running * -(-cfg.max_context // candidate.block_size)
    return Ledger(device_bytes, weights, blocks * candidate.block_size * per_token, reserve, blocks,
                  estimated or w_estimated)
