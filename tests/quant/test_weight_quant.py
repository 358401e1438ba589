"""Low-precision weights (issue 10, point 4): int8 per output channel and bf16, fp32 accumulation, honest bytes."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward, tiered
from flax import nnx

import dantinox as dx
from dantinox.cli import entrypoint as cli
from dantinox.quant.weights import Int8Linear, quantize_channels, quantize_weights

SMALL = dict(dim=64, n_heads=4, head_size=16, num_blocks=2, vocab_size=200, max_context=64, mlp_hidden=128)
KINDS = {"gqa": dict(attention="gqa", kv_heads=2),
         "mla": dict(attention="mla", kv_latent_dim=32, rope_head_dim=8, q_latent_dim=32)}


def small_config(kind="gqa", **overrides):
    return dx.ModelConfig(**{**SMALL, **KINDS[kind], **overrides})


def numpy_int8(w: np.ndarray):
    """Independent reference: symmetric absmax int8 per column of w [M, N]."""
    scale = np.abs(w).max(axis=0) / 127.0
    q = np.clip(np.rint(w / scale), -127, 127)
    return q, scale


def test_int8_linear_equals_numpy_per_channel_reference():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 40)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(1, 40)).astype(np.float32)
    x = rng.normal(size=(3, 5, 48)).astype(np.float32)
    q_ref, s_ref = numpy_int8(w.astype(np.float64))
    layer = Int8Linear(jnp.asarray(w))
    assert layer.kernel[...].dtype == jnp.int8 and layer.scale[...].shape == (40,)
    np.testing.assert_array_equal(np.asarray(layer.kernel[...]), q_ref)
    np.testing.assert_allclose(np.asarray(layer.scale[...]), s_ref, rtol=1e-6)
    want = x.astype(np.float64) @ (q_ref * s_ref)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), want, rtol=1e-5, atol=1e-4)


def test_int8_error_per_channel_is_at_most_half_a_step():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(32, 16)).astype(np.float32)
    w[:, 3] *= 1000.0  # one loud channel must not coarsen the others
    q, scale = quantize_channels(jnp.asarray(w), axis=1)
    err = np.abs(np.asarray(q, np.float64) * np.asarray(scale) - w)
    assert (err <= np.asarray(scale) / 2 + 1e-6 * np.abs(w)).all()
    quiet = np.delete(np.arange(16), 3)
    assert np.asarray(scale)[quiet].max() < 0.1


# Every kind and quantization in the default tier; MLA with a tied head only in the slow tier (the heaviest).
CASES = [(kind, tie, quantize, tol) for kind in sorted(KINDS) for tie in (True, False)
         for quantize, tol in (("bf16", 0.02), ("int8", 0.05))]


@pytest.mark.parametrize("kind, tie, quantize, tol", tiered(CASES, slow=[c for c in CASES if c[:2] == ("mla", True)]))
def test_quantized_logits_close_to_float_and_cache_exact(kind, tie, quantize, tol):
    cfg = small_config(kind, tie_embeddings=tie)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 200, (2, 12)), jnp.int32)
    ref = np.asarray(forward(dx.build_model(cfg, 0), ids)[0])
    model = quantize_weights(dx.build_model(cfg, 0), quantize)
    got = np.asarray(forward(model, ids)[0])
    assert 0 < np.abs(got - ref).max() <= tol * np.abs(ref).max()
    report = dx.verify_cache(model, [5, 6, 7, 8], new_tokens=12, tolerance=1e-5)
    assert report.passed, report.max_diff.max()


@pytest.mark.parametrize("quantize", ["bf16", "int8"])
def test_quantized_decode_loop_compiles_once(quantize):
    model = quantize_weights(dx.build_model(small_config()), quantize)
    dx.generate(model, [[1, 2, 3]], 6, temperature=0.0)
    with dx.CompileCounter() as counted:
        dx.generate(model, [[4, 5, 6, 7, 8]], 9, temperature=0.0, seed=3)
    assert counted.compilations == 0


def expected_bytes(cfg, quantize):
    """Independent count from the float model's parameter tree: a Linear kernel [M, N] -> M N + 4 N (int8) or
    2 M N (bf16); the embedding [V, E] -> V E + 4 V or 2 V E; MLA's W_UK/W_UV 4 (int8) or 2 (bf16) per value;
    norm scales stay 4 bytes."""
    model = dx.build_model(cfg)
    total = 0
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        shape, size = var[...].shape, var[...].size
        if len(shape) == 1:
            total += 4 * size
        elif quantize == "bf16":
            total += 2 * size
        elif path[-1] == "kernel":
            total += size + 4 * shape[1]
        elif path[-1] == "embedding":
            total += size + 4 * shape[0]
        else:
            total += 4 * size
    return total


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("quantize", ["bf16", "int8"])
def test_param_bytes_count_quantized_weights_and_scales(kind, quantize):
    cfg = small_config(kind, tie_embeddings=False)
    want = expected_bytes(cfg, quantize)
    assert dx.param_bytes(cfg, quantize) == want
    assert dx.param_bytes(quantize_weights(dx.build_model(cfg), quantize)) == want
    assert want < dx.param_bytes(cfg) * (0.55 if quantize == "bf16" else 0.35)


def test_quantize_twice_or_unknown_value_is_rejected():
    model = quantize_weights(dx.build_model(small_config()), "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(model, "bf16")
    with pytest.raises(ValueError, match=r"quantize='int3' is not allowed: one of bf16, int8, int4, q8_0"):
        quantize_weights(dx.build_model(small_config()), "int3")
    with pytest.raises(ValueError, match="quantize='fp8'"):
        dx.param_bytes(small_config(), "fp8")


def test_generator_with_int8_weights_generates_text():
    gen = dx.Generator(quantize="int8", warmup=False)   # the warmup is tested in test_generator_warmup.py
    assert gen.quantize == "int8"
    text = gen.generate("Nel mezzo del cammin", 12, temperature=0.0)
    assert isinstance(text, str) and text
    with pytest.raises(ValueError, match="quantize='int3'"):
        dx.Generator(quantize="int3", warmup=False)


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "Nel", "--quantize", "int3"],
    ["verify", "--quantize", "fp16"],
    ["serve", "--quantize", "q4"],
])
def test_cli_rejects_unknown_quantize_with_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--quantize {argv[-1]} is not allowed: one of bf16, int8, int4, q8_0" in err[0]


def test_cli_verify_with_int8_weights_passes(capsys):
    assert cli.main(["verify", "--quantize", "int8", "--new_tokens", "8", "--prompt", "Nel mezzo"]) == 0
    assert "weights=int8" in capsys.readouterr().out


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
@pytest.mark.parametrize("scheme", ["int8", "int4"])   # int4: Q4_1 blocks run by the block kernel
def test_paged_engine_with_quantized_weights_matches_batch_one_generate(scheme):
    from conftest import tiny_config
    from serving_util import drain, greedy, lively_model, make_engine, solo

    model = quantize_weights(lively_model(tiny_config()), scheme)
    engine = make_engine(model)
    rng = np.random.default_rng(4)
    batch = [rng.integers(0, 128, n).tolist() for n in (3, 9)]
    ids = [engine.add_request(p, greedy(10)) for p in batch]
    out = drain(engine)
    for rid, prompt in zip(ids, batch):
        assert out[rid][0] == solo(model, prompt, 10, temperature=0.0)
