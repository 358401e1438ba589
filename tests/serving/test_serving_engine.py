"""Continuous batching engine: K06 (preemption with recompute and swap), K08 (join/leave), no recompilation,
prefix caching with copy-on-write, admission bounds, abort."""

import numpy as np
import pytest
from conftest import tiny_config
from serving_util import drain, greedy, lively_model, make_engine, solo

import dantinox as dx
import dantinox.serving.engine as engine_module
from dantinox.serving.request import QueueFullError, RequestError, SamplingOptions

CFG = tiny_config(attention="gqa", kv_heads=2, max_context=64)


@pytest.fixture(scope="module")
def model():
    return lively_model(CFG)


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def check_resumed_requests_reprefilled(req):
    """After each recompute preemption, the chunks re-feed prompt + generated tokens from position 0 before
    the next token; after a swap-in, feeding continues where it stopped."""
    events = req.events
    for i, event in enumerate(events):
        if event[0] != "preempt":
            continue
        policy, generated = event[1], event[2]
        later = events[i + 1:]
        upto = next(j for j, e in enumerate(later) if e[0] == "token")
        chunks = [e for e in later[:upto] if e[0] == "chunk"]
        if policy == "recompute":
            assert chunks[0][1] == 0
            assert sum(c[2] for c in chunks) == len(req.prompt_ids) + generated
        else:
            swap_in = next(e for e in later if e[0] == "swap_in")
            assert chunks[0][1] == swap_in[1] == len(req.prompt_ids) + generated - 1


@pytest.mark.parametrize("policy", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_k06_preempted_requests_resume_with_the_right_output(model, policy):
    engine = make_engine(model, num_blocks=10, preemption=policy, enable_prefix_caching=False, max_running=3)
    batch = prompts([6, 7, 9])
    ids = [engine.add_request(p, greedy(16)) for p in batch]
    results = drain(engine)
    stats = engine.stats()
    assert stats["preemptions"] >= 1, stats
    for rid, prompt in zip(ids, batch):
        tokens, reason = results[rid]
        assert len(tokens) == 16 and reason == "length" and len(set(tokens)) > 3  # a discriminating output
        assert tokens == solo(model, prompt, 16)
    big = make_engine(model, num_blocks=40)   # large enough for any one of them alone; shares the 40-block programs
    for prompt in batch:  # alone with a large pool
        rid = big.add_request(prompt, greedy(16))
        assert drain(big)[rid][0] == solo(model, prompt, 16)
    preempted = [r for r in engine.finished if r.num_preemptions]
    assert preempted
    for req in preempted:
        check_resumed_requests_reprefilled(req)
    assert stats["blocks_free"] == 10 and stats["blocks_used"] == 0 and not engine.allocator.tables


def run_k08_schedule(model, max_decode_steps: int = 1) -> dict:
    """K08: A joins; after A's 5th token B and C join; after B finishes D joins. Returns outputs by name.
    With multi-step decoding A may be past its 5th token when B and C join (A decodes alone until then)."""
    engine = make_engine(model, num_blocks=40, max_decode_steps=max_decode_steps)
    p = dict(zip("ABCD", prompts([5, 11, 2, 7], seed=8)))
    n = dict(A=30, B=10, C=15, D=12)
    ids = {"A": engine.add_request(p["A"], greedy(n["A"]))}
    tokens, reasons = {}, {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if "B" not in ids and len(tokens.get(ids["A"], [])) >= 5:
            assert len(tokens[ids["A"]]) == 5 or max_decode_steps > 1
            ids["B"] = engine.add_request(p["B"], greedy(n["B"]))
            ids["C"] = engine.add_request(p["C"], greedy(n["C"]))
        if "B" in ids and "D" not in ids and ids["B"] in reasons:
            ids["D"] = engine.add_request(p["D"], greedy(n["D"]))
    stats = engine.stats()
    assert stats["blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["errors"] == 0 and set(reasons.values()) == {"length"}
    return {name: (tokens[rid], p[name], n[name]) for name, rid in ids.items()}


@pytest.mark.parametrize("max_decode_steps", [1, 8])
def test_k08_requests_join_and_leave_the_batch(model, max_decode_steps):
    runs = [run_k08_schedule(model, max_decode_steps) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    for name, (tokens, prompt, n) in runs[0].items():
        assert tokens == solo(model, prompt, n), name


def test_no_recompilation_after_warmup(model):
    engine = make_engine(model, num_blocks=14, preemption="swap")
    engine.warmup()
    with dx.CompileCounter() as counted:
        batch = prompts([1, 3, 17, 30, 6, 9], seed=5)
        for i, prompt in enumerate(batch):
            engine.add_request(prompt, SamplingOptions(max_new_tokens=12 + i, temperature=0.5 * (i % 2),
                                                       top_k=i, top_p=0.9, seed=i))
        drain(engine)
    assert counted.compilations == 0 and counted.cache_hits == 0, counted   # nothing compiled, nothing loaded
    assert engine.stats()["preemptions"] >= 1  # the swap path ran too


def test_sampled_requests_match_batch_one_generate_with_the_same_seed(model):
    engine = make_engine(model, num_blocks=40)
    batch = prompts([4, 12, 7], seed=2)
    settings = [dict(temperature=0.9, top_k=20, seed=7), dict(temperature=1.2, top_p=0.8, seed=3),
                dict(temperature=0.0, seed=0)]
    ids = [engine.add_request(p, SamplingOptions(max_new_tokens=10, **s)) for p, s in zip(batch, settings)]
    results = drain(engine)
    for rid, prompt, s in zip(ids, batch, settings):
        assert results[rid][0] == solo(model, prompt, 10, **s)


def test_prefix_cache_hit_and_copy_on_write(model):
    engine = make_engine(model, num_blocks=40)
    shared = prompts([8], seed=4)[0]  # exactly two full blocks
    first = engine.add_request(shared, greedy(6))
    first_token = engine.step()[0].new_token_ids  # first's prompt is computed, its two full blocks cached
    second = engine.add_request(shared, greedy(6))          # wholly cached: last token recomputed, COW
    third = engine.add_request(shared[:4] + [1, 2, 3], greedy(6))  # first block cached
    results = drain(engine)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 3 and stats["cow_copies"] == 1
    assert results[second][0] == first_token + results[first][0] == solo(model, shared, 6)
    assert results[third][0] == solo(model, shared[:4] + [1, 2, 3], 6)
    assert engine.finished[-1].num_cached_tokens + engine.finished[-2].num_cached_tokens == 12
    assert stats["blocks_used"] == 0 and first not in engine.requests


def test_admission_bounds_and_input_errors(model):
    engine = make_engine(model, num_blocks=6, max_queued=2)
    with pytest.raises(RequestError, match="max_prompt_tokens=63") as err:
        engine.add_request([1] * 64, greedy(1))
    assert err.value.field == "prompt"
    with pytest.raises(RequestError, match="exceeds the context limit of 64") as err:
        engine.add_request([1] * 40, greedy(30))
    assert err.value.field == "max_tokens"
    with pytest.raises(RequestError, match="need 7 KV blocks; the whole cache has 6"):
        engine.add_request([1] * 20, greedy(8))
    for bad, field in ((SamplingOptions(temperature=-1.0), "temperature"),
                       (SamplingOptions(temperature=1e39), "temperature"),   # past float32: the CLI's refusal too
                       (SamplingOptions(top_p=0.0), "top_p"), (SamplingOptions(top_k=-2), "top_k"),
                       (SamplingOptions(max_new_tokens=0), "max_tokens"), (SamplingOptions(seed=-1), "seed")):
        with pytest.raises(RequestError) as err:
            engine.add_request([1, 2], bad)
        assert err.value.field == field
    for bad_prompt in ([], [1, CFG.vocab_size], "text", [1.5]):
        with pytest.raises(RequestError) as err:
            engine.add_request(bad_prompt, greedy(2))
        assert err.value.field == "prompt"
    engine.add_request([1, 2], greedy(2), request_id="x")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([1, 2], greedy(2), request_id="x")
    engine.add_request([1, 2], greedy(2))
    with pytest.raises(QueueFullError, match="max_queued=2"):
        engine.add_request([1, 2], greedy(2))
    assert engine.stats()["waiting"] == 2


def test_abort_frees_blocks_and_reports_once(model):
    engine = make_engine(model, num_blocks=40)   # the pool size of the other tests: its programs are compiled
    keep = engine.add_request(prompts([9], seed=6)[0], greedy(12))
    drop = engine.add_request(prompts([13], seed=7)[0], greedy(12))
    for _ in range(3):
        engine.step()
    assert engine.abort(drop) and not engine.abort(drop) and not engine.abort("unknown")
    results = drain(engine)
    assert results[drop][1] == "abort" and results[keep][1] == "length"
    assert engine.stats()["blocks_used"] == 0 and engine.stats()["aborted"] == 1


def test_a_failed_step_ends_running_requests_with_an_error_and_the_engine_goes_on(model):
    engine = make_engine(model, num_blocks=40)
    first = engine.add_request(prompts([5], seed=9)[0], greedy(6))
    engine.step()
    run, calls = engine._run, []

    def broken(chunks):
        calls.append(len(chunks))
        engine._run = run
        raise RuntimeError("device lost")

    engine._run = broken
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(first, "error")]
    assert "device lost" in outputs[0].error and engine.stats()["blocks_used"] == 0
    again = engine.add_request(prompts([5], seed=9)[0], greedy(6))
    assert drain(engine)[again] == (solo(model, prompts([5], seed=9)[0], 6), "length")


def test_multi_step_decoding_gives_the_single_step_tokens(model, monkeypatch):
    """Multi-step decode calls (max_decode_steps=8) give every request exactly the tokens of one-token steps
    and of batch-1 dx.generate: greedy and seeded sampling, a stop token, a waiting queue, a tight pool."""
    batch = prompts([3, 9, 14, 5, 11, 7], seed=12)
    options = [greedy(20), SamplingOptions(max_new_tokens=17, temperature=0.9, top_k=20, seed=5), greedy(3),
               SamplingOptions(max_new_tokens=25, temperature=1.3, top_p=0.8, seed=11), greedy(12), greedy(9)]
    reference = drain_all(make_engine(model, num_blocks=40, max_decode_steps=1), batch, options)
    stop = reference[0][0][6]  # request 0 stops at its 7th token (or earlier, at an earlier equal token)
    options[0] = SamplingOptions(max_new_tokens=20, stop_token_ids=(stop,))
    reference = drain_all(make_engine(model, num_blocks=40, max_decode_steps=1), batch, options)
    for engine in (make_engine(model, num_blocks=40, max_decode_steps=8),):   # this pool reads filled blocks only:
        assert engine.reads_filled and engine.table_buckets == (16,)           # one table width
        assert drain_all(engine, batch, options) == reference
    monkeypatch.setattr(engine_module, "MIN_TABLE_TOKENS", 16)  # block tables cut to 4, 8 or 16 entries
    monkeypatch.setattr(engine_module, "reads_filled_only", lambda cfg: False)   # as MLA / per-channel pools do
    for blocks in (40, 14):  # 14 blocks of 4 tokens: requests wait for blocks and rows run out of them
        engine = make_engine(model, num_blocks=blocks, max_decode_steps=8)
        assert engine.table_buckets == (4, 8, 16)
        assert drain_all(engine, batch, options) == reference
        stats = engine.stats()
        assert stats["multi_step_calls"] > 0 and stats["blocks_used"] == 0 and stats["errors"] == 0
    assert reference[0][1] == "stop" and len(reference[0][0]) <= 7
    for prompt, opts, (tokens, _) in zip(batch, options, reference):
        want = dx.generate(model, [prompt], opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                           top_p=opts.top_p, seed=opts.seed)[0].tolist()
        assert tokens == want[:len(tokens)]


def drain_all(engine, batch, options) -> list:
    ids = [engine.add_request(p, o) for p, o in zip(batch, options)]
    results = drain(engine)
    return [results[rid] for rid in ids]
