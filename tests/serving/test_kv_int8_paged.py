"""The int8 KV cache in the serving engine's paged pool (issue 10): int8 blocks plus scale blocks; paged
logits equal the int8 static cache's; swap moves the scales with their blocks, prefix-cached blocks share
them, copy-on-write copies them; K06 and K08 with an int8 pool; ``--kv-dtype int8`` with the same
--kv-memory gives more blocks and admits more concurrent sequences; bad --kv-dtype values exit 2 naming the
flag."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import spiky_mla, spiky_model, tiered, tiny_config, uncached_logits
from serving_util import chunked_paged_run, drain, greedy, lively_model, make_engine, solo, static_logits
from test_serving_engine import check_resumed_requests_reprefilled, run_k08_schedule

import dantinox as dx
from dantinox.budget import kv_sink_bytes
from dantinox.cli import entrypoint as cli
from dantinox.cli.serve import build_engine, kv_summary
from dantinox.kv.channel_layout import ChannelQuantLayerKV
from dantinox.runs.run_dir import save_run
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.kv.paged import PagedQuantKV, PagedQuantLatentKV
from dantinox.kv.sizes import page_bytes, sink_slot_bytes
from dantinox.kv.pool import init_pool, pool_nbytes
from dantinox.kv.block_moves import copy_blocks, read_blocks, write_blocks

P, M = 4, 8  # block size; block-table entries (max_context 32 / P)
# The per-token int8 pool (PagedQuantKV): kv_keys="token" (per-channel keys, the int8 default of MHA / GQA /
# MQA, are tests/serving/test_kv_channel_paged.py's); MLA's latent pool is always per token.
KINDS = {"mha": dict(attention="mha", kv_heads=None, kv_keys="token"),
         "gqa": dict(attention="gqa", kv_heads=2, kv_keys="token"),
         "mqa": dict(attention="mqa", kv_heads=None, kv_keys="token"),
         "mla": dict(attention="mla", kv_heads=None, kv_latent_dim=16, rope_head_dim=8)}
CFG = tiny_config(attention="gqa", kv_heads=2, max_context=64, cache_dtype="int8", kv_keys="token")


@pytest.fixture(scope="module")
def model():
    return lively_model(CFG)


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


@pytest.mark.parametrize("kind", tiered(KINDS, slow=["mha", "mqa"]))
def test_int8_paged_logits_equal_the_int8_static_cache_ragged_chunked(kind):
    cfg = tiny_config(cache_dtype="int8", **KINDS[kind])
    model = spiky_mla(cfg) if kind == "mla" else spiky_model(cfg)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11, 17)]
    perm = 1 + rng.permutation(16)
    tables = np.zeros((3, M), np.int32)
    tables[0, :2], tables[1, :3], tables[2, :5] = perm[:2], perm[2:5], perm[5:10]
    pool = init_pool(cfg, 17, P, sink_slots=3)          # row b's sinks in slot b (K13)
    assert isinstance(pool[0], PagedQuantLatentKV if kind == "mla" else PagedQuantKV)
    got, pool = chunked_paged_run(model, pool, seqs, tables)
    for b in range(3):
        uncached = uncached_logits(model, [seqs[b]])[0, :len(seqs[b])]   # the round-trip reference
        assert np.abs(got[b] - static_logits(model, seqs[b])).max() <= 1e-5
        assert np.abs(got[b] - uncached).max() <= 1e-5
    untouched = np.concatenate([[0], perm[10:]])
    for layer in pool:
        host = [np.asarray(a) for a in layer]                                    # on the host: no eager compiles
        assert all(float(np.abs(a[untouched]).max()) == 0.0 for a in host[:4])   # rows and scales
        assert all(float(np.abs(a[b]).max()) > 0.0 for a in host[4:] for b in range(3))  # each row's sinks
        assert float(host[2][perm[0]].max()) > 0.0                               # written blocks have scales


@pytest.mark.parametrize("kind", KINDS)
def test_int8_pool_bytes_include_the_scale_blocks(kind):
    cfg = tiny_config(cache_dtype="int8", **KINDS[kind])
    pool = init_pool(cfg, 7, P)
    sinks = kv_sink_bytes(cfg)                    # one sink slot: a sequence's float32 sink rows (K13)
    assert sinks > 0 and page_bytes(cfg, P) == P * dx.kv_bytes_per_token(cfg)
    assert pool_nbytes(pool) == 7 * page_bytes(cfg, P) + sinks == 7 * P * dx.kv_bytes_per_token(cfg) + sinks
    layer = pool[0]
    assert layer[0].dtype == jnp.int8 and layer[2].dtype == jnp.float32 and layer[2].shape[:2] == (7, P)
    assert layer[2].shape[-1] == 1


def filled_pool(cfg, n):
    """An int8 pool whose every array holds distinct nonzero values (rows, scales and sink rows)."""
    pool = init_pool(cfg, n, P)
    rng = np.random.default_rng(0)
    return tuple(type(layer)(*(jnp.asarray(rng.integers(1, 100, a.shape).astype(a.dtype)) for a in layer))
                 for layer in pool)


def test_swap_out_and_in_moves_the_scales_with_their_blocks():
    pool = filled_pool(CFG, 8)
    before = [[np.asarray(a) for a in layer] for layer in pool]
    host = read_blocks(pool, jnp.asarray([1, 2], jnp.int32))                   # swap out blocks 1, 2
    pool = write_blocks(pool, jnp.asarray([5, 6], jnp.int32), host)            # swap in as blocks 5, 6
    for layer, old in zip(pool, before):
        for a, b in zip(layer[:4], old):                   # k, v, k_scale, v_scale (sinks: per sequence)
            np.testing.assert_array_equal(np.asarray(a)[[5, 6]], b[[1, 2]])


def test_copy_on_write_copies_the_scales():
    pool = filled_pool(CFG, 8)
    before = [[np.asarray(a) for a in layer] for layer in pool]
    pool = copy_blocks(pool, jnp.asarray([3, 0], jnp.int32), jnp.asarray([7, 8], jnp.int32))   # 8: padding
    for layer, old in zip(pool, before):
        for a, b in zip(layer[:4], old):                   # the block arrays; the sinks are per sequence
            np.testing.assert_array_equal(np.asarray(a)[7], b[3])
            np.testing.assert_array_equal(np.asarray(a)[:7], b[:7])


@pytest.mark.parametrize("policy", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_int8_preempted_requests_resume_with_the_int8_static_output(model, policy):
    engine = make_engine(model, num_blocks=10, preemption=policy, enable_prefix_caching=False, max_running=3)
    batch = prompts([6, 7, 9])
    ids = [engine.add_request(p, greedy(16)) for p in batch]
    results = drain(engine)
    assert engine.stats()["preemptions"] >= 1
    for rid, prompt in zip(ids, batch):
        tokens, reason = results[rid]
        assert len(set(tokens)) > 3 and tokens == solo(model, prompt, 16)   # static int8 cache, batch 1
    for req in engine.finished:
        if req.num_preemptions:
            check_resumed_requests_reprefilled(req)


@pytest.mark.parametrize("max_decode_steps", tiered([1, 8], slow=[1]))
def test_K08_int8_requests_join_and_leave_the_batch(model, max_decode_steps):
    runs = [run_k08_schedule(model, max_decode_steps) for _ in range(2)]
    assert runs[0] == runs[1]
    for name, (tokens, prompt, n) in runs[0].items():
        assert tokens == solo(model, prompt, n), name        # the int8 static cache, batch 1


def test_int8_prefix_cached_blocks_share_their_scales_and_copy_on_write_copies_them(model):
    engine = make_engine(model, num_blocks=40)
    shared = prompts([8], seed=4)[0]
    first = engine.add_request(shared, greedy(6))
    first_token = engine.step()[0].new_token_ids
    second = engine.add_request(shared, greedy(6))                 # wholly cached: copy-on-write of block 2
    third = engine.add_request(shared[:4] + [1, 2, 3], greedy(6))  # first block shared
    results = drain(engine)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 3 and stats["cow_copies"] == 1
    assert results[second][0] == first_token + results[first][0] == solo(model, shared, 6)
    assert results[third][0] == solo(model, shared[:4] + [1, 2, 3], 6)


def serve_engine(run_dir, kv_dtype, memory="64KiB"):
    flags = ["serve", "--run_dir", run_dir, "--kv-memory", memory, "--block-size", "4", "--max-running", "8",
             "--max-batched-tokens", "1024"]
    int8 = ["--kv-dtype", kv_dtype, "--kv-keys", "token"] if kv_dtype else []   # the per-token pool's arithmetic
    return build_engine(cli.build_parser().parse_args(flags + int8))[0]


@pytest.fixture(scope="module")
def float_run(tmp_path_factory):
    tokenizer = train_tokenizer("Nel mezzo del cammin di nostra vita\n" * 4, "char")
    cfg = tiny_config(attention="mqa", kv_heads=None, n_heads=2, head_size=32, vocab_size=tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("run") / "mqa"
    save_run(path, lively_model(cfg), cfg.replace(tie_embeddings=False), tokenizer)
    return str(path)


@pytest.mark.slow   # two engines built as `dantinox serve` builds them, 24 requests each (~11 s)
def test_serve_kv_dtype_int8_logs_more_blocks_and_admits_more_sequences_in_the_same_memory(float_run):
    engines = {name: serve_engine(float_run, name) for name in (None, "int8")}
    fp32, int8 = engines[None], engines["int8"]
    assert fp32.cfg.cache_dtype == "float32" and int8.cfg.cache_dtype == "int8"
    budget = 64 * 1024
    sinks = 2 * 8 * sink_slot_bytes(int8.cfg)   # K13: 2 x max_running sink slots, paid before the blocks
    assert fp32.allocator.num_blocks == budget // page_bytes(fp32.cfg, 4)
    assert int8.allocator.num_blocks == (budget - sinks) // page_bytes(int8.cfg, 4)
    for engine in (fp32, int8):
        assert engine.stats()["kv_cache_bytes"] <= budget
    # 2 x 32 x 4 bytes against 2 x (32 + 4) per token, less the sink slots: 32 fp32 blocks, 56 int8 blocks
    assert int8.allocator.num_blocks >= 1.7 * fp32.allocator.num_blocks
    assert "int8" in kv_summary(int8) and f"{int8.allocator.num_blocks} blocks" in kv_summary(int8)
    admitted = {}
    for name, engine in engines.items():   # 24 requests of 28 + 4 tokens: 7 blocks to start, 8 at the end
        for prompt in prompts([28] * 24, seed=3):
            engine.add_request([t % engine.vocab_size for t in prompt], greedy(4))
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.stats()["running"])
        admitted[name] = peak
    assert 1 <= admitted[None] <= fp32.allocator.num_blocks // 7
    assert admitted["int8"] >= 1.5 * admitted[None], admitted


@pytest.mark.parametrize("command", [["verify"], ["generate", "--prompt", "Nel"]])
def test_bad_kv_dtype_exits_2_naming_the_flag_and_the_allowed_values(command, capsys, float_run):
    assert cli.main(command + ["--run_dir", float_run, "--kv-dtype", "int4"]) == 2
    err = capsys.readouterr().err
    assert "--kv-dtype 'int4' is not allowed" in err and "int8" in err and len(err.strip().splitlines()) == 1


def test_serve_bad_kv_dtype_is_rejected_before_loading(float_run):
    args = cli.build_parser().parse_args(["serve", "--run_dir", float_run, "--kv-dtype", "fp8"])
    with pytest.raises(dx.KVDtypeError, match="--kv-dtype 'fp8' is not allowed"):
        build_engine(args)


def test_int8_for_a_diffusion_model_is_a_clear_error():
    model = dx.build_model(tiny_config(paradigm="diffusion", attention="mha", kv_heads=None, mask_token_id=127))
    with pytest.raises(dx.KVDtypeError, match=r"--kv-dtype int8 cannot be used.*paradigm='diffusion'"):
        dx.with_kv_dtype(model, "int8")


def test_verify_cli_with_kv_dtype_int8_passes_and_prints_the_distance_to_the_float_cache(float_run, capsys):
    assert cli.main(["verify", "--run_dir", float_run, "--kv-dtype", "int8", "--new_tokens", "8",
                     "--tolerance", "1e-5", "--prompt", "Nel mezzo"]) == 0
    out = capsys.readouterr().out
    assert "cache=int8" in out and "PASS" in out
    distance = float(out.split("float32 cached| logits = ")[1].split()[0])
    assert distance > 1e-5


def test_generate_with_kv_dtype_int8_uses_an_int8_cache_with_the_run_parameters(float_run, capsys):
    from dantinox.generation.generator import Generator

    gen = Generator(float_run, warmup=False, kv_dtype="int8")
    plain = Generator(float_run, warmup=False)
    assert gen.cfg.cache_dtype == "int8" and plain.cfg.cache_dtype == "float32"
    assert gen.cfg.channel_keys and isinstance(dx.init_cache(gen.cfg, 1)[0], ChannelQuantLayerKV)   # the default
    token = Generator(float_run, warmup=False, kv_dtype="int8", kv_keys="token")
    assert isinstance(dx.init_cache(token.cfg, 1)[0], dx.QuantLayerKV)
    np.testing.assert_array_equal(np.asarray(gen.model.embed.embedding[...]),
                                  np.asarray(plain.model.embed.embedding[...]))
    text = gen.generate("Nel mezzo", 12, temperature=0)
    assert text == gen.generate("Nel mezzo", 12, temperature=0, use_cache=False)   # int8 round-trip reference
    assert cli.main(["generate", "--run_dir", float_run, "--kv-dtype", "int8", "--prompt", "Nel mezzo",
                     "--max_new_tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "Nel mezzo" + text + "\n"
