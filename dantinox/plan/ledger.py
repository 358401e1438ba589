"""The memory ledger of a candidate on one device: weights + KV pool + reserve against device memory.

Reuses dantinox.budget.memory's ``memory_split`` for the reserve (ceil(reserve_fraction x device bytes)) and
``dantinox.kv.sizes.pool_bytes`` for the engine's default pool: N = max_running x ceil(max_context / P) blocks of
P tokens, R = ``dantinox.kv.sink_slots.slots_for(max_running)`` sink slots and max_running residual slots, as the
engine allocates them (every field of every layer spec: scales, key groups, sinks and rings included). Weights
are counted by ``param_bytes(cfg, quantize)`` (variants.quantized_weight_bytes): every figure is counted, none
estimated (the ledger's ``estimated`` field stays in the plan format and is False)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..budget.memory import memory_split
from ..kv.sizes import pool_bytes, with_dtype
from ..kv.sink_slots import slots_for
from ..serving.step_plan import default_block_size
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


def memory_ledger(cfg, candidate, weights_f32_bytes: int, device_bytes: int,
                  reserve_fraction: float = 0.1) -> Ledger:
    """The candidate's ledger per replica. Raises ValueError for a bad device size or dtype, or a block size
    that splits the per-channel key groups (an int8 candidate of a model with kv_keys="channel", the default;
    the message names the candidate and the block sizes that work)."""
    weights, w_estimated = quantized_weight_bytes(cfg, weights_f32_bytes, candidate.quantize)
    try:
        reserve = memory_split(cfg, device_bytes, weights, reserve_fraction).reserve_bytes
    except ValueError:  # weights + reserve exceed the device: the ledger shows by how much
        reserve = memory_split(cfg, device_bytes, 0, reserve_fraction).reserve_bytes
    try:
        variant = with_dtype(cfg, candidate.kv_dtype)
    except (ValueError, KeyError) as err:
        raise ValueError(f"kv_dtype={candidate.kv_dtype!r} is not allowed: float32, bfloat16 or int8 ({err})") from None
    P = candidate.block_size or default_block_size(variant)         # None: serve's default for the model
    if variant.channel_keys and P % variant.key_group:   # per-channel int8 keys: whole key groups per block
        raise ValueError(f"candidate {getattr(candidate, 'name', '?')!r}: block_size={P} is not allowed with "
                         f"kv_dtype=int8: the int8 cache keeps keys per channel in groups of "
                         f"{variant.key_group} tokens (kv_key_group), and a block must hold whole groups (give "
                         f"block_size={default_block_size(variant)} or another multiple of {variant.key_group}, "
                         "or leave it out)")
    blocks = candidate.max_running * -(-cfg.max_context // P)
    kv = pool_bytes(variant, blocks, P, slots_for(candidate.max_running), candidate.max_running)
    return Ledger(device_bytes, weights, kv, reserve, blocks, w_estimated)
