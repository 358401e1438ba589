"""The paged latent pool for attention="mla": per layer c_kv [N, P, C] and k_rope [N, P, R] instead of per-head
keys and values. Paged logits equal the static LatentKV cache's (ragged batch, chunked prefill, decode; absorbed
and naive paths), engine outputs equal batch-1 ``dx.generate``, swap and recompute preemption, and the pool
sized from a byte budget with the planner's bytes-per-token figure (the `dantinox serve` start-up line)."""

import numpy as np
import pytest
from conftest import tiny_config
from serving_util import (
    chunked_paged_run,
    drain,
    greedy,
    lively_mla_model,
    lively_model,
    make_engine,
    solo,
    static_logits,
)
from test_serving_engine import check_resumed_requests_reprefilled

import dantinox as dx
from dantinox.cli import entrypoint as cli
from dantinox.cli.serve import build_engine, kv_summary
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.kv.paged import PagedLatentKV
from dantinox.kv.sizes import page_bytes
from dantinox.kv.pool import init_pool, pool_nbytes

P = 4  # block size
M = 8  # block-table entries (max_context 32 / P)
PATHS = {"absorbed": True, "naive": False}


def mla_config(**overrides) -> dx.ModelConfig:
    return dx.ModelConfig.from_preset("tiny-mla", **overrides)


# The engine tests run the absorbed path (mla_absorb's default) in the default tier and the naive one in the slow
# tier (~13 s of engine programs); both paths' paged logits equal the static cache's in the default tier below.
@pytest.fixture(scope="module", params=["absorbed", pytest.param("naive", marks=pytest.mark.slow)],
                ids=list(PATHS))
def model(request):
    return lively_mla_model(mla_config(mla_absorb=PATHS[request.param], max_context=64))


@pytest.mark.parametrize("path", list(PATHS))
def test_mla_paged_logits_equal_static_ragged_chunked(path):
    cfg = mla_config(mla_absorb=PATHS[path])
    model = lively_mla_model(cfg)
    rng = np.random.default_rng(1)
    lengths = [5, 11, 17]
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    perm = 1 + rng.permutation(16)  # non-contiguous, interleaved tables; block 0 only as a padding entry
    tables = np.zeros((3, M), np.int32)
    tables[0, :2], tables[1, :3], tables[2, :5] = perm[:2], perm[2:5], perm[5:10]
    pool = init_pool(cfg, 17, P)
    assert all(isinstance(layer, PagedLatentKV) for layer in pool)
    assert pool[0].c_kv.shape == (17, P, cfg.kv_latent_dim) and pool[0].k_rope.shape == (17, P, cfg.rope_head_dim)
    got, pool = chunked_paged_run(model, pool, seqs, tables)
    for b in range(3):
        np.testing.assert_allclose(got[b], static_logits(model, seqs[b]), atol=1e-5, rtol=0)
    untouched = np.concatenate([[0], perm[10:]])  # padding and unused rows wrote nothing
    for layer in pool:
        c_kv, k_rope = np.asarray(layer.c_kv), np.asarray(layer.k_rope)   # on the host: no eager compiles
        assert float(np.abs(c_kv[untouched]).max()) == 0.0
        assert float(np.abs(k_rope[untouched]).max()) == 0.0
        assert float(np.abs(c_kv[perm[0]]).max()) > 0  # and the listed blocks were written


def test_mla_pool_bytes_use_the_planners_bytes_per_token():
    cfg = mla_config()
    per_token = (cfg.kv_latent_dim + cfg.rope_head_dim) * 4  # float32 latent + RoPE key
    assert dx.bytes_per_token_per_layer(cfg) == per_token
    assert page_bytes(cfg, P) == P * cfg.num_blocks * per_token
    assert pool_nbytes(init_pool(cfg, 7, P)) == 7 * page_bytes(cfg, P) == dx.kv_cache_bytes(cfg, 1, 7 * P)


def prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def test_mla_engine_greedy_outputs_equal_batch_one_generate(model):
    engine = make_engine(model, num_blocks=40)
    batch = prompts(model.cfg.vocab_size, [1, 4, 9, 17, 30], seed=3)
    ids = [engine.add_request(p, greedy(12)) for p in batch]
    results = drain(engine)
    for rid, prompt in zip(ids, batch):
        tokens, reason = results[rid]
        assert reason == "length" and len(set(tokens)) > 3  # a discriminating output
        assert tokens == solo(model, prompt, 12)
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("policy", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_mla_preempted_requests_resume_with_the_right_output(model, policy):
    engine = make_engine(model, num_blocks=10, preemption=policy, enable_prefix_caching=False, max_running=3)
    batch = prompts(model.cfg.vocab_size, [6, 7, 9])
    ids = [engine.add_request(p, greedy(16)) for p in batch]
    results = drain(engine)
    stats = engine.stats()
    assert stats["preemptions"] >= 1, stats
    for rid, prompt in zip(ids, batch):
        assert results[rid] == (solo(model, prompt, 16), "length")
    preempted = [r for r in engine.finished if r.num_preemptions]
    assert preempted and any(e[1] == policy for r in preempted for e in r.events if e[0] == "preempt")
    for req in preempted:
        check_resumed_requests_reprefilled(req)
    assert stats["blocks_free"] == 10 and not engine.allocator.tables


def test_mla_serve_start_line_holds_more_tokens_than_gqa_for_the_same_bytes(tmp_path):
    tokenizer = train_tokenizer("Nel mezzo del cammin di nostra vita\n" * 4, "char")
    budget = 64 * 1024
    tokens = {}
    for name, cfg in (("mla", mla_config(vocab_size=tokenizer.vocab_size)),
                      ("gqa", tiny_config(attention="gqa", kv_heads=2, vocab_size=tokenizer.vocab_size))):
        build = lively_mla_model if name == "mla" else lively_model
        save_run(tmp_path / name, build(cfg), cfg.replace(tie_embeddings=False), tokenizer)
        args = cli.build_parser().parse_args(["serve", "--run_dir", str(tmp_path / name), "--kv-memory",
                                              "64KiB", "--block-size", "4"])
        engine, _, _ = build_engine(args)
        # The planner's figure, independently: L x (C + R) or L x 2 K D elements of 4 bytes per token.
        per_token = cfg.num_blocks * 4 * ((cfg.kv_latent_dim + cfg.rope_head_dim) if name == "mla"
                                          else 2 * cfg.kv_heads * cfg.head_size)
        assert dx.kv_bytes_per_token(cfg) == per_token
        n = budget // (4 * per_token)
        assert engine.allocator.num_blocks == n and engine.stats()["kv_cache_bytes"] == n * 4 * per_token
        line = kv_summary(engine)
        assert line.startswith(f"KV cache: {n} blocks = {4 * n} tokens, max concurrency {n // 8} at 32 tokens "
                               "per request"), line
        tokens[name] = 4 * n
    assert tokens["mla"] > tokens["gqa"]  # 24 elements per token and layer against 32
