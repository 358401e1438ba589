"""KV memory budgeting: bytes per sequence, the largest batch that fits, capacity for a mix of requests.

Every cache figure comes from the per-layer cache specs (``dantinox.kv.sizes``, summing
``dantinox.kv.spec.LayerSpec``), the same fields the allocator's arrays are made from, so
``kv_cache_bytes(cfg, B, cfg.max_context)`` equals, byte for byte, what ``init_cache(cfg, B)`` allocates
(tests/budget/test_planner.py checks it for every attention kind and dtype). Per layer and sequence of S tokens:
MHA / GQA / MQA 2 S K D elements, MLA S (C + R); int8 adds a float32 scale per row and the float32 rows of
the A attention-sink tokens; per-channel int8 keys store key scales per group of G tokens and a float32 ring of
2 G keys instead of per-token key scales (``dantinox.kv.channel_keys``).

Device memory is split as  device_bytes = reserve + weights + B x bytes_per_sequence, where
reserve = ceil(reserve_fraction x device_bytes) is explicit headroom for activations, XLA workspaces and
fragmentation, and weights are counted from a real parameter tree (``nnx.state(model, nnx.Param)``) or, from a
config, from the same tree built abstractly with ``nnx.eval_shape`` (no memory is allocated).

Admission rules for ``plan_capacity`` (how many tokens a sequence holds while it runs):
  "max_context"  every sequence reserves all max_context slots: the static cache of ``init_cache``.
  "request"      a sequence reserves prompt_tokens + max_new_tokens: what a paged cache allocating on demand
                 needs at its peak for that request.
Shapes and letters: see ``dantinox.kv.attend``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..generation.diffusion import dual_cache_bytes
from ..kv import sizes
from ..kv.channel_keys import check_group
from ..model.transformer import Transformer
from ..quant.weights import check_quantize, quantize_weights
from .per_device import _sizes, kv_split, weights_bytes_per_device

ADMISSION_RULES = ("max_context", "request")
MAX_DEVICE_BYTES = 2 ** 60  # 1 EiB: larger sizes are typos (and overflow the float reserve arithmetic)


def _as_config(cfg: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    return cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} is not allowed: a positive integer")
    return int(value)


def kv_bytes_per_token(cfg: ModelConfig | Mapping[str, Any], dtype: str | None = None) -> int:
    """Cache bytes one token takes across all layers with one scale per row (``dantinox.kv.sizes.
    nominal_token_bytes``: per-channel key groups counted as per-token scales, exact when G = D; kv_cache_bytes
    counts their real layout).

    dtype: cache dtype name ("float32", "bfloat16", "int8", "fp32", "bf16"; default cfg.cache_dtype).
    Raises ConfigError for an unknown dtype name.
    """
    return sizes.nominal_token_bytes(_as_config(cfg), dtype)


def kv_sink_bytes(cfg: ModelConfig | Mapping[str, Any], dtype: str | None = None) -> int:
    """Bytes of one sequence's float32 attention-sink rows across all layers (int8 caches only, else 0). The
    paged pool holds one such set per sink slot (``dantinox.kv.sink_slots``).
    Raises ConfigError for an unknown dtype name."""
    return sizes.sink_slot_bytes(_as_config(cfg), dtype)


def kv_cache_bytes(cfg: ModelConfig | Mapping[str, Any], batch: int, seq_len: int,
                   dtype: str | None = None) -> int:
    """Exact bytes of the KV cache for `batch` sequences of `seq_len` tokens each (``dantinox.kv.sizes``: every
    field of every layer, scales, key groups, residual ring and sinks included).

    The cache is the model's at a context of seq_len tokens (``cfg`` with max_context = seq_len: its key group
    and sinks fit that context), which may exceed cfg.max_context (to budget a longer context for the same
    shape); kv_cache_bytes(cfg, B, cfg.max_context) is init_cache(cfg, B)'s size.
    Raises ValueError for a non-positive batch or seq_len, ConfigError for an unknown dtype name.
    """
    batch = _positive_int("batch", batch)
    seq_len = _positive_int("seq_len", seq_len)
    cfg = _as_config(cfg)
    at_context = cfg if seq_len == cfg.max_context else cfg.replace(max_context=seq_len)
    return sizes.cache_bytes(at_context, batch, seq_len, dtype)


def channel_layout(cfg: ModelConfig, dtype: str | None = None) -> bool:
    """Does a cache of ``cfg`` in ``dtype`` (default cfg.cache_dtype) hold per-channel keys? cfg.channel_keys
    and an int8 dtype. Raises ConfigError for an unknown dtype name."""
    return sizes.with_dtype(cfg, dtype).channel_keys


def kv_channel_key_cache_bytes(cfg: ModelConfig | Mapping[str, Any], batch: int, seq_len: int, group: int) -> int:
    """Exact bytes of ``batch`` sequences of ``seq_len`` tokens in the per-channel int8 key layout (KIVI,
    ``dantinox.kv.channel_keys``: int8 keys and values, value scales per token, key scales per channel and
    group of ``group`` tokens, the filling group's keys in float32), every layer, sinks not included (a config
    with channel keys gets its whole static cache, sinks included, from ``kv_cache_bytes``). Raises ValueError
    for a bad batch, seq_len or group, or attention="mla"."""
    cfg = _as_config(cfg)
    if cfg.attention == "mla":
        raise ValueError("per-channel keys (--kv-keys channel) are defined for MHA / GQA / MQA caches, not "
                         "attention='mla' (its latent has no per-head keys)")
    batch, seq_len = _positive_int("batch", batch), _positive_int("seq_len", seq_len)
    channel = cfg.replace(cache_dtype="int8", kv_keys="channel", kv_key_group=check_group(group),
                          max_context=max(cfg.max_context, group))
    return batch * (sizes.cache_bytes(channel, 1, seq_len) - sizes.sink_slot_bytes(channel))


def param_bytes(source: ModelConfig | Mapping[str, Any] | nnx.Module, quantize: str | None = None) -> int:
    """Bytes of the model's parameters (nnx.Param leaves), int8 kernels and their float32 scales included.

    source: a built model (counted from its real parameter tree as it is, quantized or not) or a config (the
    Transformer is built with nnx.eval_shape, so only shapes and dtypes exist and nothing is allocated).
    quantize: for a config, count the weights as ``dantinox.quant.weights.quantize_weights`` stores them (None,
    "bf16", "int8", "int4" or "q8_0": Q4_1 / Q8_0 blocks, uint8). Raises ValueError for another quantize value,
    a width int4 / q8_0 cannot block (naming the tensor), or a quantize given with a built model.
    """
    check_quantize(quantize)
    if isinstance(source, nnx.Module):
        if quantize is not None:
            raise ValueError("quantize applies to a config; a built model is counted as it is stored")
        state = nnx.state(source, nnx.Param)
    else:
        cfg = _as_config(source)
        shape = nnx.eval_shape(lambda: quantize_weights(Transformer(cfg, rngs=nnx.Rngs(0)), quantize))
        state = nnx.state(shape, nnx.Param)
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(state)))


@dataclass(frozen=True)
class MemorySplit:
    """How device memory divides before any sequence is admitted (all in bytes)."""

    device_bytes: int
    reserve_bytes: int     # ceil(reserve_fraction x device_bytes): activations, workspaces, fragmentation
    weights_bytes: int
    kv_budget_bytes: int   # device - reserve - weights, what the KV cache may use (never negative)


def memory_split(cfg: ModelConfig | Mapping[str, Any], device_bytes: int, weights_bytes: int | None = None,
                 reserve_fraction: float = 0.1) -> MemorySplit:
    """Split device memory into reserve, weights and KV budget.

    weights_bytes: default param_bytes(cfg). Raises ValueError for a non-positive device_bytes, a negative
    weights_bytes, reserve_fraction outside [0, 1), or weights plus reserve larger than the device (the
    message says how many bytes are missing).
    """
    device_bytes = _positive_int("device_bytes", device_bytes)
    if device_bytes > MAX_DEVICE_BYTES:
        raise ValueError(f"device_bytes={device_bytes} is not allowed: at most 2**60 (1 EiB)")
    if not isinstance(reserve_fraction, (int, float)) or not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction={reserve_fraction!r} is not allowed: a number in [0, 1)")
    if weights_bytes is None:
        weights_bytes = param_bytes(cfg)
    elif not _non_negative_int(weights_bytes):
        raise ValueError(f"weights_bytes={weights_bytes!r} is not allowed: an integer >= 0 or None")
    reserve = math.ceil(round(device_bytes * reserve_fraction, 6))
    budget = device_bytes - reserve - int(weights_bytes)
    if budget < 0:
        raise ValueError(
            f"device memory {device_bytes} B is too small: weights {int(weights_bytes)} B plus reserve "
            f"{reserve} B ({reserve_fraction:.0%}) need {reserve + int(weights_bytes)} B, {-budget} B more "
            "than the device has")
    return MemorySplit(device_bytes, reserve, int(weights_bytes), budget)


def max_batch_size(cfg: ModelConfig | Mapping[str, Any], device_bytes: int, seq_len: int,
                   weights_bytes: int | None = None, reserve_fraction: float = 0.1,
                   dtype: str | None = None) -> int:
    """The largest number of sequences of seq_len tokens whose cache fits beside the weights and the reserve.

    floor((device_bytes - reserve - weights) / kv_cache_bytes(cfg, 1, seq_len, dtype)); 0 when the weights fit
    but not one sequence. For the static cache pass seq_len = cfg.max_context (init_cache allocates all
    slots).
    Raises ValueError (see memory_split, kv_cache_bytes) for bad sizes or weights that do not fit, and for a
    seq_len above cfg.max_context (the model cannot run it; use kv_cache_bytes to size a longer context).
    """
    cfg = _as_config(cfg)
    seq_len = _positive_int("seq_len", seq_len)
    if seq_len > cfg.max_context:
        raise ValueError(f"seq_len={seq_len} is not allowed: at most max_context={cfg.max_context}")
    per_sequence = kv_cache_bytes(cfg, 1, seq_len, dtype)
    return memory_split(cfg, device_bytes, weights_bytes, reserve_fraction).kv_budget_bytes // per_sequence


@dataclass(frozen=True)
class CapacityPlan:
    """How many sequences of a request mix fit at once (bytes are whole-model, all layers)."""

    admission: str                # "max_context" or "request" (see the module docstring)
    split: MemorySplit
    requests: int                 # requests in the mix (sum of the histogram counts)
    tokens_per_request: float     # mean cache slots a request reserves under the admission rule
    bytes_per_request: float      # mean cache bytes a request reserves
    max_concurrent: int           # floor(kv_budget / bytes_per_request): sequences in the mix's proportions
    mix_copies: int               # how many whole copies of the mix fit at once
    utilization: float            # tokens the mix uses / tokens it reserves (1.0 under "request")


def _normalise_mix(mix) -> list[tuple[int, int, int]]:
    """(prompt_tokens, max_new_tokens, count) triples from a list of pairs or a {pair: count} histogram."""
    items = mix.items() if isinstance(mix, Mapping) else ((pair, 1) for pair in mix)
    out = []
    for pair, count in items:
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"mix entry {pair!r} is not allowed: a (prompt_tokens, max_new_tokens) pair")
        prompt = _positive_int("prompt_tokens", pair[0])
        new = pair[1]
        if not _non_negative_int(new):
            raise ValueError(f"max_new_tokens={new!r} in mix entry {tuple(pair)} is not allowed: "
                             "an integer >= 0")
        if not _non_negative_int(count):
            raise ValueError(f"count={count!r} for mix entry {tuple(pair)} is not allowed: an integer >= 0")
        out.append((prompt, int(new), int(count)))
    if sum(c for _, _, c in out) == 0:
        raise ValueError("mix is empty: give (prompt_tokens, max_new_tokens) pairs or a histogram of them")
    return out


def plan_capacity(cfg: ModelConfig | Mapping[str, Any], device_bytes: int,
                  mix: Sequence[tuple[int, int]] | Mapping[tuple[int, int], int],
                  admission: str = "max_context", weights_bytes: int | None = None,
                  reserve_fraction: float = 0.1, dtype: str | None = None, mesh=None) -> CapacityPlan:
    """How many concurrent sequences of a request mix fit in device memory.

    mix: a list of (prompt_tokens, max_new_tokens) requests, or a histogram {(prompt, max_new): count}.
    admission: "max_context" (each sequence reserves all max_context slots, the static cache) or "request"
      (each reserves prompt + max_new_tokens).
    mesh: a Mesh or {"data": D, "model": M}: device_bytes is then ONE device's memory, weights default to
      the parameters per device (``dantinox.budget.per_device``), a sequence's cache bytes are divided by the
      ways the cache splits over model, and max_concurrent / mix_copies count all data replicas.
    Raises ValueError for an unknown admission rule, a malformed or empty mix, a request longer than
    cfg.max_context (it could never be served), and everything memory_split / kv_cache_bytes reject.
    """
    cfg = _as_config(cfg)
    if admission not in ADMISSION_RULES:
        raise ValueError(f"admission={admission!r} is not allowed: one of {ADMISSION_RULES}")
    entries = _normalise_mix(mix)
    for prompt, new, _ in entries:
        if prompt + new > cfg.max_context:
            raise ValueError(f"request (prompt {prompt}, max_new_tokens {new}) needs {prompt + new} cache "
                             f"slots, more than max_context={cfg.max_context}")
    replicas, ways = 1, 1
    if mesh is not None:  # per device (docs/how-to/multi-device.md)
        replicas = _sizes(mesh)["data"]
        ways = kv_split(cfg, mesh)
        weights_bytes = weights_bytes_per_device(cfg, mesh) if weights_bytes is None else weights_bytes
    split = memory_split(cfg, device_bytes, weights_bytes, reserve_fraction)
    requests = sum(c for _, _, c in entries)
    used = sum((p + n) * c for p, n, c in entries)
    reserved = cfg.max_context * requests if admission == "max_context" else used
    slots = (lambda p, n: cfg.max_context) if admission == "max_context" else (lambda p, n: p + n)
    # the whole mix, each request's own cache (its sinks, key groups and residual ring included)
    mix_bytes = sum(c * kv_cache_bytes(cfg, 1, slots(p, n), dtype) for p, n, c in entries if c) / ways
    return CapacityPlan(
        admission=admission, split=split, requests=requests, tokens_per_request=reserved / requests,
        bytes_per_request=mix_bytes / requests,
        max_concurrent=replicas * int(split.kv_budget_bytes * requests // mix_bytes),
        mix_copies=replicas * int(split.kv_budget_bytes // mix_bytes), utilization=used / reserved)


def diffusion_cache_bytes(cfg: ModelConfig | Mapping[str, Any], prompt_len: int, gen_len: int,
                          batch: int = 1) -> dict:
    """DualCache peak bytes of a masked-diffusion generation next to the AR static cache of the same shape.

    Returns {"dual_cache": bytes the DualCache holds (prefix [B, K, P, D] + suffix [B, K, M, D] keys and
    values over all layers; P = the bucketed prompt slots, see dantinox.generation.diffusion.prompt_slots),
    "ar_same_length": an AR cache of exactly prompt_len + gen_len tokens, "ar_static": init_cache's
    allocation (max_context slots), "ratio_same_length": dual_cache / ar_same_length}. The seeds' "+20-40%
    over the static AR cache" is not assumed: the ratio comes from the two formulas (prompt bucket padding
    is the only excess with this layout). Raises CapacityError if prompt_len + gen_len > max_context.
    """
    cfg = _as_config(cfg)
    batch = _positive_int("batch", batch)
    dual = dual_cache_bytes(cfg, _positive_int("prompt_len", prompt_len), _positive_int("gen_len", gen_len),
                            batch)
    same = kv_cache_bytes(cfg, batch, prompt_len + gen_len)
    return {"dual_cache": dual, "ar_same_length": same, "ar_static": kv_cache_bytes(cfg, batch, cfg.max_context),
            "ratio_same_length": dual / same}


UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


MAX_MEMORY_BYTES = 2 ** 60  # 1 EiB: anything larger is a typo, and would overflow float arithmetic


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_memory_size(text: str | int) -> int:
    """Bytes from "40GB" (10^9), "40GiB" (2^30), "512MiB", "2e9", "1.5 TB" (units are case-insensitive).

    Raises ValueError for anything else: no number, a negative or zero size, a size above 2^60 bytes (1 EiB),
    an unknown unit, or the ambiguous single letters K/M/G/T (write GB for 10^9 or GiB for 2^30).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str):
        raise ValueError(f"memory size {text!r} is not allowed: a string like 40GB, 40GiB, 512MiB or 2e9")
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"memory size {text!r} is not allowed: a positive number with an optional unit "
                         f"({UNIT_NAMES}), e.g. 40GB")
    number, unit = match.groups()
    if unit.lower() in ("k", "m", "g", "t"):
        raise ValueError(f"memory size {text!r}: unit {unit!r} is ambiguous; write {unit.upper()}B "
                         f"(powers of 1000) or {unit.upper()}iB (powers of 1024)")
    if unit and unit.lower() not in UNITS:
        raise ValueError(f"memory size {text!r}: unknown unit {unit!r}; allowed: {UNIT_NAMES}")
    try:
        exact = Decimal(number) * UNITS[unit.lower() if unit else "b"]
    except InvalidOperation as err:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"memory size {text!r} is not a number") from err
    if not exact.is_finite() or exact > MAX_MEMORY_BYTES:
        raise ValueError(f"memory size {text!r} is not allowed: at most 2^60 bytes (1 EiB)")
    size = int(exact)
    if size <= 0:
        raise ValueError(f"memory size {text!r} is not allowed: at least 1 byte")
    return size
