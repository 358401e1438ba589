"""K13 (issue 19, item 3): one outlier token must not ruin an int8 KV cache.

The case: a tiny model with unit-scale random weights whose token-0 keys and values are scaled by 50 (a
wrapper on the qkv projection; for MLA on the latent and the RoPE key), the attention sink of a real model.
Teacher-force 24 tokens after a 12-token prompt with an int8 cache and with a float32 cache: the largest
|logit difference| stays within 0.05. The fix keeps the first ``kv_sink_tokens`` (4) tokens of every sequence
in float32 next to their int8 rows (``dantinox.kv.sinks``); with kv_sink_tokens=0 (every row int8, the
old cache) the same run moves the logits by far more. That holds for both int8 key layouts: per-token keys
(kv_keys="token") and the default per-channel keys (KIVI), whose group scales leave the sinks out (else the
outlier sets the scale of its whole group: 0.088 at G = 8 before that rule). The same holds for MLA's latent
cache and for the serving engine's paged pool, and the budget counts the sink rows byte for byte (the
per-channel layout's bytes: tests/model/test_channel_cache.py, tests/serving/test_kv_channel_paged.py).

Each case compiles one program per cache (the prompt and a lax.scan over the 24 forced tokens in one jit).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from serving_util import drain, greedy, lively_model, make_engine, solo

import dantinox as dx
from dantinox.kv.sizes import sink_bytes_per_layer
from dantinox.budget import kv_sink_bytes
from dantinox.plan.ledger import memory_ledger
from dantinox.serving import EngineConfig, PagedEngine
from dantinox.kv.paged import paged_views
from dantinox.kv.sizes import page_bytes, sink_slot_bytes
from dantinox.kv.pool import init_pool, pool_nbytes
from dantinox.kv.sink_slots import SinkSlots, slots_for

PROMPT, FORCED, OUTLIER = 12, 24, 50.0
BOUND = 0.05          # the case's bound on max |int8 - float32| logits
GQA = dict(attention="gqa", kv_heads=2, kv_keys="token")      # the per-token layout the sinks were built for
CHANNEL = dict(attention="gqa", kv_heads=2, kv_keys="channel", kv_key_group=8)   # the int8 default, in groups
# of 8 so groups complete within the 36 tokens, the first one holding the 4 sinks and 4 other tokens
MLA = dict(attention="mla", kv_heads=None, kv_latent_dim=16, rope_head_dim=8)


class FirstTokenOutlier(nnx.Module):
    """Wraps a projection x [B, T, E] -> [B, T, W] and multiplies columns [start, stop) of token 0 by
    ``factor``. Only the prompt call has more than one token (the forced tokens come one per call), so row 0
    of a multi-token call is position 0."""

    def __init__(self, inner, start: int, stop: int, factor: float):
        self.inner, self.start, self.stop, self.factor = inner, start, stop, factor

    def __call__(self, x):
        y = self.inner(x)
        if x.shape[1] == 1:
            return y
        scale = jnp.ones(y.shape[-1], y.dtype).at[self.start:self.stop].set(self.factor)
        return y.at[:, 0].multiply(scale)


def outlier_model(cache_dtype: str, factor: float = OUTLIER, **fields):
    """The case's model: unit-scale random weights (each kernel N(0, 1 / fan_in), embeddings N(0, 1), the
    same draws for every cache dtype), token 0's keys and values (MLA: latent and RoPE key) times ``factor``."""
    cfg = dx.ModelConfig.from_preset("tiny", max_context=48, tie_embeddings=False, cache_dtype=cache_dtype,
                                     **{**GQA, **fields})
    model = dx.build_model(cfg, seed=0)
    rng = np.random.default_rng(13)
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param) or param[...].ndim < 2:       # RMSNorm scales stay 1
            continue
        shape = param[...].shape
        fan_in = {"w_uk": shape[-1], "embedding": 1}.get(path[-1], shape[-2])
        param[...] = jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)
    for blk in model.blocks:
        a = blk.attn
        if cfg.attention == "mla":
            C, Q = cfg.kv_latent_dim, cfg.q_latent_dim or 0
            a.kv_norm = FirstTokenOutlier(a.kv_norm, 0, C, factor)
            a.down = FirstTokenOutlier(a.down, Q + C, Q + C + cfg.rope_head_dim, factor)
        else:
            H, D = cfg.n_heads, cfg.head_size
            a.qkv = FirstTokenOutlier(a.qkv, H * D, a.qkv.out_features, factor)
    return model


def tokens(cfg):
    rng = np.random.default_rng(7)
    return rng.integers(0, cfg.vocab_size, PROMPT + FORCED).astype(np.int32)


def _static_run(graphdef, state, ids):
    model = nnx.merge(graphdef, state)
    cache = dx.init_cache(model.cfg, 1)
    logits, cache, _ = model(ids[None, :PROMPT], use_cache=True, kv_caches=cache, cache_index=0)

    def step(cache, x):
        i, token = x
        out, cache, _ = model(token[None, None], use_cache=True, kv_caches=cache, cache_index=PROMPT + i)
        return cache, out[0, -1]

    _, forced = jax.lax.scan(step, cache, (jnp.arange(FORCED - 1), ids[PROMPT:-1]))
    return jnp.concatenate([logits[0], forced])


_static_run = jax.jit(_static_run, static_argnums=0)


def teacher_forced(model, ids) -> np.ndarray:
    """Logits [PROMPT + FORCED - 1, V] of the prompt (one call) and each forced token (one call each, static
    cache), for the next-token positions 0 .. 34."""
    graphdef, state = nnx.split(model)
    return np.asarray(_static_run(graphdef, state, jnp.asarray(ids)))


def _paged_run(graphdef, state, pool, ids):
    model = nnx.merge(graphdef, state)
    table = jnp.arange(1, 1 + pool[0][0].shape[0] - 1, dtype=jnp.int32)[None][:, ::-1]   # blocks in reverse
    one = jnp.ones(1, jnp.int32)
    views = paged_views(pool, table, one * PROMPT)
    logits, views, _ = model(ids[None, :PROMPT], use_cache=True, kv_caches=views, cache_index=0 * one)

    def step(pool, x):
        i, token = x
        views = paged_views(pool, table, one)
        out, views, _ = model(token[None, None], use_cache=True, kv_caches=views, cache_index=one * (PROMPT + i))
        return tuple(v.pool for v in views), out[0, -1]

    _, forced = jax.lax.scan(step, tuple(v.pool for v in views), (jnp.arange(FORCED - 1), ids[PROMPT:-1]))
    return jnp.concatenate([logits[0], forced])


_paged_run = jax.jit(_paged_run, static_argnums=0)


def paged_teacher_forced(model, ids, block_size: int = 4) -> np.ndarray:
    """``teacher_forced`` through the serving engine's paged pool (``paged_views``), the sequence's blocks
    taken from the end of the pool so the first block is not block 0."""
    graphdef, state = nnx.split(model)
    pool = init_pool(model.cfg, 1 + model.cfg.max_context // block_size, block_size)
    return np.asarray(_paged_run(graphdef, state, pool, jnp.asarray(ids)))


def distance(a, b) -> float:
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("keys", [GQA, CHANNEL], ids=["token-keys", "channel-keys"])
def test_k13_outlier_token_int8_cache_stays_within_0_05_of_float32(keys):
    ids = tokens(outlier_model("float32").cfg)
    reference = teacher_forced(outlier_model("float32"), ids)
    fixed = distance(teacher_forced(outlier_model("int8", **keys), ids), reference)
    every_row_int8 = distance(teacher_forced(outlier_model("int8", kv_sink_tokens=0, **keys), ids), reference)
    assert fixed <= BOUND, fixed                          # 0.0075 per token, 0.0083 per channel
    assert every_row_int8 > 2 * BOUND, every_row_int8     # the case reproduces the fault without the sinks (0.136,
    #                                                       0.127 per channel)


@pytest.mark.parametrize("keys", [GQA, CHANNEL], ids=["token-keys", "channel-keys"])
def test_k13_without_the_outlier_int8_stays_close_too(keys):
    """The control: no outlier token, sinks on; int8 is as close as before (the sinks cost no accuracy)."""
    ids = tokens(outlier_model("float32").cfg)
    plain = distance(teacher_forced(outlier_model("int8", factor=1.0, **keys), ids),
                     teacher_forced(outlier_model("float32", factor=1.0), ids))
    assert plain <= BOUND, plain


def test_k13_mla_latent_cache_with_an_outlier_token_stays_within_0_05():
    ids = tokens(outlier_model("float32", **MLA).cfg)
    reference = teacher_forced(outlier_model("float32", **MLA), ids)
    fixed = distance(teacher_forced(outlier_model("int8", **MLA), ids), reference)
    assert fixed <= BOUND, fixed


@pytest.mark.parametrize("attn", [GQA, CHANNEL, MLA], ids=["gqa", "gqa-channel-keys", "mla"])
def test_k13_paged_pool_keeps_the_sinks_and_equals_the_static_int8_cache(attn):
    ids = tokens(outlier_model("float32", **attn).cfg)
    int8 = outlier_model("int8", **attn)
    paged = paged_teacher_forced(int8, ids, block_size=int8.cfg.kv_key_group if int8.cfg.channel_keys else 4)
    assert distance(paged, teacher_forced(int8, ids)) <= 1e-5                   # paged == static, int8
    assert distance(paged, teacher_forced(outlier_model("float32", **attn), ids)) <= BOUND


@pytest.mark.parametrize("attn", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_k13_budget_bytes_equal_the_arrays_bytes_with_the_sink_rows(attn, sinks):
    cfg = dx.ModelConfig.from_preset("tiny", cache_dtype="int8", kv_sink_tokens=sinks, **attn)
    width = 16 + 8 if attn is MLA else 2 * cfg.kv_heads * cfg.head_size
    assert sink_bytes_per_layer(cfg) == sinks * width * 4
    cache = dx.init_cache(cfg, 3)
    assert dx.cache_nbytes(cache) == sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
    assert dx.cache_nbytes(cache) == dx.kv_cache_bytes(cfg, 3, cfg.max_context)
    pool = init_pool(cfg, 5, 4, sink_slots=3)          # the sinks are per sequence (3 slots), not per block
    assert pool_nbytes(pool) == sum(x.nbytes for x in jax.tree_util.tree_leaves(pool))
    assert pool_nbytes(pool) == 5 * 4 * dx.kv_bytes_per_token(cfg) + 3 * kv_sink_bytes(cfg)
    assert page_bytes(cfg, 4) == 4 * dx.kv_bytes_per_token(cfg)      # a block costs what it did before K13
    assert sink_slot_bytes(cfg) == kv_sink_bytes(cfg) == cfg.num_blocks * sink_bytes_per_layer(cfg)
    assert dx.kv_cache_bytes(cfg, 3, 20) == 3 * (20 * dx.kv_bytes_per_token(cfg) + cfg.num_blocks
                                                  * sink_bytes_per_layer(cfg))
    float_cfg = cfg.replace(cache_dtype="float32")
    assert sink_bytes_per_layer(float_cfg) == 0 and len(dx.init_cache(float_cfg, 1)[0]) == 2


def test_k13_sinks_that_do_not_fit_in_a_block_are_refused_naming_both_fields():
    cfg = dx.ModelConfig.from_preset("tiny", cache_dtype="int8", kv_sink_tokens=8, kv_keys="token")
    with pytest.raises(ValueError, match=r"block_size=4 .*kv_sink_tokens=8"):
        init_pool(cfg, 3, 4)
    cfg = cfg.replace(kv_keys="channel", kv_key_group=2)     # per-channel keys: a multiple of G is not enough
    with pytest.raises(ValueError, match=r"block_size=4 .*kv_sink_tokens=8"):
        init_pool(cfg, 3, 4)
    with pytest.raises(dx.ConfigError, match="kv_sink_tokens=-1"):
        cfg.replace(kv_sink_tokens=-1)


@pytest.mark.parametrize("attn", [GQA, MLA], ids=["gqa", "mla"])
def test_k13_engine_pool_and_planner_ledger_count_the_per_sequence_sink_slots(attn):
    """The engine allocates R = 2 x max_running sink slots beside its blocks; its pool's bytes, the budget that
    sized it and the planner's ledger agree byte for byte."""
    cfg = dx.ModelConfig.from_preset("tiny", cache_dtype="int8", max_context=32, **attn)
    model = dx.build_model(cfg, seed=0)
    per_block = page_bytes(cfg, 4)
    budget = 10 * per_block + slots_for(3) * sink_slot_bytes(cfg) + per_block - 1       # 10 blocks and the slots
    engine = PagedEngine(model, EngineConfig(block_size=4, max_running=3, kv_memory_bytes=budget,
                                             kv_memory_all=True))
    assert engine.allocator.num_blocks == 10 and engine.pool_size.sink_slots == 6
    real = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.pool))
    assert real == pool_nbytes(engine.pool) == 10 * per_block + 6 * kv_sink_bytes(cfg)
    default = PagedEngine(model, EngineConfig(block_size=4, max_running=3))     # the ledger's pool
    candidate = type("Candidate", (), dict(quantize=None, kv_dtype="int8", max_running=3, block_size=4))()
    ledger = memory_ledger(cfg, candidate, 0, 10**9)
    assert ledger.kv == pool_nbytes(default.pool) == sum(x.nbytes for x in jax.tree_util.tree_leaves(default.pool))


def test_k13_sink_slots_are_shared_by_a_prefix_hit_and_kept_for_the_prefix_cache():
    uncached = []
    slots = SinkSlots(2, uncached.append)
    a = slots.fresh("a", 7)
    assert slots.share("b", 7) == a                       # b's prompt hit a's first block: a's sinks
    slots.copied(7, 9)                                    # copy-on-write of the first block: same sinks
    assert slots.share("c", 9) == a
    for seq in "abc":
        slots.release(seq)
    assert slots.share("d", 7) == a and not uncached      # released, the slot still serves the cached block
    slots.release("d")
    other = slots.fresh("e", 3)                           # the never-used slot goes first
    assert other != a and not uncached
    slots.fresh("f", 4)                                   # only a's slot is idle: its blocks leave the cache
    assert sorted(uncached) == [7, 9]
    with pytest.raises(LookupError, match="first block 7"):
        slots.share("g", 7)


@pytest.mark.parametrize("preemption", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_k13_engine_with_prefix_hits_and_preemption_equals_the_static_int8_cache(preemption):
    """Requests sharing a prompt prefix (prefix-cache hits on their first block) in a pool small enough to
    preempt: every request's greedy tokens equal the static int8 cache's (batch 1, ``dx.generate``), so each
    read its own sequence's sinks, after sharing, swapping or recomputing them."""
    cfg = dx.ModelConfig.from_preset("tiny", cache_dtype="int8", max_context=48, **GQA)
    model = lively_model(cfg)
    rng = np.random.default_rng(5)
    shared = rng.integers(1, cfg.vocab_size, 8).tolist()
    prompts = [shared + rng.integers(1, cfg.vocab_size, n).tolist() for n in (3, 5, 2, 6)]
    prompts += [rng.integers(1, cfg.vocab_size, 9).tolist(), shared + [3], shared[:4], shared]  # the last two:
    # wholly cached prompts, their last token recomputed into a copy of the shared block (copy-on-write)
    want = [solo(model, p, 10) for p in prompts]
    engine = make_engine(model, max_running=3, num_blocks=12, preemption=preemption, max_decode_steps=4)
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    got = drain(engine)
    assert [got[i][0] for i in ids] == want
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["preemptions"] > 0, stats
    assert stats["cow_copies"] > 0 or preemption == "swap", stats    # this schedule copies only under recompute
