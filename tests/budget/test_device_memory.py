"""Memory per device on a mesh, planned without devices (dantinox.budget.per_device, budget --mesh)."""

import pytest

import dantinox as dx
from dantinox.budget.memory import kv_cache_bytes, param_bytes
from dantinox.budget.per_device import (
    kv_bytes_per_sequence_per_device,
    mesh_shapes_for,
    plan_mesh,
    weights_bytes_per_device,
)
from dantinox.parallel.mesh import MeshError

SMOLLM2 = dx.ModelConfig(attention="gqa", kv_heads=3, dim=576, n_heads=9, head_size=64, num_blocks=30,
                         vocab_size=49152, max_context=2048, mlp_hidden=1536, tie_embeddings=True)


def by_hand_weights(cfg, M, embed_split=True):
    """Independent count: per block norms (replicated) + qkv, out, gate_up, down / M; embedding / M."""
    E, H, K, D, F, V = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_size, cfg.mlp_hidden, cfg.vocab_size
    block = 2 * E + (E * (H + 2 * K) * D + H * D * E + E * 2 * F + F * E) // M
    return 4 * (cfg.num_blocks * block + E + V * E // (M if embed_split else 1))


def test_one_device_equals_the_whole_model():
    cfg = dx.ModelConfig.from_preset("reference")
    plan = plan_mesh(cfg, dict(data=1, model=1), 10 ** 9)
    assert plan.weights_bytes == param_bytes(cfg)
    assert plan.kv_bytes_per_sequence == kv_cache_bytes(cfg, 1, cfg.max_context)


@pytest.mark.parametrize("M", [2, 4, 8])
def test_tensor_parallel_weights_and_kv_split(M):
    cfg = dx.ModelConfig.from_preset("reference-mha")
    sizes = dict(data=1, model=M)
    assert weights_bytes_per_device(cfg, sizes) == by_hand_weights(cfg, M)
    assert kv_bytes_per_sequence_per_device(cfg, sizes) == kv_cache_bytes(cfg, 1, cfg.max_context) // M


def test_gqa_cache_replicated_when_model_exceeds_kv_heads():
    cfg = dx.ModelConfig.from_preset("reference")  # kv_heads = 2
    whole = kv_cache_bytes(cfg, 1, cfg.max_context)
    assert kv_bytes_per_sequence_per_device(cfg, dict(data=1, model=2)) == whole // 2
    plan = plan_mesh(cfg, dict(data=1, model=4), 10 ** 9)
    assert plan.kv_bytes_per_sequence == whole and "replicated" in plan.cache_layout


def test_max_batch_counts_every_data_replica():
    cfg = dx.ModelConfig.from_preset("reference")
    device = 200 * 2 ** 20
    one = plan_mesh(cfg, dict(data=1, model=1), device)
    four = plan_mesh(cfg, dict(data=4, model=1), device)
    assert four.weights_bytes == one.weights_bytes  # data parallelism replicates the weights
    assert four.max_batch == 4 * one.max_batch
    assert one.max_batch == (device - one.reserve_bytes - one.weights_bytes) // one.kv_bytes_per_sequence
    plan = dx.plan_capacity(cfg, device, [(100, 100)], mesh=dict(data=4, model=2))
    two = plan_mesh(cfg, dict(data=4, model=2), device)
    assert plan.split.weights_bytes == two.weights_bytes
    assert plan.max_concurrent == two.max_batch  # every request reserves max_context slots


def test_smollm2_heads_do_not_split_over_two():
    assert weights_bytes_per_device(SMOLLM2, dict(data=8, model=1)) == param_bytes(SMOLLM2)
    with pytest.raises(MeshError, match="n_heads=9 is not divisible by mesh axis model=2"):
        weights_bytes_per_device(SMOLLM2, dict(data=1, model=2))
    assert mesh_shapes_for(4) == [dict(data=4, model=1), dict(data=2, model=2), dict(data=1, model=4)]


def test_budget_cli_mesh_table_and_bad_mesh(capsys):
    from dantinox.cli.entrypoint import main

    assert main(["budget", "--preset", "reference", "--device-memory", "80MB", "--mesh", "data=2,model=2"]) == 0
    out = capsys.readouterr().out
    assert "Per device on mesh data=2,model=2" in out and "cache split over KV heads: 1 of kv_heads=2" in out
    assert main(["budget", "--preset", "reference", "--mesh", "data=2,tensor=2"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and "--mesh 'data=2,tensor=2'" in err.err and len(err.err.strip().splitlines()) == 1
