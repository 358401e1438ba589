"""Issue 19 item 10: ``serve --kv-memory`` sizes the pool to what ``--max-running`` sequences can use.

A 2 GB budget on the bundled model (int8 cache) used to allocate ~217 000 blocks and log "max concurrency
13563" while at most 16 sequences ever run; now the pool takes max_running x ceil(max_context / block_size)
blocks unless ``--kv-memory-all`` asks for every block the budget holds. The arithmetic is host-side
(``step_plan.pool_size``, no device); one engine is built on the bundled model to check the bytes it
allocates and the start-up line."""

import json
import os

import pytest

from dantinox.cli import entrypoint as cli
from dantinox.cli.serve import build_engine, kv_summary
from dantinox.config import ModelConfig
from dantinox.runs.bundled import bundled_run_dir
from dantinox.serving.engine import EngineConfig
from dantinox.serving.step_plan import pool_blocks, pool_size


def bundled_cfg(cache_dtype="float32", kv_keys="token") -> ModelConfig:
    """The bundled model's config; int8 with per-token keys unless kv_keys="channel" (the int8 default): the
    by-hand block bytes below are the per-token layout's."""
    with open(os.path.join(bundled_run_dir(), "config.json"), encoding="utf-8") as f:
        return ModelConfig.from_dict(json.load(f)).replace(cache_dtype=cache_dtype, kv_keys=kv_keys)


def channel_bytes_by_hand(cfg: ModelConfig, block_size: int, max_running: int) -> tuple[int, int]:
    """(bytes of one block, bytes of the residual rings) with per-channel int8 keys (G = 64), independently:
    a block is P tokens x L layers x (k and v: K heads x D int8 codes, plus a float32 value scale per head)
    plus P / G key-scale groups x L x K x D float32; a ring is 2 G float32 keys x L x K x D, one per running
    sequence."""
    L, K, D, G = cfg.num_blocks, cfg.kv_heads, cfg.head_size, 64
    block = block_size * L * (2 * K * D + K * 4) + block_size // G * L * K * D * 4
    return block, max_running * 2 * G * L * K * D * 4


def block_bytes_by_hand(cfg: ModelConfig, block_size: int) -> int:
    """Bytes of one block, written out independently of the library: P tokens x L layers x k and v x K heads
    x (D values of 4 bytes in float32, or D int8 values and one float32 scale in int8)."""
    per_head = cfg.head_size * 4 if cfg.cache_dtype == "float32" else cfg.head_size + 4
    return block_size * cfg.num_blocks * 2 * cfg.kv_heads * per_head


def sink_bytes_by_hand(cfg: ModelConfig, max_running: int) -> int:
    """Bytes of an int8 pool's attention sinks (K13), independently: 2 slots per running sequence x L layers x
    4 sink tokens x k and v x K heads x D float32 values; 0 for a float cache."""
    if cfg.cache_dtype != "int8":
        return 0
    return 2 * max_running * cfg.num_blocks * 4 * 2 * cfg.kv_heads * cfg.head_size * 4


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_budget_larger_than_max_running_can_use_is_capped(cache_dtype):
    cfg = bundled_cfg(cache_dtype)                                  # 4 layers, 2 KV heads of 32, context 256
    config = EngineConfig(kv_memory_bytes=2 * 10**9, max_running=16, block_size=16)
    size = pool_size(cfg, config)
    budget = (2 * 10**9 - sink_bytes_by_hand(cfg, 16)) // block_bytes_by_hand(cfg, 16)
    assert size.per_sequence == 256 // 16 and size.usable == 16 * 16
    assert size.budget == budget and budget > 50 * size.usable     # int8: 216985 blocks, 13561 requests
    assert size.capped and size.blocks == 256 == pool_blocks(cfg, config)
    everything = pool_size(cfg, EngineConfig(kv_memory_bytes=2 * 10**9, max_running=16, kv_memory_all=True))
    assert not everything.capped and everything.blocks == budget


def test_budget_smaller_than_usable_and_explicit_sizes_are_kept():
    cfg = bundled_cfg()
    small = pool_size(cfg, EngineConfig(kv_memory_bytes=100 * block_bytes_by_hand(cfg, 16) + 5, max_running=16))
    assert (small.blocks, small.capped, small.budget) == (100, False, 100)   # 6 full-context requests fit
    assert pool_size(cfg, EngineConfig(num_blocks=5000, max_running=16)).blocks == 5000
    assert pool_size(cfg, EngineConfig(max_running=3, block_size=32)).blocks == 3 * 8
    with pytest.raises(ValueError, match="holds no block"):
        pool_size(cfg, EngineConfig(kv_memory_bytes=10))


def test_serve_on_the_bundled_model_allocates_and_logs_what_it_can_use():
    """`dantinox serve --kv-memory 2GB --kv-dtype int8` as README writes it, without the HTTP part: per-channel
    keys (the int8 default), blocks of one key group (64 tokens), 16 residual rings and 32 sink slots."""
    args = cli.build_parser().parse_args(["serve", "--kv-memory", "2GB", "--kv-dtype", "int8"])
    engine, _, _ = build_engine(args)
    per_block, rings = channel_bytes_by_hand(bundled_cfg("int8"), 64, 16)
    sinks = sink_bytes_by_hand(bundled_cfg("int8"), 16)
    assert engine.cfg.channel_keys and engine.allocator.num_blocks == 16 * 256 // 64
    assert engine.stats()["kv_cache_bytes"] == 64 * per_block + sinks + rings       # 4.44 MiB: the rings 2 MiB
    line = kv_summary(engine)
    assert line.startswith(f"KV cache: 64 blocks = 4096 tokens, max concurrency 16 at 256 tokens per request "
                           f"(4.44 MiB = {64 * per_block + sinks + rings} bytes, block size 64, int8, keys per "
                           "channel in groups of 64)"), line
    assert f"takes those of the {(2 * 10**9 - sinks - rings) // per_block} --kv-memory holds" in line


def test_serve_with_per_token_keys_allocates_and_logs_what_it_can_use():
    """The same with --kv-keys token: the per-token pool, blocks of 16."""
    args = cli.build_parser().parse_args(["serve", "--kv-memory", "2GB", "--kv-dtype", "int8", "--kv-keys", "token"])
    engine, _, _ = build_engine(args)
    per_block, sinks = block_bytes_by_hand(bundled_cfg("int8"), 16), sink_bytes_by_hand(bundled_cfg("int8"), 16)
    assert engine.allocator.num_blocks == 256
    assert engine.stats()["kv_cache_bytes"] == 256 * per_block + sinks  # 2.50 MiB (0.25 of sinks), not 2 GB
    line = kv_summary(engine)
    assert line.startswith(f"KV cache: 256 blocks = 4096 tokens, max concurrency 16 at 256 tokens per request "
                           f"(2.50 MiB = {256 * per_block + sinks} bytes, block size 16, int8, keys per token)"), line
    assert f"takes those of the {(2 * 10**9 - sinks) // per_block} --kv-memory holds (--kv-memory-all" in line
    args = cli.build_parser().parse_args(["serve", "--kv-memory", "4MiB", "--kv-dtype", "int8", "--kv-keys", "token",
                                          "--kv-memory-all"])
    engine, _, _ = build_engine(args)
    assert engine.allocator.num_blocks == (4 * 2**20 - sinks) // per_block == 426
    line = kv_summary(engine)
    assert "max concurrency 16 at 256" in line and "--max-running 16 bounds the concurrency (26 would fit)" in line
