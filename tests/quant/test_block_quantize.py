"""--quantize int4 / q8_0 (issue 23): float weights quantized into ggml's Q4_1 / Q8_0 blocks.

The quantizer against an independent numpy one (the same bytes, and each weight within its block's error bound),
the stored blocks read back by the ``gguf`` package's own dequantizer, the quantized model against the float
model of the dequantized weights (logits to float32 rounding, the same greedy tokens through the kernel's decode
path), byte counts, and the refusals (a width that does not divide by 32, float16 overflow). On a mesh:
tests/parallel/multidevice/test_mesh_blocks.py."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward
from flax import nnx
from gguf.quants import dequantize

import dantinox as dx
from dantinox.quant.block_linear import BlockEmbed, BlockLinear
from dantinox.quant.block_quantize import quantize_q4_1, quantize_q8_0
from dantinox.quant.weights import describe_weights, quantize_weights

SMALL = dict(dim=64, n_heads=4, head_size=16, num_blocks=2, vocab_size=200, max_context=64, mlp_hidden=128,
             attention="gqa", kv_heads=2)
F16 = np.float16


def numpy_q4_1(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Independent reference: (blocks uint8 [N, M / 32 * 20], error bound per weight [N, M])."""
    n, m = w.shape
    x = w.astype(np.float32).reshape(n, m // 32, 32)
    lo, hi = x.min(-1), x.max(-1)
    d16 = ((hi - lo) / np.float32(15)).astype(F16)
    m16 = lo.astype(F16)
    d, mn = d16.astype(np.float32)[..., None], m16.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.rint((x - mn) / np.where(d > 0, d, 1)), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)
    out = np.concatenate([d16.view(np.uint8).reshape(n, -1, 2), m16.view(np.uint8).reshape(n, -1, 2),
                          q[..., :16] | (q[..., 16:] << 4)], axis=-1).reshape(n, -1)
    cut = np.abs(lo[..., None] - mn) + 15 * np.maximum(0, (hi - lo)[..., None] / 15 - d)
    bound = np.broadcast_to(d / 2 + cut, x.shape).reshape(n, m)
    return out, bound


def numpy_q8_0(w: np.ndarray) -> np.ndarray:
    """Independent reference: Q8_0 blocks uint8 [N, M / 32 * 34]."""
    n, m = w.shape
    x = w.astype(np.float32).reshape(n, m // 32, 32)
    d16 = (np.abs(x).max(-1) / np.float32(127)).astype(F16)
    d = d16.astype(np.float32)[..., None]
    q = np.clip(np.where(d > 0, np.rint(x / np.where(d > 0, d, 1)), 0), -127, 127).astype(np.int8)
    return np.concatenate([d16.view(np.uint8).reshape(n, -1, 2), q.view(np.uint8)], axis=-1).reshape(n, -1)


def sample_weights(seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((24, 128)) * rng.uniform(0.001, 3.0, (24, 1))).astype(np.float32)
    w[0, :32] = 0.7            # a constant block: d = 0, every weight is m
    w[1, 32:64] = 0.0          # an all-zero block
    w[2, 64] = 40.0            # an outlier coarsens its own block only
    return w


def test_q4_1_equals_the_numpy_quantizer_and_stays_within_its_bound():
    w = sample_weights()
    got = np.asarray(quantize_q4_1(jnp.asarray(w)))
    want, bound = numpy_q4_1(w)
    np.testing.assert_array_equal(got, want)
    back = dequantize(got, gguf.GGMLQuantizationType.Q4_1).astype(np.float64)
    err = np.abs(back - w)
    assert (err <= bound * (1 + 1e-6) + 1e-7).all(), (err - bound).max()
    assert err[0, :32].max() == abs(float(np.float32(0.7)) - float(F16(0.7)))
    assert err[1, 32:64].max() == 0.0
    assert err[2, 96:].max() < 0.5 * err[2, 64:96].max()


def test_q8_0_equals_the_numpy_quantizer_and_stays_within_half_a_step():
    w = sample_weights(1)
    got = np.asarray(quantize_q8_0(jnp.asarray(w)))
    np.testing.assert_array_equal(got, numpy_q8_0(w))
    back = dequantize(got, gguf.GGMLQuantizationType.Q8_0).reshape(24, 4, 32)
    d = np.abs(w).reshape(24, 4, 32).max(-1, keepdims=True) / 127
    assert (np.abs(back - w.reshape(24, 4, 32)) <= d / 2 * 1.002 + 1e-7).all()


def dequantized_float_model(cfg, quantized):
    """The float model whose every projection and embedding holds ``quantized``'s blocks as the ``gguf``
    package dequantizes them."""
    model = dx.build_model(cfg, 0)
    for path, node in list(nnx.iter_graph(quantized)):
        if isinstance(node, (BlockLinear, BlockEmbed)):
            target = model
            for key in path:
                target = target[key] if isinstance(key, int) else getattr(target, key)
            part = node.parts[0]
            w = dequantize(np.asarray(part.data[...]), gguf.GGMLQuantizationType[part.fmt])   # gguf's reader
            if isinstance(node, BlockEmbed):
                target.embedding.set_value(jnp.asarray(w))
            else:
                target.kernel.set_value(jnp.asarray(w.T))
    return model


def test_int4_logits_equal_the_float_model_of_its_dequantized_weights():
    """8 rows (the kernel's path where it is built) against the float model; the slow test below adds 24
    rows (the dequantized dot) and greedy decoding."""
    cfg = dx.ModelConfig(**{**SMALL, "num_blocks": 1})
    model = quantize_weights(dx.build_model(cfg, 0), "int4")
    ref = dequantized_float_model(cfg, model)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 200, (1, 8)), jnp.int32)
    got, want = np.asarray(forward(model, ids)[0]), np.asarray(forward(ref, ids)[0])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert describe_weights(model).startswith("int4 (Q4_1+Q8_0 blocks), ")


@pytest.mark.slow   # two models' prefill and decode loops compile per case
@pytest.mark.parametrize("quantize, tie", [("int4", True), ("int4", False), ("q8_0", True)])
def test_quantized_greedy_tokens_equal_the_float_model_of_its_dequantized_weights(quantize, tie):
    cfg = dx.ModelConfig(**SMALL, tie_embeddings=tie)
    model = quantize_weights(dx.build_model(cfg, 0), quantize)
    ref = dequantized_float_model(cfg, model)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 200, (2, 12)), jnp.int32)
    got, want = np.asarray(forward(model, ids)[0]), np.asarray(forward(ref, ids)[0])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    prompt = [[5, 6, 7, 8, 9]]
    np.testing.assert_array_equal(np.asarray(dx.generate(model, prompt, 10, temperature=0.0)),
                                  np.asarray(dx.generate(ref, prompt, 10, temperature=0.0)))
    report = dx.verify_cache(model, [5, 6, 7, 8], new_tokens=12, tolerance=1e-5)
    assert report.passed, report.max_diff.max()


@pytest.mark.parametrize("quantize, per_block", [("int4", 20), ("q8_0", 34)])
def test_param_bytes_count_the_blocks(quantize, per_block):
    """Bytes per 32 weights: Q4_1 20, Q8_0 34; int4 keeps the embedding and the untied head in Q8_0."""
    cfg = dx.ModelConfig(**SMALL, tie_embeddings=False)
    float_model = dx.build_model(cfg)
    want = 0
    for path, node in nnx.iter_graph(float_model):
        if isinstance(node, nnx.Linear):
            m, n = node.kernel[...].shape
            want += n * m // 32 * (34 if path[-1] == "lm_head" else per_block)
        elif isinstance(node, nnx.Embed):
            v, e = node.embedding[...].shape
            want += v * e // 32 * 34
        elif isinstance(node, nnx.Param) and path[-1] not in ("kernel", "embedding"):
            want += 4 * node[...].size   # the norms' scales stay float32
    assert dx.param_bytes(cfg, quantize) == want
    assert dx.param_bytes(quantize_weights(dx.build_model(cfg), quantize)) == want


def test_width_not_divisible_by_32_is_refused_naming_the_tensor():
    cfg = dx.ModelConfig(**{**SMALL, "dim": 48, "head_size": 12})
    with pytest.raises(ValueError, match=r"quantize='int4': \S+ has shape \[\d+, 48\]: its input channels .* "
                                         r"not a multiple of 32"):
        nnx.eval_shape(lambda: quantize_weights(dx.build_model(cfg), "int4"))


@pytest.mark.parametrize("quantize, value", [("int4", -1e5), ("q8_0", 1e8)])
def test_float16_overflow_is_refused_naming_the_tensor(quantize, value):
    model = dx.build_model(dx.ModelConfig(**SMALL))
    kernel = model.blocks[0].mlp.down.kernel
    kernel.set_value(kernel[...].at[0, 0].set(value))
    with pytest.raises(ValueError, match=rf"quantize='{quantize}': blocks/0/mlp/down has weights too large for a "):
        quantize_weights(model, quantize)


@pytest.mark.slow   # the bundled model quantized and verified through the CLI
def test_cli_verify_with_int4_weights_passes_and_names_them(capsys):
    from dantinox.cli import entrypoint as cli

    assert cli.main(["verify", "--quantize", "int4", "--new_tokens", "8", "--prompt", "Nel mezzo"]) == 0
    assert "weights=int4 (Q4_1+Q8_0 blocks), " in capsys.readouterr().out
