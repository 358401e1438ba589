"""Per-device memory figures (dantinox.budget.per_device) equal the bytes the arrays put on each device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dantinox as dx
from dantinox.budget.per_device import kv_bytes_per_sequence_per_device, plan_mesh, weights_bytes_per_device
from dantinox.generation.decode import prefill
from dantinox.generation.sampling import make_sampling_params
from dantinox.parallel.mesh import make_mesh, mesh_scope

KINDS = {"mha": dict(attention="mha"), "gqa": dict(attention="gqa", kv_heads=4), "mqa": dict(attention="mqa"),
         "mla": dict(attention="mla", kv_latent_dim=16, rope_head_dim=8)}


def bytes_on(tree, device) -> int:
    """Bytes of every shard of every array in ``tree`` that lives on ``device``."""
    return sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(tree) for s in leaf.addressable_shards
               if s.device == device)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (8, 1)])
def test_weights_and_cache_bytes_per_device_match_the_shards(kind, shape):
    cfg = dx.ModelConfig.from_preset("tiny", num_blocks=1, max_context=16, **KINDS[kind])
    mesh = make_mesh(*shape)
    sizes = dict(data=shape[0], model=shape[1])
    model = dx.build_model(cfg, 0, mesh=mesh)
    params = nnx.state(model, nnx.Param)
    for device in mesh.devices.flat:
        assert bytes_on(params, device) == weights_bytes_per_device(cfg, sizes)
    B = 8
    cache = dx.shard_cache(dx.init_cache(cfg, B), cfg, mesh)
    per_device = (B // shape[0]) * kv_bytes_per_sequence_per_device(cfg, sizes)
    for device in mesh.devices.flat:
        assert bytes_on(cache, device) == per_device
    plan = plan_mesh(cfg, sizes, 10 * 2 ** 20)
    assert plan.weights_bytes == weights_bytes_per_device(cfg, sizes)


def test_cache_made_inside_prefill_has_the_planned_bytes_per_device():
    """The cache generate allocates inside its compiled prefill, not only one placed by shard_cache."""
    cfg = dx.ModelConfig.from_preset("tiny", num_blocks=1, max_context=16, attention="gqa", kv_heads=4)
    mesh = make_mesh(2, 4)
    graphdef, params = nnx.split(dx.build_model(cfg, 0, mesh=mesh))
    B = 4
    ids, lengths = np.ones((B, 16), np.int32), np.full((B,), 3, np.int32)
    with mesh_scope(mesh):
        state = prefill(graphdef, params, ids, lengths, jax.random.key(0),
                        make_sampling_params(B, 0.0, 0, 1.0, cfg.vocab_size), jnp.int32(-1), jnp.int32(0))
    want = (B // 2) * kv_bytes_per_sequence_per_device(cfg, dict(data=2, model=4))
    for device in mesh.devices.flat:
        assert bytes_on(state.cache, device) == want
