"""The serving engine on a (1, 2) mesh: same tokens as on one device, pool split over KV heads (issue 13)."""

import jax
import pytest
from serving_util import SMALL_BUCKETS, drain, greedy, lively_mla_model, lively_model, make_engine

import dantinox as dx
from dantinox.parallel.mesh import make_mesh
from dantinox.serving.engine import EngineConfig
from dantinox.serving.sharded_engine import ShardedPagedEngine

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 32]]
SETTINGS = dict(block_size=4, max_running=4, max_batched_tokens=16, decode_buckets=(1, 4), **SMALL_BUCKETS)


def run_trace(engine) -> dict:
    for n, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, greedy(6 + n), request_id=f"r{n}")
    return drain(engine)


@pytest.mark.parametrize("kind", ["gqa", "mqa"])
def test_engine_on_two_devices_matches_one(kind):
    fields = {"gqa": dict(attention="gqa", kv_heads=2), "mqa": dict(attention="mqa"),
              "mla": dict(attention="mla", kv_latent_dim=16, rope_head_dim=8)}[kind]
    cfg = dx.ModelConfig.from_preset("tiny", num_blocks=1, max_context=32, **fields)
    build = lively_mla_model if kind == "mla" else lively_model
    want = run_trace(make_engine(build(cfg)))
    mesh = make_mesh(1, 2, devices=jax.devices()[:2])
    engine = ShardedPagedEngine(build(cfg), EngineConfig(**SETTINGS), mesh)
    engine.warmup()
    with dx.CompileCounter() as counted:
        got = run_trace(engine)
    assert got == want
    assert counted.compilations == 0
    split = "model" if kind == "gqa" else None
    spec = jax.sharding.PartitionSpec(None, None, split, None) if kind != "mla" else jax.sharding.PartitionSpec()
    layer = engine.pool[0]
    assert all(a.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), a.ndim) for a in layer)
    info = engine.blocks_per_device()
    whole = sum(a.nbytes for a in layer) * cfg.num_blocks
    assert info["bytes_per_device"] == (whole // 2 if kind == "gqa" else whole)


def test_kv_memory_is_per_device():
    cfg = dx.ModelConfig.from_preset("tiny", num_blocks=1, max_context=32, attention="gqa", kv_heads=2)
    mesh = make_mesh(1, 2, devices=jax.devices()[:2])
    one = make_engine(lively_model(cfg), kv_memory_bytes=64 * 1024, kv_memory_all=True)
    two = ShardedPagedEngine(lively_model(cfg), EngineConfig(**SETTINGS, kv_memory_bytes=64 * 1024,
                                                             kv_memory_all=True), mesh)
    assert two.allocator.num_blocks == 2 * one.allocator.num_blocks
    assert two.blocks_per_device()["bytes_per_device"] <= 64 * 1024
    # Without kv_memory_all both pools hold what max_running=4 sequences of 32 tokens can use: 4 x 8 blocks.
    capped = ShardedPagedEngine(lively_model(cfg), EngineConfig(**SETTINGS, kv_memory_bytes=64 * 1024), mesh)
    assert capped.allocator.num_blocks == 32 and capped.pool_size.budget == two.allocator.num_blocks
    assert make_engine(lively_model(cfg), kv_memory_bytes=64 * 1024).allocator.num_blocks == 32


def test_serve_cli_builds_a_sharded_engine_and_rejects_bad_meshes():
    import argparse

    from dantinox.cli.serve import add_serve_arguments, build_engine, check_serve_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    engine, _, _ = build_engine(parser.parse_args(["--mesh", "data=4,model=2", "--kv-memory", "1MiB"]))
    info = engine.blocks_per_device()
    assert info["devices"] == 8 and info["heads_per_device"] == 1 and info["bytes_per_device"] <= 2 ** 20
    with pytest.raises(ValueError, match=r"--mesh 'model=2,pipe=4'"):
        check_serve_args(parser.parse_args(["--mesh", "model=2,pipe=4"]))
    with pytest.raises(ValueError, match=r"--mesh 'data=2,model=4'.*n_heads=6 is not divisible"):
        build_engine(parser.parse_args(["--mesh", "data=2,model=4"]))
