"""Block weights on a (data, model) mesh (issue 23): a GGUF Q4_1 import and a float model quantized with
--quantize int4 decode the same greedy tokens on 4 of the 8 forced CPU devices as on one; the block data is
split by whole rows over "model" and the compiled kernel runs inside a shard_map, on each device's rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf_util import write_tiny_gguf

import dantinox as dx
from dantinox.cli import entrypoint as cli
from dantinox.parallel.mesh import make_mesh, mesh_scope
from dantinox.quant.block_kernel import block_matmul, kernel_status
from dantinox.quant.weights import quantize_weights
from dantinox.runs.run_dir import load_run

MESHES = [(1, 4), (2, 2)]
PROMPTS = [[5, 17, 60, 3, 9], [100, 2, 7, 7, 1]]
SMALL = dict(dim=64, n_heads=4, head_size=16, num_blocks=2, vocab_size=200, max_context=64, mlp_hidden=128,
             attention="gqa", kv_heads=2)


@pytest.fixture(scope="module")
def q4_1_run(tmp_path_factory):
    import gguf

    folder = tmp_path_factory.mktemp("q4_1")
    write_tiny_gguf(folder / "tiny.gguf", gguf.GGMLQuantizationType.Q4_1)
    assert cli.main(["import", str(folder / "tiny.gguf"), "--out", str(folder / "run")]) == 0
    return str(folder / "run")


def greedy(model):
    return np.asarray(dx.generate(model, PROMPTS, 8, temperature=0.0))


@pytest.mark.parametrize("data, model_size", MESHES)
def test_gguf_q4_1_run_on_a_mesh_equals_one_device(q4_1_run, data, model_size):
    want = greedy(load_run(q4_1_run)[0])
    model = dx.shard_model(load_run(q4_1_run)[0], make_mesh(data, model_size))
    part = model.blocks[0].attn.qkv.parts[0].data
    assert part[...].sharding.spec == jax.sharding.PartitionSpec("model", None)
    np.testing.assert_array_equal(greedy(model), want)


@pytest.mark.parametrize("data, model_size", MESHES)
def test_int4_model_on_a_mesh_equals_one_device(data, model_size):
    cfg = dx.ModelConfig(**SMALL)
    want = greedy(quantize_weights(dx.build_model(cfg, 0), "int4"))
    model = dx.shard_model(quantize_weights(dx.build_model(cfg, 0), "int4"), make_mesh(data, model_size))
    np.testing.assert_array_equal(greedy(model), want)


@pytest.mark.skipif(not kernel_status()[0], reason="the block kernel is not built here")
def test_kernel_runs_per_device_inside_a_shard_map():
    mesh = make_mesh(1, 4)
    w = quantize_weights(dx.build_model(dx.ModelConfig(**SMALL), 0), "int4").blocks[0].mlp.gate_up.parts[0]
    data = jax.device_put(w.data[...], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None)))
    x = jnp.ones((2, 64), jnp.float32)
    with mesh_scope(mesh):
        text = jax.jit(lambda a, d: block_matmul(a, d, "Q4_1", 64)).lower(x, data).as_text()
        got = jax.jit(lambda a, d: block_matmul(a, d, "Q4_1", 64))(x, data)
    assert "dantinox_block_matmul" in text and "manual" in text, text[-2000:]
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(w.weights()).T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernel_status()[0], reason="the block kernel is not built here")
def test_tiled_product_runs_per_device_inside_a_shard_map():
    """A prefill-sized call (20 tokens per row: the tiled many-row product) on a 1x4 mesh: each device multiplies
    its own rows of W, and the result matches the dequantized weights'."""
    mesh = make_mesh(1, 4)
    w = quantize_weights(dx.build_model(dx.ModelConfig(**SMALL), 0), "int4").blocks[0].mlp.gate_up.parts[0]
    data = jax.device_put(w.data[...], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None)))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 20, 64)), jnp.float32)
    with mesh_scope(mesh):
        text = jax.jit(lambda a, d: block_matmul(a, d, "Q4_1", 64)).lower(x, data).as_text()
        got = jax.jit(lambda a, d: block_matmul(a, d, "Q4_1", 64))(x, data)
    assert "tiled = 1 : i64" in text and "manual" in text, text[-2000:]
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(w.weights()).T, rtol=1e-5, atol=1e-5)
