"""The int8 KV cache (issue 10, points 1-3): the quantizer, the static cache's layout and bytes, and the
exactness invariant through the static cache and the compiled decode loop with its attention windows.

The invariant: a cached int8 run equals the uncached forward in which every key/value row is quantized and
read back the same way (max |diff| <= 1e-5 in float32). MHA / GQA / MQA batch 1 and ragged batches are in
tests/model/test_cache_exactness.py and the K cases in tests/test_acceptance_cases.py (both parametrized over the
cache dtype); MLA in tests/model/test_mla.py; the paged pool in tests/serving/test_kv_int8_paged.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward, qdq_rows, spiky_mla, spiky_model, tiered, tiny_config

import dantinox as dx
from dantinox.kv.static import QuantLatentKV
from dantinox.kv.int8_rows import dequantize_rows, quantize_rows, roundtrip

EQ = 1e-5
KINDS = {"mha": dict(attention="mha", kv_heads=None), "gqa": dict(attention="gqa", kv_heads=2),
         "mqa": dict(attention="mqa", kv_heads=None),
         "mla": dict(attention="mla", kv_heads=None, kv_latent_dim=16, rope_head_dim=8)}


def kind_config(kind: str, **overrides) -> dx.ModelConfig:
    """The tiny model of ``kind`` with the per-token int8 layout (kv_keys="token": this file tests issue 10's
    rows and scales per token; per-channel keys, the int8 default of MHA / GQA / MQA, are
    tests/model/test_channel_cache.py's)."""
    return tiny_config(**KINDS[kind], **{"kv_keys": "token", **overrides})


def kind_model(cfg: dx.ModelConfig):
    return spiky_mla(cfg) if cfg.attention == "mla" else spiky_model(cfg)


# ---------------------------------------------------------------------------------------------------------
# The quantizer


def test_quantize_rows_is_per_row_absmax_int8_like_the_numpy_reference():
    x = np.random.default_rng(0).normal(size=(3, 4, 5, 16)).astype(np.float32) * np.float32(3)
    q, scale = quantize_rows(jnp.asarray(x))
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (3, 4, 5, 1)
    s = np.asarray(scale)
    np.testing.assert_allclose(s, np.abs(x).max(-1, keepdims=True) / np.float32(127), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(x / s), -127, 127))
    assert int(np.abs(np.asarray(q)).max(-1).min()) == 127            # every row's largest element maps to 127
    back = np.asarray(dequantize_rows(q, scale))
    np.testing.assert_array_equal(back, np.asarray(q, np.float32) * s)
    np.testing.assert_allclose(back, qdq_rows(x), rtol=0, atol=1e-6)
    assert np.all(np.abs(back - x) <= np.asarray(scale) / 2 * (1 + 1e-6))   # error at most half a step


def test_all_zero_rows_quantize_to_zero_without_nan():
    x = jnp.zeros((2, 3, 8)).at[0, 1].set(jnp.arange(8.0))
    q, scale = quantize_rows(x)
    back = dequantize_rows(q, scale)
    assert not np.isnan(np.asarray(back)).any()
    assert float(scale[1, 0, 0]) == 0.0 and int(jnp.abs(q[1]).max()) == 0
    np.testing.assert_array_equal(np.asarray(back[1]), 0.0)
    assert quantize_rows(jnp.zeros((2, 0)))[0].shape == (2, 0)          # an MLA RoPE key of width 0


def test_one_outlier_row_does_not_change_the_error_of_any_other_row():
    x = np.random.default_rng(1).normal(size=(6, 32)).astype(np.float32)
    spiked = x.copy()
    spiked[0] *= 1000.0                                                  # an attention-sink token
    err = np.abs(np.asarray(roundtrip(jnp.asarray(x))[0]) - x)
    err_spiked = np.abs(np.asarray(roundtrip(jnp.asarray(spiked))[0]) - spiked)
    np.testing.assert_array_equal(err[1:], err_spiked[1:])


# ---------------------------------------------------------------------------------------------------------
# Layout and bytes


@pytest.mark.parametrize("kind", KINDS)
def test_int8_cache_holds_int8_rows_and_float32_scales_per_token_and_head(kind):
    cfg = kind_config(kind, cache_dtype="int8")
    layer = dx.init_cache(cfg, 3)[0]
    if kind == "mla":
        assert isinstance(layer, QuantLatentKV)
        assert layer.c_kv.shape == (3, 32, 16) and layer.k_rope.shape == (3, 32, 8)
        assert layer.c_scale.shape == layer.r_scale.shape == (3, 32, 1)
        rows, scales = (layer.c_kv, layer.k_rope), (layer.c_scale, layer.r_scale)
    else:
        assert isinstance(layer, dx.QuantLayerKV)
        K = cfg.kv_heads
        assert layer.k.shape == layer.v.shape == (3, K, 32, 8)
        assert layer.k_scale.shape == layer.v_scale.shape == (3, K, 32, 1)
        rows, scales = (layer.k, layer.v), (layer.k_scale, layer.v_scale)
    assert all(a.dtype == jnp.int8 for a in rows) and all(s.dtype == jnp.float32 for s in scales)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_kv_cache_bytes_include_the_scales_and_equal_the_allocation(kind, batch):
    cfg = kind_config(kind, cache_dtype="int8")
    allocated = dx.cache_nbytes(dx.init_cache(cfg, batch))
    assert dx.kv_cache_bytes(cfg, batch, cfg.max_context) == allocated
    rows = sum(a.size for a in dx.init_cache(cfg, batch)[0][:2]) * cfg.num_blocks   # int8: 1 byte each
    assert allocated > rows                                                          # the scales are counted
    as_float = dx.kv_cache_bytes(cfg.replace(cache_dtype="float32"), batch, cfg.max_context)
    assert dx.kv_cache_bytes(cfg.replace(cache_dtype="float32"), batch, cfg.max_context, "int8") == allocated
    assert allocated < as_float


def test_int8_bytes_per_token_at_head_size_32_are_at_most_0_30_of_float32():
    for kind in ("mha", "gqa", "mqa"):
        cfg = dx.ModelConfig.from_preset("reference", **KINDS[kind])
        assert cfg.head_size == 32
        ratio = dx.kv_bytes_per_token(cfg, "int8") / dx.kv_bytes_per_token(cfg, "float32")
        assert ratio == pytest.approx(36 / 128) and ratio <= 0.30     # 2 K (32 + 4) bytes vs 2 K 32 x 4


# ---------------------------------------------------------------------------------------------------------
# Exactness through the static cache and the compiled decode loop


def test_uncached_int8_forward_differs_from_the_float_forward():
    """Guards the invariant: the int8 reference really round-trips (it is not the float forward)."""
    model = spiky_model(tiny_config())
    twin = spiky_model(tiny_config(cache_dtype="int8"))
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], np.int32)
    diff = np.abs(np.asarray(forward(model, ids)[0]) - np.asarray(forward(twin, ids)[0])).max()
    assert 1e-4 < diff < 1.0, diff


# Both kinds in the slow tier (11-15 s each); int8 exactness (K01-K03, ragged) and the float windows
# (tests/model/test_cache_exactness.py) stay in the default tier.
@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_int8_compiled_decode_across_attention_windows_equals_the_uncached_run(kind):
    """max_context 300: batches decode in windows of 128, 256 and 300 slots inside the compiled loop; rows
    cross the window edges. Greedy tokens equal the quantize-dequantize uncached run and the batch-1 run."""
    model = kind_model(kind_config(kind, cache_dtype="int8", max_context=300))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 128, 110).tolist(), rng.integers(0, 128, 3).tolist()]
    on = dx.generate(model, prompts, 185)
    np.testing.assert_array_equal(on, dx.generate(model, prompts, 185, use_cache=False))
    np.testing.assert_array_equal(on[1], dx.generate(model, prompts[1], 185))


@pytest.mark.parametrize("kind", tiered(KINDS, slow=["mha", "mqa"]))
def test_verify_cache_passes_for_int8_and_reports_the_distance_to_the_float_cache(kind):
    model = kind_model(kind_config(kind, cache_dtype="int8"))
    report = dx.verify_cache(model, [5, 17, 3, 99, 42, 8], new_tokens=12, tolerance=EQ)
    assert report.passed, report.max_diff.max()
    assert report.float_distance is not None and report.float_distance > 1e-4    # int8 is not float
    float_report = dx.verify_cache(kind_model(kind_config(kind)), [5, 17, 3, 99, 42, 8], new_tokens=12)
    assert float_report.float_distance is None


def test_diffusion_with_an_int8_cache_is_a_config_error_naming_the_combination():
    with pytest.raises(dx.ConfigError, match=r"cache_dtype='int8'.*paradigm='diffusion'"):
        tiny_config(paradigm="diffusion", cache_dtype="int8")


def test_a_float_cache_passed_to_an_int8_model_is_rejected_by_shape():
    model = dx.build_model(tiny_config(cache_dtype="int8"))
    with pytest.raises(ValueError, match="cache_dtype='int8'"):
        model(np.array([[1, 2]], np.int32), use_cache=True, kv_caches=dx.init_cache(tiny_config(), 1),
              cache_index=0)


def test_budget_dtype_int8_prints_int8_bytes_that_match_the_allocation(capsys):
    from dantinox.cli import entrypoint as cli

    assert cli.main(["budget", "--preset", "tiny", "--dtype", "int8", "--context", "32", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "cache dtype int8" in out and "MISMATCH" not in out
    table = out.split("KV bytes per token by cache dtype", 1)[1]
    gqa = next(line for line in table.splitlines() if "gqa" in line).split(")", 1)[1].split()
    cfg = tiny_config(attention="gqa", kv_heads=int(out.split("gqa (H_kv=")[1].split(")")[0]))
    assert [int(c) for c in gqa[:2]] == [dx.kv_bytes_per_token(cfg, d) for d in ("float32", "bfloat16")]
    L, K, D, G = cfg.num_blocks, cfg.kv_heads, cfg.head_size, min(cfg.kv_key_group, cfg.max_context)
    assert float(gqa[2]) == L * (2 * K * D + 4 * K + 4 * K * D / G)   # per-channel keys, the int8 default
    assert cli.main(["budget", "--preset", "tiny", "--dtype", "int8", "--context", "32", "--kv-keys", "token"]) == 0
    table = capsys.readouterr().out.split("KV bytes per token by cache dtype", 1)[1]
    gqa = next(line for line in table.splitlines() if "gqa" in line).split(")", 1)[1].split()
    assert int(gqa[2]) == dx.kv_bytes_per_token(cfg, "int8") == L * 2 * K * (D + 4)   # per-token keys
    assert cli.main(["budget", "--preset", "tiny", "--dtype", "int4"]) == 2
