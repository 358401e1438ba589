"""KV memory budgeting: the formula equals what init_cache allocates (every attention kind, both dtypes, a
few shapes), max_batch_size verified by allocation, the course's example and the corrected seed table,
capacity for a request mix under both admission rules, and bad input."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

import dantinox as dx

GIB, MIB = 2 ** 30, 2 ** 20

KINDS = {
    "mha": dict(attention="mha", kv_heads=None),
    "gqa4": dict(attention="gqa", kv_heads=4),
    "gqa2": dict(attention="gqa", kv_heads=2),
    "mqa": dict(attention="mqa", kv_heads=None),
    "mla": dict(attention="mla", kv_heads=None, kv_latent_dim=16, rope_head_dim=8),
    "mla-q-norope": dict(attention="mla", kv_heads=None, kv_latent_dim=24, rope_head_dim=0, q_latent_dim=16),
}


def tiny(**overrides) -> dx.ModelConfig:
    return dx.ModelConfig.from_preset("tiny", **overrides)


def array_bytes(cache) -> int:
    """Bytes from the allocated arrays' shapes and dtypes (independent of any dantinox helper)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(cache))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_bytes_equals_what_init_cache_allocates(kind, dtype):
    for num_blocks, max_context, batch in [(1, 8, 1), (2, 32, 3), (3, 16, 2)]:
        cfg = tiny(num_blocks=num_blocks, max_context=max_context, cache_dtype=dtype, **KINDS[kind])
        cache = dx.init_cache(cfg, batch)
        expected = dx.kv_cache_bytes(cfg, batch, max_context)
        assert expected == array_bytes(cache) == dx.cache_nbytes(cache)
        # the dtype argument overrides the config's cache dtype
        other = "float32" if dtype == "bfloat16" else "bfloat16"
        assert dx.kv_cache_bytes(cfg.replace(cache_dtype=other), batch, max_context, dtype) == expected


def test_per_kind_bytes_per_token_formulas():
    assert dx.bytes_per_token_per_layer(tiny(), "fp32") == 2 * 8 * 8 * 4
    assert dx.bytes_per_token_per_layer(tiny(**KINDS["gqa2"]), "bf16") == 2 * 2 * 8 * 2
    assert dx.bytes_per_token_per_layer(tiny(**KINDS["mla"]), "bf16") == (16 + 8) * 2
    assert dx.kv_bytes_per_token(tiny(**KINDS["mla"]), "fp32") == 2 * (16 + 8) * 4


def test_course_example_64_and_16_gib():
    """32 layers, batch 16, 8192 tokens, 128-dim heads, bf16: 64 GiB with 32 KV heads, 16 GiB with 8."""
    shape = dict(dim=4096, n_heads=32, head_size=128, num_blocks=32, max_context=8192, vocab_size=32000)
    mha = dx.ModelConfig(attention="mha", kv_heads=None, **shape)
    gqa = dx.ModelConfig(attention="gqa", kv_heads=8, **shape)
    assert dx.kv_cache_bytes(mha, 16, 8192, "bf16") == 64 * GIB
    assert dx.kv_cache_bytes(gqa, 16, 8192, "bf16") == 16 * GIB


def test_seed_reference_table_corrected():
    """12 blocks, 8 heads x 32, bf16, per sequence: the seeds printed 0.375 / 0.094 / 0.047 / 0.027 MB at 512
    tokens, 16x too small against their own formula (../shared/DESIGN.md, Errata)."""
    ref = dx.ModelConfig.from_preset("reference")
    rows = {"mha": (ref.replace(attention="mha", kv_heads=None), 6.0),
            "gqa2": (ref, 1.5),
            "gqa1": (ref.replace(attention="mqa", kv_heads=None), 0.75),
            "mla96-no-rope": (ref.replace(attention="mla", kv_heads=None, kv_latent_dim=96, rope_head_dim=0),
                              1.125),
            "mla96-rope16": (ref.replace(attention="mla", kv_heads=None, kv_latent_dim=96, rope_head_dim=16),
                             1.3125)}
    for name, (cfg, mib_at_512) in rows.items():
        for tokens in (512, 1024, 4096):
            expected = mib_at_512 * MIB * tokens // 512
            assert dx.kv_cache_bytes(cfg, 1, tokens, "bf16") == expected, (name, tokens)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_param_bytes_from_config_equals_the_real_parameter_tree():
    for cfg in (tiny(), tiny(**KINDS["mla"]), tiny(**KINDS["mla-q-norope"])):
        model = dx.build_model(cfg)
        from_tree = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
        assert dx.param_bytes(cfg) == dx.param_bytes(model) == from_tree
    assert dx.param_bytes(dx.ModelConfig.from_preset("reference")) == 45_900_800   # 11.475 M float32 params


@pytest.mark.parametrize("kind", ["gqa2", "mla"])
def test_max_batch_size_verified_by_allocation(kind):
    """On a scaled-down budget: that many sequences' caches fit beside the real weights and the reserve, one
    more does not."""
    cfg = tiny(**KINDS[kind])
    model = dx.build_model(cfg)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    per_seq = dx.kv_cache_bytes(cfg, 1, cfg.max_context)
    device = int((weights + 5.5 * per_seq) / 0.9)
    n = dx.max_batch_size(cfg, device, cfg.max_context, weights_bytes=dx.param_bytes(model))
    assert n == dx.max_batch_size(cfg, device, cfg.max_context) == 5          # weights from the config too
    usable = device - math.ceil(device * 0.1)
    before = sum(a.nbytes for a in jax.live_arrays())
    cache = dx.init_cache(cfg, n)
    allocated = sum(a.nbytes for a in jax.live_arrays()) - before
    assert allocated == dx.cache_nbytes(cache) == n * per_seq
    assert weights + allocated <= usable
    assert weights + dx.cache_nbytes(dx.init_cache(cfg, n + 1)) > usable
    # the static cache always holds max_context slots; a shorter seq_len is for paged caches
    assert dx.max_batch_size(cfg, device, 16, weights_bytes=weights) == (usable - weights) // (per_seq // 2)


def test_weights_larger_than_the_device_say_how_much_is_missing():
    cfg = tiny()
    weights = dx.param_bytes(cfg)
    missing = weights + 100 - 1000
    with pytest.raises(ValueError, match=rf"need {weights + 100} B, {missing} B more than the device"):
        dx.max_batch_size(cfg, 1000, 32, weights_bytes=weights + 100, reserve_fraction=0.0)
    with pytest.raises(ValueError, match="more than the device has"):
        dx.max_batch_size(cfg, weights, 32)                                 # the 10% reserve does not fit
    assert dx.max_batch_size(cfg, weights + 10, 32, reserve_fraction=0.0) == 0   # weights fit, no sequence


def test_split_of_device_memory():
    split = dx.memory_split(tiny(), 10_000_000, weights_bytes=1_000_000, reserve_fraction=0.25)
    got = (split.reserve_bytes, split.weights_bytes, split.kv_budget_bytes)
    assert got == (2_500_000, 1_000_000, 6_500_000)


@pytest.mark.parametrize("call, match", [
    (lambda: dx.kv_cache_bytes(tiny(), 0, 32), "batch=0"),
    (lambda: dx.kv_cache_bytes(tiny(), -2, 32), "batch=-2"),
    (lambda: dx.kv_cache_bytes(tiny(), True, 32), "batch=True"),
    (lambda: dx.kv_cache_bytes(tiny(), 1.5, 32), "batch=1.5"),
    (lambda: dx.kv_cache_bytes(tiny(), 1, 0), "seq_len=0"),
    (lambda: dx.max_batch_size(tiny(), 0, 32), "device_bytes=0"),
    (lambda: dx.max_batch_size(tiny(), -5, 32), "device_bytes=-5"),
    (lambda: dx.max_batch_size(tiny(), 10 ** 9, -1), "seq_len=-1"),
    (lambda: dx.max_batch_size(tiny(), 10 ** 9, 32, reserve_fraction=1.0), "reserve_fraction=1.0"),
    (lambda: dx.max_batch_size(tiny(), 10 ** 9, 32, reserve_fraction=-0.1), "reserve_fraction=-0.1"),
    (lambda: dx.max_batch_size(tiny(), 10 ** 9, 32, weights_bytes=-1), "weights_bytes=-1"),
])
def test_non_positive_sizes_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_unknown_dtype_and_mla_fields_raise_config_errors():
    with pytest.raises(dx.ConfigError, match="'fp8'"):
        dx.kv_cache_bytes(tiny(), 1, 32, "fp8")
    with pytest.raises(dx.ConfigError, match="'int4'"):
        dx.max_batch_size(tiny(), 10 ** 9, 32, dtype="int4")
    mla = dict(dx.PRESETS["tiny-mla"])
    with pytest.raises(dx.ConfigError, match="kv_latent_dim=None.*positive integer for attention='mla'"):
        dx.kv_cache_bytes({**mla, "kv_latent_dim": None}, 1, 32)
    with pytest.raises(dx.ConfigError, match="kv_latent_dim=16.*None for attention='mha'"):
        dx.kv_cache_bytes({**dx.PRESETS["tiny"], "kv_latent_dim": 16}, 1, 32)
    assert dx.kv_cache_bytes(mla, 1, 32) == 2 * 32 * (16 + 8) * 4


def test_plan_capacity_under_both_admission_rules():
    cfg = tiny()                                           # 2 x 2 x 8 x 8 x 4 B = 1024 B per token
    mix = [(6, 10), (20, 12), (4, 4)]                      # 16 + 32 + 8 = 56 tokens used
    split = dx.memory_split(cfg, 1_000_000, weights_bytes=100_000, reserve_fraction=0.1)
    budget = split.kv_budget_bytes                         # 800 000 B
    static = dx.plan_capacity(cfg, 1_000_000, mix, weights_bytes=100_000)
    assert static.admission == "max_context" and static.tokens_per_request == 32
    assert static.max_concurrent == budget // (32 * 1024) == 24
    assert static.mix_copies == budget // (3 * 32 * 1024) == 8
    assert static.utilization == pytest.approx(56 / 96)
    paged = dx.plan_capacity(cfg, 1_000_000, mix, admission="request", weights_bytes=100_000)
    assert paged.tokens_per_request == pytest.approx(56 / 3) and paged.utilization == 1.0
    assert paged.max_concurrent == budget * 3 // (56 * 1024) == 41
    assert paged.mix_copies == budget // (56 * 1024) == 13
    histogram = dx.plan_capacity(cfg, 1_000_000, {(6, 10): 2, (20, 12): 2, (4, 4): 2}, admission="request",
                                 weights_bytes=100_000)
    assert histogram.max_concurrent == paged.max_concurrent and histogram.requests == 6


@pytest.mark.parametrize("mix, admission, match", [
    ([(6, 10)], "fifo", "admission='fifo'"),
    ([(30, 10)], "request", "needs 40 cache slots, more than max_context=32"),
    ([(30, 10)], "max_context", "needs 40 cache slots"),
    ([], "request", "mix is empty"),
    ({(4, 4): 0}, "request", "mix is empty"),
    ([(4, -1)], "request", "max_new_tokens=-1"),
    ([(0, 4)], "request", "prompt_tokens=0"),
    ([(4,)], "request", "pair"),
    ({(4, 4): -1}, "request", "count=-1"),
])
def test_plan_capacity_bad_input(mix, admission, match):
    with pytest.raises(ValueError, match=match):
        dx.plan_capacity(tiny(), 10 ** 7, mix, admission=admission)


def test_max_batch_size_rejects_seq_len_beyond_max_context_and_huge_devices():
    cfg = dx.ModelConfig.from_preset("tiny")
    with pytest.raises(ValueError, match=r"seq_len=33 is not allowed: at most max_context=32"):
        dx.max_batch_size(cfg, 10 ** 9, 33)
    with pytest.raises(ValueError, match=r"device_bytes=.* at most 2\*\*60"):
        dx.max_batch_size(cfg, 2 ** 61, 32)
