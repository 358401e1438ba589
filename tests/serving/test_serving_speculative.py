"""Speculative decoding in the serving engine (``EngineConfig.speculative``, ``dantinox serve --speculative ngram``):
greedy output equal to plain served greedy token for token, stop ids and max_tokens, logprobs, n > 1 choices,
abort, preemption, the switch-off rule with synthetic costs, the scheduler's lookahead blocks, usage and /metrics,
bad flags; no recompilation after warm-up (slow)."""

import numpy as np
import pytest
from cli_util import run_main
from conftest import tiny_config
from serving_util import (assert_speculation_compiles_nothing_after_warmup,
                          drain, greedy, lively_mla_model, lively_model, make_engine)

import dantinox as dx
from dantinox.generation.speculative import PROBE_VERIFIES
from dantinox.kv.allocator import BlockAllocator
from dantinox.serving.metrics import ServerMetrics
from dantinox.serving.protocol import usage_body
from dantinox.serving.request import Request, SamplingOptions
from dantinox.serving.scheduler import Chunk, ContextPolicy, Scheduler
from dantinox.serving.speculation import SpecConfig, SpecRowStats, plan_speculation

CFG = tiny_config(attention="gqa", kv_heads=2, max_context=64)
SPEC = SpecConfig(spec_tokens=3, verify_costs=((1, 1.0),))   # priced: no timing in the tests
ENGINE = dict(num_blocks=40, max_decode_steps=1, decode_buckets=(4,))   # the engine tests' pool: shared programs


@pytest.fixture(scope="module")
def model():
    return lively_model(CFG)


def cyclic(n: int, period: int, seed: int) -> list:
    """n tokens repeating a random run of ``period`` (prompt lookup finds matches; the model often follows)."""
    base = np.random.default_rng(seed).integers(0, CFG.vocab_size, period).tolist()
    return (base * (n // period + 1))[:n]


# Four concurrent requests of different prompt lengths and max_tokens; the model cycles on the third.
BATCH = [(cyclic(12, 4, 1), 20), (cyclic(20, 5, 2), 14), (cyclic(7, 3, 3), 25), (cyclic(16, 8, 4), 9)]


def serve(model, requests, spec=SPEC, **fields):
    """(engine, [(tokens, finish reason)], [final RequestOutput.speculative]) of ``requests`` [(prompt, options)]
    run together."""
    engine = make_engine(model, **{**ENGINE, **fields}, speculative=spec)
    ids = [engine.add_request(p, o) for p, o in requests]
    last = {}
    results = drain(engine, on_step=None)
    for req in engine.finished:
        last[req.request_id] = None if req.spec is None else (req.spec.proposed, req.spec.accepted)
    return engine, [results[i] for i in ids], [last[i] for i in ids]


def test_greedy_speculative_serving_equals_plain_served_greedy(model):
    requests = [(p, SamplingOptions(max_new_tokens=n, stop_token_ids=(46,) if i == 1 else ()))
                for i, (p, n) in enumerate(BATCH)]
    plain, expected, _ = serve(model, requests, spec=None)
    engine, got, spec = serve(model, requests)
    assert got == expected
    assert [r for _, r in got] == ["length", "stop", "length", "length"]   # request 1 ends on its stop id
    stats = engine.stats()
    assert stats["spec_verify_calls"] > 0 and 0 < stats["spec_accepted_tokens"] <= stats["spec_proposed_tokens"]
    assert stats["spec_proposer"] == "ngram" and "spec_proposer" not in plain.stats()
    assert stats["steps"] < plain.stats()["steps"]               # accepted proposals saved engine steps
    assert sum(a for _, a in spec) == stats["spec_accepted_tokens"]
    assert sum(p for p, _ in spec) == stats["spec_proposed_tokens"]
    assert stats["blocks_used"] == 0 and not engine.allocator.tables
    prompt_hashes = {h for p, _ in requests for h in engine.allocator.prompt_hashes(p)}
    cached = set(engine.allocator.pool._by_hash)
    assert cached and cached <= prompt_hashes   # blocks of generated (or rejected) tokens are never cached


def test_logprobs_are_the_targets_for_every_emitted_token(model):
    requests = [(p, SamplingOptions(max_new_tokens=n, logprobs=2)) for p, n in BATCH[1:3]]
    plain = make_engine(model, **ENGINE)
    spec = make_engine(model, **ENGINE, speculative=SPEC)
    outputs = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        ids = [engine.add_request(p, o) for p, o in requests]
        got = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                assert len(out.logprobs or []) == len(out.new_token_ids)
                got[out.request_id] += out.logprobs or []
        outputs[name] = [got[rid] for rid in ids]
    assert spec.stats()["spec_accepted_tokens"] > 0
    for a_row, b_row in zip(outputs["plain"], outputs["spec"]):
        assert [lp.token_id for lp in a_row] == [lp.token_id for lp in b_row]
        np.testing.assert_allclose([lp.logprob for lp in a_row], [lp.logprob for lp in b_row], atol=1e-4)
        assert [[t for t, _ in lp.top] for lp in a_row] == [[t for t, _ in lp.top] for lp in b_row]


def test_sampling_top_k_1_is_greedy_and_a_seed_repeats(model):
    prompt, n = BATCH[2]
    one = [(prompt, SamplingOptions(max_new_tokens=n, temperature=0.8, top_k=1, seed=5)),
           (prompt, SamplingOptions(max_new_tokens=n, temperature=1.0, top_p=0.9, seed=11))]
    _, first, _ = serve(model, one)
    _, again, _ = serve(model, one)
    _, greedy_out, _ = serve(model, [(prompt, greedy(n))], spec=None)
    assert first[0] == greedy_out[0]      # a one-token nucleus: the rejection rule accepts exactly the argmax
    assert first == again                 # per-request PRNG streams: the same seed gives the same tokens
    assert all(0 <= t < CFG.vocab_size for t in first[1][0]) and len(first[1][0]) == n


@pytest.mark.slow
def test_per_row_keys_keep_the_targets_distribution():
    """accept_proposals with one key per row (the engine's streams): the first emitted token of a point-mass
    proposal is distributed as the target's p (Leviathan et al. 2023, section 2.3), against a numpy p."""
    import jax
    import jax.numpy as jnp

    from dantinox.generation.sampling import SamplingParams
    from dantinox.generation.speculative import accept_proposals

    B, V = 6000, 4
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    rows = jnp.broadcast_to(jnp.asarray(logits), (B, 2, V))
    proposals = jnp.full((B, 1), 2, jnp.int32)                         # propose token 2 (p = 0.3)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(B))
    sampling = SamplingParams(jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B))
    tokens, accepted = jax.jit(accept_proposals)(rows, proposals, keys, sampling)
    freq = np.bincount(np.asarray(tokens[:, 0]), minlength=V) / B
    p = np.exp(logits) / np.exp(logits).sum()
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / B)), (freq, p)
    assert abs(float(np.mean(np.asarray(accepted))) - p[2]) < 4 * np.sqrt(p[2] * (1 - p[2]) / B)


def test_n_choices_share_the_prompt_and_abort_frees_blocks(model):
    prompt, n = BATCH[2]
    engine = make_engine(model, **ENGINE, speculative=SPEC)
    a = engine.add_request(prompt, greedy(n))
    b = engine.add_request(prompt, greedy(n), share_prompt_with=a)
    c = engine.add_request(BATCH[0][0], greedy(40))
    early = {a: [], b: []}
    for _ in range(3):
        for out in engine.step():
            early.get(out.request_id, []).extend(out.new_token_ids)
    assert engine.abort(c)
    results = drain(engine)
    assert early[a] + results[a][0] == early[b] + results[b][0] and len(early[a] + results[a][0]) == n
    assert results[c][1] == "abort"
    assert engine.stats()["blocks_used"] == 0 and not engine.allocator.tables


def test_switch_off_rule_with_synthetic_costs():
    def chunk(verifies=0, accepted=0, generated=0, max_new=32):
        req = Request("r", [1, 2, 3], SamplingOptions(max_new_tokens=max_new))
        req.output_ids = [0] * (generated + 1)
        req.num_computed = req.num_tokens - 1
        req.spec = SpecRowStats(verifies, verifies * 4, accepted)
        return Chunk(req, req.num_computed, 1)

    held = lambda c: 8   # noqa: E731  every row holds k + 1 slots and more
    cheap = SpecConfig(spec_tokens=4, verify_costs=((2, 1.2), (8, 4.0)))   # c(1) = c(2) = 1.2
    fresh = [chunk()]
    assert list(plan_speculation(fresh, cheap, held).values()) == [4]          # probing first
    good = [chunk(PROBE_VERIFIES, 2 * PROBE_VERIFIES)]                         # 2 accepted per call > 0.2
    assert list(plan_speculation(good, cheap, held).values()) == [4]
    poor = [chunk(PROBE_VERIFIES, 0)]                                          # 0 accepted: below 0.2
    assert plan_speculation(poor, cheap, held) is None
    # a batch of 8 makes a verify call cost 4 plain steps: 2 accepted per call (3 tokens) no longer pays
    assert plan_speculation([chunk(PROBE_VERIFIES, 2 * PROBE_VERIFIES) for _ in range(8)], cheap, held) is None
    assert plan_speculation([chunk(PROBE_VERIFIES, 4 * PROBE_VERIFIES) for _ in range(8)], cheap, held)
    mixed = plan_speculation([chunk(PROBE_VERIFIES, 0), chunk()], cheap, held)
    assert sorted(mixed.values()) == [0, 4]                                    # the poor row stops proposing
    near_end = chunk(generated=29, max_new=32)                                 # 2 tokens left: 1 proposal
    assert list(plan_speculation([near_end], cheap, held).values()) == [1]
    assert plan_speculation([chunk(generated=30, max_new=32)], cheap, held) is None   # last token: plain
    assert list(plan_speculation(fresh, cheap, lambda c: 2).values()) == [1]   # blocks hold 2 slots
    with pytest.raises(ValueError, match="verify_costs"):
        SpecConfig(verify_costs=((0, 1.0),))


def test_scheduler_lookahead_takes_only_free_blocks():
    alloc = BlockAllocator(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(ContextPolicy(max_prompt_tokens=63, max_total_tokens=64, max_batched_tokens=16), alloc,
                      lookahead=6)
    a = Request("a", list(range(7)), SamplingOptions(max_new_tokens=20))
    b = Request("b", list(range(5)), SamplingOptions(max_new_tokens=3))
    for req in (a, b):
        sched.add(req)
    first = sched.schedule()                   # both prefill: 2 blocks each, no lookahead (not decoding)
    assert [c.num_tokens for c in first.chunks] == [7, 5] and alloc.num_free == 0
    for chunk in first.chunks:
        chunk.request.num_computed += chunk.num_tokens
        chunk.request.output_ids.append(1)
    second = sched.schedule()                  # decoding, the pool is full: no lookahead, nobody preempted
    assert not second.preempted and [len(alloc.table(r)) for r in "ab"] == [2, 2]
    sched.remove(b)                            # two blocks free up
    third = sched.schedule()
    assert len(alloc.table("a")) == 4          # positions 7..13: 1 + 6 lookahead slots (blocks up to 16)
    assert [c.num_tokens for c in third.chunks] == [1]


def test_usage_and_metrics_report_speculation():
    assert usage_body(5, 7, (12, 9))["speculative"] == {"proposed": 12, "accepted": 9}
    assert "speculative" not in usage_body(5, 7)
    metrics = ServerMetrics()
    metrics.update({"spec_proposer": "ngram", "spec_proposed_tokens": 10, "spec_accepted_tokens": 4})
    metrics.update({"spec_proposer": "ngram", "spec_proposed_tokens": 16, "spec_accepted_tokens": 7})
    text = metrics.render().decode()
    assert 'dantinox_spec_proposed_tokens_total{proposer="ngram"} 16.0' in text
    assert 'dantinox_spec_accepted_tokens_total{proposer="ngram"} 7.0' in text


@pytest.mark.parametrize("flags, message", [
    (["--speculative", "ngram", "--spec-tokens", "0"], "--spec-tokens 0 is not allowed"),
    (["--speculative", "ngram", "--spec-tokens", "17"], "--spec-tokens 17 is not allowed"),
    (["--speculative", "medusa"], "--speculative medusa is not allowed"),
    (["--spec-tokens", "3"], "--spec-tokens needs --speculative"),
    (["--speculative", "ngram", "--spec-verify-cost", "4:x"], "--spec-verify-cost 4:x is not allowed"),
    (["--spec-verify-cost", "2"], "--spec-verify-cost needs --speculative"),
])
def test_bad_speculative_flags_exit_2_with_one_line(capsys, flags, message):
    status, _, err = run_main(["serve", "--port", "1", *flags], capsys)
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_spec_verify_cost_parses_to_the_engines_costs():
    from dantinox.cli.serve import parse_verify_costs

    assert parse_verify_costs("1.5") == ((1, 1.5),)
    assert parse_verify_costs("1:1.3,4:2.5") == ((1, 1.3), (4, 2.5))
    assert SpecConfig(verify_costs=parse_verify_costs("1:1.3,4:2.5")).cost(3) == 2.5


def test_speculative_with_a_diffusion_run_is_refused(capsys, monkeypatch):
    import dantinox.cli.serve as serve_cli

    monkeypatch.setattr(serve_cli, "bind_address", lambda host, port: None)
    status, _, err = run_main(["serve", "--run_dir", "dante-diffusion", "--speculative", "ngram"], capsys)
    assert status == 2 and "paradigm='diffusion'" in err and len(err.strip().splitlines()) == 1, err


# Slow tier ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_no_recompilation_after_warmup(model):
    engine = make_engine(model, num_blocks=14, preemption="swap", speculative=SPEC)
    assert_speculation_compiles_nothing_after_warmup(engine, BATCH + BATCH[:2])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_preempted_requests_keep_their_accepted_tokens(model, policy):
    requests = [(p, greedy(n)) for p, n in BATCH]
    _, expected, _ = serve(model, requests, spec=None)
    engine, got, _ = serve(model, requests, num_blocks=12, preemption=policy, enable_prefix_caching=False,
                           max_running=3)
    assert engine.stats()["preemptions"] >= 1 and engine.stats()["spec_accepted_tokens"] > 0
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("attention, cache_dtype", [("mha", "float32"), ("gqa", "int8"), ("mla", "float32")])
def test_greedy_equality_across_attention_kinds_and_int8(attention, cache_dtype):
    if attention == "mla":
        cfg = dx.ModelConfig.from_preset("tiny-mla", max_context=64, cache_dtype=cache_dtype)
    else:
        cfg = tiny_config(attention=attention, max_context=64, cache_dtype=cache_dtype,   # int8: per-token keys
                          **({"kv_heads": 2, "kv_keys": "token"} if attention == "gqa" else {}))   # (channel keys:
        #                           test_speculation_over_per_channel_keys_equals_plain_served_greedy)
    net = lively_mla_model(cfg) if attention == "mla" else lively_model(cfg)
    requests = [(p, greedy(n)) for p, n in BATCH]
    _, expected, _ = serve(net, requests, spec=None)
    engine, got, _ = serve(net, requests)
    assert got == expected and engine.stats()["spec_verify_calls"] > 0


@pytest.mark.slow
def test_multi_step_decoding_takes_over_when_speculation_stops_paying(model):
    """With a verify call priced at 4 plain steps, the cycling request keeps speculating while the others
    stop after their probes; with multi-step decoding on, the output is still plain greedy's."""
    requests = [(p, greedy(n)) for p, n in BATCH]
    _, expected, _ = serve(model, requests, spec=None, max_decode_steps=8)
    priced = SpecConfig(spec_tokens=3, verify_costs=((1, 1.5), (4, 4.0)))
    engine, got, _ = serve(model, requests, spec=priced, max_decode_steps=8)
    assert got == expected and engine.stats()["multi_step_calls"] > 0


def test_speculation_over_per_channel_keys_needs_spec_tokens_below_the_key_group():
    """The residual ring holds two groups, so a verify write of k + 1 tokens must fit one group: k + 1 > G is
    refused naming both flags."""
    model = dx.build_model(tiny_config(attention="gqa", kv_heads=2, max_context=64, cache_dtype="int8",
                                       kv_keys="channel", kv_key_group=4))
    with pytest.raises(ValueError, match="--spec-tokens.*--kv-key-group|--kv-key-group.*--spec-tokens"):
        make_engine(model, speculative=SpecConfig(spec_tokens=4))


def test_speculation_over_per_channel_keys_equals_plain_served_greedy():
    """Per-channel int8 keys in groups of 4 (k + 1 = 4 fits): the four requests finish at different steps, so a
    request's batch row soon differs from its residual slot; each verify call must read and write its own
    request's residual ring (it once used slot b for row b) to give plain served greedy's tokens and their
    log-probabilities."""
    model = lively_model(CFG.replace(cache_dtype="int8", kv_keys="channel", kv_key_group=4))
    outputs = {}
    for spec in (None, SPEC):
        engine = make_engine(model, **ENGINE, speculative=spec)
        ids = [engine.add_request(p, SamplingOptions(max_new_tokens=n, logprobs=1)) for p, n in BATCH]
        got = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.logprobs or []
        outputs[spec] = [got[rid] for rid in ids]
    assert engine.stats()["spec_verify_calls"] > 0 and engine.residuals is not None
    for plain, speculated in zip(outputs[None], outputs[SPEC]):
        assert [lp.token_id for lp in plain] == [lp.token_id for lp in speculated]
        np.testing.assert_allclose([lp.logprob for lp in plain], [lp.logprob for lp in speculated], atol=1e-5)


def test_unpriced_speculation_probes_plain_steps_then_measures_its_cost(model):
    """Without verify_costs the engine first runs plain decode steps (timed), then verify calls (timed); the
    output is plain greedy's whatever the measured cost decides."""
    requests = [(BATCH[2][0], greedy(25))]
    _, expected, _ = serve(model, requests, spec=None)
    kinds = []
    engine = make_engine(model, **ENGINE, speculative=SpecConfig(spec_tokens=3))
    rid = engine.add_request(*requests[0])
    got = drain(engine, on_step=lambda step, tokens: kinds.append([c[0] for c in engine.step_calls]))
    assert [got[rid]] == expected
    decode = [k for k in kinds if k][1:]             # the steps after the prefill step
    assert decode[:3] == [["forward"]] * 3          # probing: 1 untimed + MIN_SAMPLES timed plain steps
    assert ["verify"] in decode and not engine.verify_meter.needs_plain(4)   # bucket B = 4
