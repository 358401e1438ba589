"""Per-channel int8 keys (KIVI) in the serving engine's paged pool (issue 19, item 3): the served logits and greedy
tokens equal the eval view ``dantinox.quality.channel_keys.ChannelKeyKV`` run through the plain model (the same
numbers as the layout), through chunked prefill, multi-step decode, preemption by swap and by recompute,
prefix-cache hits and n > 1 choices; the pool's bytes equal the engine's and the planner's accounting; the
warm-up compiles every program; bad block sizes are refused naming the flags."""

from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from serving_util import chunked_paged_run, drain, greedy, lively_model, make_engine, static_logits

import dantinox as dx
from dantinox.quality.channel_keys import channel_key_cache
from dantinox.serving import EngineConfig, PagedEngine
from dantinox.kv.sizes import page_bytes, sink_slot_bytes
from dantinox.kv.pool import init_pool, pool_nbytes
from dantinox.kv.channel_paged import PagedChannelKV
from dantinox.kv.sizes import residual_slot_bytes
from dantinox.kv.sink_slots import slots_for

G = 4
CFG = tiny_config(attention="gqa", kv_heads=2, max_context=64, cache_dtype="int8", kv_keys="channel",
                  kv_key_group=G)


@pytest.fixture(scope="module")
def model():
    return lively_model(CFG)


@partial(jax.jit, static_argnames=("graphdef",))
def _view_logits(graphdef, params, ids):
    model = nnx.merge(graphdef, params)
    cache = channel_key_cache(model.cfg, 1, model.cfg.max_context, model.cfg.kv_key_group)
    logits, _, _ = model(ids, use_cache=True, kv_caches=cache, cache_index=jnp.zeros(1, jnp.int32))
    return logits[0]


def view_logits(model, tokens) -> np.ndarray:
    """The reference: the eval view over the whole sequence, padded to max_context (one compile). [T, V]."""
    ids = np.zeros((1, model.cfg.max_context), np.int32)
    ids[0, :len(tokens)] = tokens
    return np.asarray(_view_logits(nnx.graphdef(model), nnx.state(model), ids))[:len(tokens)]


def view_greedy(model, prompt, n) -> list:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(view_logits(model, tokens)[-1])))
    return tokens[len(prompt):]


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


@pytest.mark.parametrize("P, sinks", [(4, 4), pytest.param(8, 0, marks=pytest.mark.slow)])
def test_paged_logits_equal_the_eval_view_in_ragged_chunks(P, sinks):
    cfg = CFG.replace(kv_sink_tokens=sinks)
    model = lively_model(cfg)
    seqs = prompts((5, 11, 17), seed=1)
    M = cfg.max_context // P
    perm = 1 + np.random.default_rng(2).permutation(3 * M)
    tables = np.zeros((3, M), np.int32)
    for b, n in enumerate((5, 11, 17)):
        k = -(-n // P)
        tables[b, :k] = perm[b * M:b * M + k]
    pool = init_pool(cfg, 3 * M + 1, P, sink_slots=4, residual_slots=4)
    assert isinstance(pool[0], PagedChannelKV) and pool[0].k_scale.shape == (3 * M + 1, P // G, 2, 8)
    got, pool = chunked_paged_run(model, pool, seqs, tables)
    errors = [float(np.abs(got[b] - view_logits(model, seqs[b])).max()) for b in range(3)]
    per_token = lively_model(cfg.replace(kv_keys="token"))   # the layout matters: per-token keys differ more
    layout_gap = float(np.abs(static_logits(per_token, seqs[2]) - got[2]).max())
    print(errors, layout_gap)
    assert max(errors) <= 2e-6 and layout_gap > 50 * max(max(errors), 1e-7)


def test_paged_logits_with_a_sliding_window_equal_the_static_channel_cache():
    """A sliding-window model (Mistral's kind) with the int8 default: the paged pool masks the keys older than
    the window as the static per-channel cache does (sinks included), in ragged chunks; without the window the
    logits differ, so the mask is exercised."""
    cfg = CFG.replace(sliding_window=6)
    model = lively_model(cfg)
    seqs = prompts((5, 11, 17), seed=1)
    M = cfg.max_context // G
    tables = np.zeros((3, M), np.int32)
    for b, n in enumerate((5, 11, 17)):
        tables[b, :-(-n // G)] = 1 + b * M + np.arange(-(-n // G))
    pool = init_pool(cfg, 3 * M + 1, G, sink_slots=4, residual_slots=4)
    got, _ = chunked_paged_run(model, pool, seqs, tables)
    for b in range(3):
        assert np.abs(got[b] - static_logits(model, seqs[b])).max() <= 2e-6, b
    unwindowed = lively_model(cfg.replace(sliding_window=None))
    assert np.abs(got[2] - static_logits(unwindowed, seqs[2])).max() > 1e-3


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
@pytest.mark.parametrize("steps", [8, 1])
def test_served_greedy_tokens_equal_the_eval_view_chunked_and_multi_step(model, steps):
    batch = prompts([5, 11, 23], seed=3)                              # 23 tokens: two prefill chunks of 16
    engine = make_engine(model, num_blocks=40, max_decode_steps=steps)   # the pool of the tests below
    ids = [engine.add_request(p, greedy(9)) for p in batch]
    results = drain(engine)
    assert [results[rid][0] for rid in ids] == [view_greedy(model, p, 9) for p in batch]
    assert engine.residuals.of_seq == {} and engine.stats()["blocks_used"] == 0


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_preempted_requests_resume_with_the_eval_view_tokens(model, policy):
    engine = make_engine(model, num_blocks=10, preemption=policy, enable_prefix_caching=False, max_running=3)
    batch = prompts([6, 7, 9], seed=4)
    ids = [engine.add_request(p, greedy(14)) for p in batch]
    results = drain(engine)
    assert engine.stats()["preemptions"] >= 1
    for rid, prompt in zip(ids, batch):
        assert results[rid][0] == view_greedy(model, prompt, 14)
    if policy == "swap":
        assert any(e[0] == "swap_in" for req in engine.finished for e in req.events)


def test_prefix_hits_resume_at_a_group_boundary_and_match_the_eval_view(model):
    engine = make_engine(model, num_blocks=40)
    shared = prompts([8], seed=5)[0]                                  # two full blocks of P = G = 4
    first = engine.add_request(shared, greedy(6))
    engine.step()
    second = engine.add_request(shared, greedy(6))                   # wholly cached: resumes at slot 4
    third = engine.add_request(shared[:4] + [1, 2, 3, 4, 5], greedy(6))  # first block shared
    results = drain(engine)
    assert engine.stats()["prefix_cache_hits"] == 3
    second_req = next(r for r in engine.finished if r.request_id == second)
    assert second_req.num_cached_tokens == 8
    assert results[second][0] == view_greedy(model, shared, 6)
    assert len(results[first][0]) == 5 and results[first][0] == view_greedy(model, shared, 6)[1:]
    assert results[third][0] == view_greedy(model, shared[:4] + [1, 2, 3, 4, 5], 6)


def test_n_choices_share_the_prompt_blocks_and_match_the_eval_view(model):
    prompt = prompts([13], seed=6)[0]                                 # 3 full blocks of 4 and one token
    engine = make_engine(model, num_blocks=40)
    ids = [engine.add_request(prompt, greedy(7), request_id=f"c{i}", share_prompt_with="c0" if i else None)
           for i in range(3)]
    results = drain(engine)
    want = view_greedy(model, prompt, 7)
    assert [results[rid][0] for rid in ids] == [want] * 3
    assert engine.stats()["prefix_cache_hits"] == 2 * 3


def test_pool_bytes_equal_the_engines_accounting_and_kv_memory_counts_the_residual_slots(model):
    K, D, L, P, R, Q = 2, 8, 2, 8, slots_for(3), 3
    per_block = L * (P * (2 * K * D + 4 * K) + (P // G) * K * D * 4)   # int8 k, v; value scales; key scales
    assert page_bytes(CFG, P) == per_block
    assert residual_slot_bytes(CFG) == L * 2 * G * K * D * 4 and sink_slot_bytes(CFG) == L * 4 * 2 * K * D * 4
    pool = init_pool(CFG, 5, P, sink_slots=R, residual_slots=Q)
    assert pool_nbytes(pool) == 5 * per_block + R * sink_slot_bytes(CFG) + Q * residual_slot_bytes(CFG)
    fixed = R * sink_slot_bytes(CFG) + Q * residual_slot_bytes(CFG)
    budget = fixed + 7 * per_block + per_block - 1                     # 7 blocks and a byte short of an 8th
    engine = PagedEngine(model, EngineConfig(block_size=P, max_running=3, kv_memory_bytes=budget,
                                             kv_memory_all=True))
    assert engine.allocator.num_blocks == 7 and engine.pool_size.residual_slots == Q
    assert engine.stats()["kv_cache_bytes"] == fixed + 7 * per_block <= budget
    # at G = D the per-token cost is the per-token layout's (2 K (D + 4) bytes a layer), residual aside
    token = CFG.replace(kv_keys="token")
    assert page_bytes(CFG.replace(kv_key_group=8, head_size=8), 8) == page_bytes(token, 8)


def test_the_plan_ledger_counts_the_channel_pool_exactly(model):
    from dantinox.plan.candidate import Candidate
    from dantinox.plan.ledger import memory_ledger

    cfg = CFG.replace(cache_dtype="float32")                         # the candidate's kv_dtype decides
    cand = Candidate(kv_dtype="int8", block_size=4, max_running=2)
    ledger = memory_ledger(cfg, cand, 10_000, 10 ** 9)
    engine = PagedEngine(model, cand.engine_config())
    assert ledger.kv_blocks == engine.allocator.num_blocks
    assert ledger.kv == pool_nbytes(engine.pool)


def test_default_block_sizes_hold_whole_key_groups_for_the_engine_and_the_planner(model):
    """Per-channel keys are the int8 default: EngineConfig without a block size takes the key group (4 here;
    16 for other caches), the planner's int8 candidate takes the same, and a candidate whose block size splits
    a group is refused naming it and the sizes that work."""
    from dantinox.plan.candidate import Candidate, default_candidates
    from dantinox.plan.ledger import memory_ledger

    assert PagedEngine(model, EngineConfig(max_running=2)).allocator.block_size == G
    token = dx.build_model(CFG.replace(kv_keys="token"))
    assert PagedEngine(token, EngineConfig(max_running=2)).allocator.block_size == 16
    cfg = CFG.replace(cache_dtype="float32", kv_key_group=32)
    sizes = {c.name: c.for_model(cfg).block_size for c in default_candidates()}
    assert sizes["max-throughput"] == 32 and sizes["baseline"] == 16 and sizes["block-32"] == 32
    assert Candidate(kv_dtype="int8").serve_flags().get("block_size") is None        # serve picks the same
    with pytest.raises(ValueError, match=r"candidate 'odd': block_size=24 is not allowed with kv_dtype=int8.*"
                                         r"groups of 32 tokens .*block_size=32"):
        memory_ledger(cfg, Candidate("odd", kv_dtype="int8", block_size=24), 10_000, 10 ** 9)
    memory_ledger(cfg, Candidate("odd", block_size=24), 10_000, 10 ** 9)    # a float candidate: any size
    unsized = memory_ledger(cfg, Candidate("unsized", kv_dtype="int8", max_running=2), 10_000, 10 ** 9)
    assert unsized.kv == memory_ledger(cfg, Candidate("sized", kv_dtype="int8", max_running=2, block_size=32),
                                       10_000, 10 ** 9).kv


def test_block_sizes_that_split_a_key_group_are_refused_naming_the_flags(model):
    with pytest.raises(ValueError, match=r"--block-size 6 is not allowed with per-channel int8 keys .*group 4"):
        make_engine(model, block_size=6)
    with pytest.raises(ValueError, match="--block-size 2 is not allowed"):
        init_pool(CFG, 4, 2)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_no_recompilation_after_warmup(model):
    engine = make_engine(model, num_blocks=14, preemption="swap", decode_buckets=(4,), prefill_buckets=(4,),
                         chunk_buckets=(16,), max_decode_steps=4)        # few programs: a cheap warm-up
    engine.warmup()
    with dx.CompileCounter() as counted:
        for i, prompt in enumerate(prompts([1, 3, 17, 30, 6, 9], seed=7)):
            engine.add_request(prompt, greedy(12 + i))
        drain(engine)
    assert counted.compilations == 0 and counted.cache_hits == 0, counted
    assert engine.stats()["preemptions"] >= 1   # the swap path ran too


@pytest.mark.slow
def test_served_greedy_speculation_equals_plain_served_greedy(model):
    """n-gram speculation (k = 3 at G = 4: rejected proposals complete key groups the rollback un-completes)
    serves the plain served greedy tokens, and the verify calls reject proposals (6 s: slow tier)."""
    from dantinox.serving.speculation import SpecConfig

    base = np.random.default_rng(8).integers(0, CFG.vocab_size, 3).tolist()
    batch = [(base * 4)[:n] for n in (7, 10)]
    plain = make_engine(model, num_blocks=40, max_decode_steps=1, decode_buckets=(4,))
    spec = make_engine(model, num_blocks=40, max_decode_steps=1, decode_buckets=(4,),
                       speculative=SpecConfig(spec_tokens=3, verify_costs=((1, 1.0),)))
    want, got = ([drain_ids(e, batch, 14)] for e in (plain, spec))
    assert got == want
    finished = [r.spec for r in spec.finished if r.spec is not None]
    assert sum(s.proposed for s in finished) > sum(s.accepted for s in finished)   # rejected: rolled back


def drain_ids(engine, batch, n):
    ids = [engine.add_request(p, greedy(n)) for p in batch]
    results = drain(engine)
    return [results[i][0] for i in ids]


def test_spec_tokens_past_the_key_group_are_refused_naming_both_flags(model):
    from dantinox.serving.speculation import SpecConfig

    with pytest.raises(ValueError, match="--spec-tokens 4 is not allowed with --kv-key-group 4"):
        make_engine(model, num_blocks=40, speculative=SpecConfig(spec_tokens=4))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from dantinox.runs.run_dir import save_run
    from dantinox.runs.tokenizer import train_tokenizer

    tokenizer = train_tokenizer("Nel mezzo del cammin di nostra vita\n" * 4, "char")
    cfg = tiny_config(attention="gqa", kv_heads=2, vocab_size=tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("run") / "gqa"
    save_run(path, lively_model(cfg), cfg.replace(tie_embeddings=False), tokenizer)
    return str(path)


def serve_args(run_dir, *flags):
    from dantinox.cli import entrypoint as cli

    return cli.build_parser().parse_args(["serve", "--run_dir", run_dir, "--max-running", "2", *flags])


def test_serve_kv_keys_channel_builds_a_channel_pool_with_the_group_as_block_size(run_dir):
    from dantinox.cli.serve import build_engine, kv_summary

    engine = build_engine(serve_args(run_dir, "--kv-dtype", "int8", "--kv-keys", "channel", "--kv-key-group", "8"))[0]
    assert engine.cfg.channel_keys and engine.cfg.kv_key_group == 8 and engine.allocator.block_size == 8
    assert isinstance(engine.pool[0], PagedChannelKV) and engine.pool[0].k_resid.shape == (2, 16, 2, 8)
    assert "keys per channel in groups of 8" in kv_summary(engine)
    default = build_engine(serve_args(run_dir, "--kv-dtype", "int8"))[0]     # the int8 default: channel keys,
    assert default.cfg.channel_keys and default.cfg.key_group == 32           # G = 64 clipped to the 32-token
    assert default.allocator.block_size == 32                                 # context, and a block of G
    token = build_engine(serve_args(run_dir, "--kv-dtype", "int8", "--kv-keys", "token"))[0]
    assert not token.cfg.channel_keys and token.allocator.block_size == 16


@pytest.mark.parametrize("flags, message", [
    (["--kv-keys", "channel"], "--kv-keys channel needs an int8 MHA / GQA / MQA cache"),
    (["--kv-dtype", "int8", "--kv-keys", "token", "--kv-key-group", "8"],
     "--kv-key-group 8 is not allowed with --kv-keys token"),
    (["--kv-key-group", "8"], "--kv-key-group 8 needs an int8 MHA / GQA / MQA cache"),
    (["--kv-dtype", "int8", "--kv-key-group", "64"], "--kv-key-group 64 is not allowed: longer than the model's "
                                                     "max_context=32"),
    (["--kv-dtype", "int8", "--kv-keys", "channel", "--kv-key-group", "8", "--block-size", "12"],
     "--block-size 12 is not allowed with per-channel int8 keys .*--kv-key-group 8"),
    (["--kv-dtype", "int8", "--block-size", "16"],              # the default layout: G = 32 here
     "--block-size 16 is not allowed with per-channel int8 keys .*--kv-key-group 32"),
    (["--kv-dtype", "int8", "--kv-keys", "channel", "--kv-key-group", "0"], "--kv-key-group 0 is not allowed"),
])
def test_serve_refuses_bad_key_layout_flags_naming_them(run_dir, flags, message):
    from dantinox.cli.serve import build_engine

    with pytest.raises(ValueError, match=message):
        build_engine(serve_args(run_dir, *flags))


def test_channel_keys_on_mla_are_refused_naming_the_flag():
    from dantinox.cli.serve import with_kv_keys

    mla = SimpleNamespace(cfg=tiny_config(attention="mla", kv_heads=None, kv_latent_dim=16, rope_head_dim=8,
                                          cache_dtype="int8"))   # only its config is read
    with pytest.raises(ValueError, match="--kv-keys channel needs an int8 MHA / GQA / MQA cache.*attention='mla'"):
        with_kv_keys(mla, "channel", None)


def test_residual_slots_are_one_per_running_sequence():
    from dantinox.kv.residual_slots import ResidualSlots

    slots = ResidualSlots(2)
    assert (slots.take("a"), slots.take("b")) == (0, 1)
    with pytest.raises(RuntimeError, match="all 2 residual slots are held"):
        slots.take("c")
    with pytest.raises(ValueError, match="already holds residual slot 1"):
        slots.take("b")
    slots.release("a")
    slots.release("unknown")
    assert slots.take("c") == 0 and slots.slot("b") == 1 and slots.slot("a") is None
