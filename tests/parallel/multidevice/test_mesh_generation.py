"""Generation on (data, model) meshes of 8 CPU devices equals the single-device result (issue 13)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dantinox as dx
from dantinox.generation.decode import decode, prefill
from dantinox.generation.sampling import make_sampling_params
from dantinox.parallel.mesh import MeshError, make_mesh, mesh_scope, parse_mesh
from dantinox.parallel.sharding import cache_specs, param_spec

MESHES = [(1, 8), (2, 4), (8, 1)]
KINDS = {  # 8 query heads so that model=8 divides them; kv_heads 8 / 4 / 1
    "mha": dict(attention="mha"),
    "gqa": dict(attention="gqa", kv_heads=4),
    "mqa": dict(attention="mqa"),
    "mla": dict(attention="mla", kv_latent_dim=16, rope_head_dim=8),
}
B, T, STEPS = 8, 8, 2


def tiny(kind: str) -> dx.ModelConfig:
    return dx.ModelConfig.from_preset("tiny", num_blocks=1, max_context=16, **KINDS[kind])


@partial(jax.jit, static_argnames=("graphdef",))
def prefill_and_steps(graphdef, params, ids, cache):
    """Prefill T tokens, then STEPS single-token decode steps (the greedy token); every step's logits."""
    model = nnx.merge(graphdef, params)
    logits, cache, _ = model(ids, use_cache=True, kv_caches=cache, cache_index=0)
    out = [logits]
    for step in range(STEPS):
        token = jnp.argmax(out[-1][:, -1], axis=-1)[:, None].astype(jnp.int32)
        logits, cache, _ = model(token, use_cache=True, kv_caches=cache, cache_index=T + step)
        out.append(logits)
    return out, cache


def run(cfg, mesh):
    model = dx.build_model(cfg, 3, mesh=mesh)
    graphdef, params = nnx.split(model)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    cache = dx.shard_cache(dx.init_cache(cfg, B), cfg, mesh)
    with mesh_scope(mesh):
        logits, cache = prefill_and_steps(graphdef, params, jnp.asarray(ids), cache)
    return [np.asarray(x) for x in logits], cache, params


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_equal_single_device_on_every_mesh(kind):
    cfg = tiny(kind)
    reference, _, _ = run(cfg, None)
    for shape in MESHES:
        mesh = make_mesh(*shape)
        logits, cache, params = run(cfg, mesh)
        for step, (got, want) in enumerate(zip(logits, reference)):
            assert np.abs(got - want).max() <= 1e-5, (kind, shape, "prefill" if step == 0 else f"decode {step}")
        want_specs = cache_specs(cfg, B, dict(data=shape[0], model=shape[1]))
        for array, spec in zip(cache[0], want_specs):
            assert same_layout(array, mesh, spec), (kind, shape, array.sharding)
        out = params["blocks"][0]["attn"]["out"]["kernel"].get_value()  # row-parallel: [H D, E] rows on model
        assert same_layout(out, mesh, jax.sharding.PartitionSpec("model" if shape[1] > 1 else None)), out.sharding


@pytest.mark.parametrize("keys, layout, fields", [(dict(kv_keys="token"), "QuantLayerKV", 6),
                                                  (dict(kv_key_group=4), "ChannelQuantLayerKV", 7)],
                         ids=["token-keys", "channel-keys"])
def test_int8_gqa_cache_on_a_mesh_equals_one_device_and_splits_its_scales(keys, layout, fields):
    """cache_dtype="int8" on (2,4), per-token keys (QuantLayerKV: int8 k, v [B, K, S, D], float32 scales
    [B, K, S, 1], sinks) and the default per-channel keys (ChannelQuantLayerKV, in groups of 4 so groups complete
    within the 10 tokens: key scales [B, K, S / G, D], the residual ring, sinks): prefill and decode logits equal
    the single-device int8 run within 1e-5, and every field, the scales included, is split [data, model, -, -]
    as the values are (sharding._per_field)."""
    import dataclasses

    cfg = dataclasses.replace(tiny("gqa"), cache_dtype="int8", **keys)
    reference, ref_cache, _ = run(cfg, None)
    assert ref_cache[0].k.dtype == jnp.int8 and ref_cache[0].v_scale.shape[-1] == 1
    mesh = make_mesh(2, 4)
    logits, cache, _ = run(cfg, mesh)
    for step, (got, want) in enumerate(zip(logits, reference)):
        assert np.abs(got - want).max() <= 1e-5, "prefill" if step == 0 else f"decode {step}"
    spec = jax.sharding.PartitionSpec("data", "model", None, None)
    for layer in cache:
        assert type(layer).__name__ == layout and len(layer) == fields   # k, v, scales, (ring,) K13 sinks
        for name, array in zip(layer._fields, layer):
            assert same_layout(array, mesh, spec), (name, array.sharding)
            assert array.addressable_shards[0].data.shape[:2] == (B // 2, cfg.kv_heads // 4), name


def same_layout(array, mesh, spec) -> bool:
    return array.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), array.ndim)


def test_cache_layout_follows_kv_heads():
    """KV heads split over model where they divide, replicated otherwise (MQA, model > K); MLA replicated."""
    sizes = dict(data=2, model=4)
    P = jax.sharding.PartitionSpec
    assert cache_specs(tiny("mha"), 8, sizes)[0] == P("data", "model", None, None)
    assert cache_specs(tiny("gqa"), 8, sizes)[0] == P("data", "model", None, None)
    assert cache_specs(tiny("mqa"), 8, sizes)[0] == P("data", None, None, None)
    assert cache_specs(tiny("gqa"), 8, dict(data=1, model=8))[0] == P(None, None, None, None)
    assert cache_specs(tiny("mla"), 8, sizes)[0] == P("data", None, None)
    assert cache_specs(tiny("gqa"), 3, sizes)[0] == P(None, "model", None, None)  # 3 rows do not split


def test_generate_on_mesh_equals_one_device_and_decode_compiles_once():
    cfg = tiny("gqa")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12] * 7, [13, 14], [15], [16, 17, 18]]
    want = dx.generate(dx.build_model(cfg, 3), prompts, 8, temperature=0.0)
    mesh = make_mesh(2, 4)
    model = dx.build_model(cfg, 3)
    got = dx.generate(model, prompts, 8, temperature=0.0, mesh=mesh)
    np.testing.assert_array_equal(got, want)
    # decode chunk by chunk on the mesh: the second and third calls compile nothing, the cache stays split
    graphdef, params = nnx.split(model)
    ids = np.zeros((B, 16), np.int32)
    ids[:, :3] = 5
    lengths = np.full((B,), 3, np.int32)
    key, sampling = jax.random.key(0), make_sampling_params(B, 0.0, 0, 1.0, cfg.vocab_size)
    with mesh_scope(mesh):
        state = prefill(graphdef, params, ids, lengths, key, sampling, jnp.int32(-1), jnp.int32(0))
        state = decode(graphdef, params, state, jnp.int32(4), key, sampling, jnp.int32(-1), jnp.int32(0))
        with dx.CompileCounter() as counter:
            for stop in (7, 10):
                state = decode(graphdef, params, state, jnp.int32(stop), key, sampling, jnp.int32(-1),
                               jnp.int32(0))
    assert counter.compilations == 0
    assert same_layout(state.cache[0].k, mesh, jax.sharding.PartitionSpec("data", "model"))
    assert int(state.step) == 10


def test_bad_meshes_name_the_problem():
    with pytest.raises(MeshError, match=r"data=3 x model=3 = 9 devices, but 8"):
        make_mesh(3, 3)
    with pytest.raises(MeshError, match=r"axis 'tensor' is not allowed"):
        parse_mesh("data=2,tensor=4")
    with pytest.raises(MeshError, match=r"model=0"):
        parse_mesh("model=0")
    with pytest.raises(MeshError, match=r"n_heads=6 is not divisible by mesh axis model=4"):
        dx.build_model(dx.ModelConfig.from_preset("tiny", n_heads=6, head_size=8, dim=48), mesh=make_mesh(2, 4))
    with pytest.raises(MeshError, match=r"mlp_hidden=100 is not divisible by mesh axis model=8"):
        dx.build_model(dx.ModelConfig.from_preset("tiny", mlp_hidden=100), mesh=make_mesh(1, 8))


def test_vocab_not_dividing_stays_replicated():
    P = jax.sharding.PartitionSpec
    mesh = make_mesh(1, 8)
    assert param_spec(("embed", "embedding"), (100, 64), mesh) == P(None, None)
    assert param_spec(("embed", "embedding"), (128, 64), mesh) == P("model", None)


def test_cli_generate_and_verify_on_a_mesh(capsys):
    from dantinox.cli.entrypoint import main

    args = ["generate", "--prompt", "Nel mezzo", "--max_new_tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    single = capsys.readouterr().out
    assert main(args + ["--mesh", "data=4,model=2"]) == 0
    assert capsys.readouterr().out == single
    assert main(["verify", "--new_tokens", "8", "--mesh", "model=2,data=4"]) == 0
    assert "PASS" in capsys.readouterr().out
    for mesh, words in (("data=2,model=4", "n_heads=6 is not divisible by mesh axis model=4"),
                        ("data=16", "data=16 x model=1 = 16 devices, but 8"), ("rows=8", "axis 'rows'")):
        assert main(args + ["--mesh", mesh]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "--mesh" in err, err
