"""Draft-model speculation in the serving engine (``serve --speculative draft:RUN``, ``serving.draft_model``,
``serving.draft_verify``): greedy output and logprobs equal plain served greedy with concurrent requests of
different lengths, a prefix-cache hit and forced preemption (recompute and swap), for a draft that disagrees
often and for the target as its own draft (accepts everything); the draft's pool holds exactly the positions the
target's does after every step; sampled output follows the target's distribution (chi-square, a draft that
disagrees often); no recompilation after warm-up; the pool budget counts the draft's blocks; /metrics by
proposer "draft"; bad inputs (another tokenizer, a diffusion draft, --mesh) exit 2 with one line.

Cost: every engine compiles its own programs (the pair's forward and verify calls), 10-20 s each on the shared
host, so everything that generates is in the slow tier; the refusals and the sizing run in the default tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_util import run_main
from conftest import forward, tiny_config
from flax import nnx
from run_util import make_run
from scipy.stats import chi2
from serving_util import (assert_speculation_compiles_nothing_after_warmup,
                          drain, lively_mla_model, lively_model, make_engine)

import dantinox as dx
from dantinox.cli.serve import kv_summary
from dantinox.generation.sampling import filtered_probs, make_sampling_params
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.metrics import ServerMetrics
from dantinox.kv.sizes import page_bytes
from dantinox.kv.pool import pool_nbytes
from dantinox.serving.request import SamplingOptions
from dantinox.serving.speculation import SpecConfig

CFG = tiny_config(attention="gqa", kv_heads=2, max_context=64)
DRAFT_CFG = tiny_config(attention="mha", max_context=64, num_blocks=1)   # another attention kind, one layer
SPEC = SpecConfig("draft", spec_tokens=3, verify_costs=((1, 1.0),))     # priced: every decode step verifies


@pytest.fixture(scope="module")
def target():
    return lively_model(CFG)


@pytest.fixture(scope="module")
def draft():
    """An unrelated random model over the same vocabulary: most proposals are rejected."""
    return lively_model(DRAFT_CFG, seed=11)


def noisy_copy(model, scale: float, seed: int):
    """The model with Gaussian noise of ``scale`` times each weight array's std added: a draft of the target's
    shape that agrees with its argmax about half the time at scale 0.2."""
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [a + scale * jnp.std(a) * jax.random.normal(k, a.shape, a.dtype)
             if jnp.issubdtype(a.dtype, jnp.floating) and a.size > 1 else a for a, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(tree, noisy))


DRAFTS = {   # name -> (draft of the target, policy, bounds of its acceptance rate)
    "mha-1-layer": (lambda target, draft: draft, "recompute", (0.0, 0.5)),
    "self": (lambda target, draft: target, "swap", (0.95, 1.0)),
    "noisy": (lambda target, draft: noisy_copy(target, 0.2, 1), "recompute", (0.1, 0.9)),
    "mla": (lambda target, draft: lively_mla_model(dx.ModelConfig.from_preset(
        "tiny-mla", max_context=64, vocab_size=CFG.vocab_size), seed=5), "swap", (0.0, 0.9)),
}


def cyclic(n: int, period: int, seed: int) -> list:
    base = np.random.default_rng(seed).integers(0, CFG.vocab_size, period).tolist()
    return (base * (n // period + 1))[:n]


# Five concurrent requests of different lengths; the second repeats the first prompt (a prefix-cache hit).
BATCH = [(cyclic(12, 4, 1), 20), (cyclic(12, 4, 1), 18), (cyclic(20, 5, 2), 14), (cyclic(7, 3, 3), 25),
         (cyclic(16, 8, 4), 9)]


def run(model, draft=None, spec=None, on_step=None, **fields):
    """(engine, [[TokenLogprobs] per request]) of BATCH run together, greedy with logprobs=2."""
    engine = make_engine(model, draft=draft, speculative=spec, **fields)
    ids = []
    for i, (p, n) in enumerate(BATCH):   # the second takes the first's prompt blocks (prefix cache, as n > 1)
        ids.append(engine.add_request(p, SamplingOptions(max_new_tokens=n, logprobs=2),
                                      share_prompt_with=ids[0] if i == 1 else None))
    got = {rid: [] for rid in ids}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.logprobs or []) == len(out.new_token_ids)
            got[out.request_id] += out.logprobs or []
        if on_step is not None:
            on_step(engine)
        step += 1
        assert step < 2000, engine.stats()
    return engine, [got[rid] for rid in ids]


def draft_rows_match(engine, draft) -> int:
    """Check that the draft's layers of the pool hold, for every running request, the draft's keys and values
    of its tokens at positions 0 .. num_computed - 1 (against the draft's static-cache prefill). Returns the
    requests checked."""
    L = engine.cfg.num_blocks
    checked = 0
    for req in engine.scheduler.running:
        n = req.num_computed
        table = engine.allocator.table(req.request_id)
        if n == 0 or not table:
            continue
        cache = dx.init_cache(engine.draft_cfg, 1)
        _, cache, _ = forward(draft, np.array([req.all_tokens[:n]], np.int32), use_cache=True, kv_caches=cache,
                              cache_index=0)
        for layer, ref in zip(engine.pool[L:], cache):
            for paged, static in zip(layer, ref):   # k, v [N, P, K, D] vs [1, K, S, D]; MLA [N, P, C] vs [1, S, C]
                rows = np.asarray(paged)[np.array(table)].reshape(-1, *paged.shape[2:])[:n]
                static = np.asarray(static)[0]
                expected = static[:n] if static.ndim == 2 else np.moveaxis(static[:, :n], 1, 0)
                np.testing.assert_allclose(rows, expected, atol=2e-4, err_msg=f"{req.request_id}: rows 0..{n - 1}")
        checked += 1
    return checked


def assert_same_logprobs(expected, got):
    for plain, speculated in zip(expected, got):
        assert [lp.token_id for lp in plain] == [lp.token_id for lp in speculated]
        np.testing.assert_allclose([lp.logprob for lp in plain], [lp.logprob for lp in speculated], atol=1e-4)
        assert [[t for t, _ in lp.top] for lp in plain] == [[t for t, _ in lp.top] for lp in speculated]


# Default tier -------------------------------------------------------------------------------------------------

def test_the_pool_budget_counts_the_drafts_blocks(target, draft):
    """kv_memory_bytes buys blocks of target + draft bytes; the pool allocated stays within the budget."""
    P, budget = 4, 200_000
    per_block = page_bytes(CFG, P) + page_bytes(DRAFT_CFG, P)
    engine = PagedEngine(target, EngineConfig(block_size=P, kv_memory_bytes=budget, kv_memory_all=True,
                                              speculative=SPEC), draft=draft)
    assert engine.allocator.num_blocks == budget // per_block
    assert pool_nbytes(engine.pool) <= budget and len(engine.pool) == CFG.num_blocks + DRAFT_CFG.num_blocks
    share = engine.allocator.num_blocks * page_bytes(DRAFT_CFG, P) / 2**20
    assert f"of which the draft model's float32 layers {share:.2f} MiB" in kv_summary(engine)
    plain = PagedEngine(target, EngineConfig(block_size=P, kv_memory_bytes=budget, kv_memory_all=True))
    assert plain.allocator.num_blocks == budget // page_bytes(CFG, P) > engine.allocator.num_blocks


def test_a_draft_goes_with_the_draft_proposer_and_fits_the_target(target, draft):
    with pytest.raises(ValueError, match="proposer='draft'"):
        PagedEngine(target, EngineConfig(speculative=SpecConfig("ngram")), draft=draft)
    with pytest.raises(ValueError, match="proposer='draft'"):
        PagedEngine(target, EngineConfig(speculative=SPEC))
    with pytest.raises(ValueError, match="draft vocab_size=64 differs"):
        PagedEngine(target, EngineConfig(speculative=SPEC), draft=dx.build_model(DRAFT_CFG.replace(vocab_size=64)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("target") / "run", attention="gqa", kv_heads=2)


def _refused(capsys, monkeypatch, argv):
    import dantinox.cli.serve as serve_cli

    monkeypatch.setattr(serve_cli, "bind_address", lambda host, port: None)
    status, _, err = run_main(["serve", *argv], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1, (status, err)
    return err


def test_a_draft_with_another_tokenizer_is_one_line_exit_2(run_dir, tmp_path, capsys, monkeypatch):
    other = make_run(tmp_path / "bpe", kind="bpe", attention="gqa", kv_heads=2)
    err = _refused(capsys, monkeypatch, ["--run_dir", run_dir, "--speculative", f"draft:{other}"])
    assert f"--speculative draft:{other}" in err and "does not share the target's tokenizer" in err, err
    assert "the draft's vocabulary holds 260 tokens" in err, err


def test_a_diffusion_draft_or_target_is_refused_naming_the_flag(run_dir, tmp_path, capsys, monkeypatch):
    masked = make_run(tmp_path / "masked", attention="gqa", kv_heads=2, paradigm="diffusion")
    err = _refused(capsys, monkeypatch, ["--run_dir", run_dir, "--speculative", f"draft:{masked}"])
    assert f"--speculative draft:{masked}: draft paradigm='diffusion' is not allowed" in err, err
    err = _refused(capsys, monkeypatch, ["--run_dir", masked, "--speculative", f"draft:{run_dir}"])
    assert f"--speculative draft:{run_dir} is not allowed with" in err and "paradigm='diffusion'" in err, err


def test_mesh_with_a_draft_is_refused_naming_both_flags(capsys):
    argv = ["serve", "--port", "1", "--mesh", "data=1,model=1", "--speculative", "draft:dante"]
    status, _, err = run_main(argv, capsys)
    assert status == 2 and "--mesh" in err and "--speculative draft:dante" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_all_accepted_below_k_draws_the_next_token_from_p_not_the_residual():
    """A row whose limit (1) is below k (2) and that accepts its one proposal draws its next token from the
    target's p at that position, not from max(p - q, 0) with the draft's q of a proposal it never made (the
    served limit: max_tokens or blocks cut a row's proposals)."""
    from dantinox.generation.sampling import SamplingParams
    from dantinox.generation.speculative import accept_proposals

    B, V, k = 4000, 4, 2
    p = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p)), (B, k + 1, V))
    q = jnp.full((B, k, V), 0.25, jnp.float32)            # p(3) / q(3) > 1: proposal 3 is always accepted
    proposals = jnp.full((B, k), 3, jnp.int32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(B))
    sampling = SamplingParams(jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B))
    tokens, accepted = jax.jit(accept_proposals)(logits, proposals, keys, sampling, jnp.ones(B, jnp.int32), q)
    assert np.all(np.asarray(accepted) == 1)
    freq = np.bincount(np.asarray(tokens[:, 1]), minlength=V) / B
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / B)), freq


# Slow tier ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_outputs(target):
    """Plain served greedy over a roomy pool: no preemption."""
    return run(target, num_blocks=60)[1]


@pytest.mark.slow
@pytest.mark.parametrize("which", list(DRAFTS))
def test_greedy_equals_plain_served_greedy_with_prefix_hits_and_preemption(target, draft, plain_outputs, which):
    """12 blocks of 4 tokens for 3 running requests of up to 45 tokens: requests are preempted (recompute or
    swap); the second request's prompt blocks come from the prefix cache. Tokens and logprobs are plain served
    greedy's, and after every step the draft's pool holds exactly the target's positions of every running
    request. Drafts: a 1-layer MHA (most proposals rejected), the target itself (all accepted: the draft's
    catch-up write of d_k), a noisy copy of the target (partial acceptance) and an MLA draft."""
    make, policy, (low, high) = DRAFTS[which]
    model = make(target, draft)
    checked = []
    engine, got = run(target, model, SPEC, num_blocks=12, max_running=3, preemption=policy,
                      on_step=lambda e: checked.append(draft_rows_match(e, model)))
    assert_same_logprobs(plain_outputs, got)
    stats = engine.stats()
    assert stats["preemptions"] >= 1 and stats["prefix_cache_hits"] >= 1 and sum(checked) > 0, stats
    assert stats["spec_proposer"] == "draft" and stats["spec_verify_calls"] > 0
    rate = stats["spec_accepted_tokens"] / stats["spec_proposed_tokens"]
    assert low <= rate <= high, rate
    assert stats["blocks_used"] == 0 and not engine.allocator.tables
    metrics = ServerMetrics()
    metrics.update(stats)
    text = metrics.render().decode()
    for key in ("spec_proposed_tokens", "spec_accepted_tokens"):
        line = f'dantinox_{key}_total{{proposer="draft"}} {float(stats[key])}'
        assert (line in text) == (stats[key] > 0), (line, text)


def scaled_model(cfg, seed: int, scale: float = 2.0):
    """A random model with every weight scaled by ``scale``: sharper next-token distributions than the plain
    init's near-uniform ones (two such models overlap by about half; generation's ``varied_model``)."""
    model = dx.build_model(cfg, seed)
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v.set_value(v.get_value() * scale)
    return model


def _chi_square(observed, expected):
    big = expected >= 5
    stat = (((observed[big] - expected[big]) ** 2) / expected[big]).sum()
    rest_e, rest_o = expected[~big].sum(), observed[~big].sum()
    stat += (rest_o - rest_e) ** 2 / rest_e if rest_e > 0 else 0.0
    return chi2.sf(stat, int(big.sum()) - (0 if rest_e > 0 else 1))


def _next_probs(model, prefixes, settings):
    """[len(prefixes), V] float64: the next token's filtered distribution after each prefix (uncached)."""
    logits, _, _ = forward(model, np.array(prefixes, np.int32), use_cache=False)
    return np.asarray(filtered_probs(logits[:, -1], make_sampling_params(len(prefixes), **settings)), np.float64)


def _marginals(model, prompt, settings):
    """(m2 [V], m3 [V]): the exact marginals of the second and third generated tokens after prompt."""
    V = model.cfg.vocab_size
    p1 = _next_probs(model, [prompt], settings)[0]
    p2 = _next_probs(model, [prompt + [a] for a in range(V)], settings)                      # [V, V]
    p3 = _next_probs(model, [prompt + [a, b] for a in range(V) for b in range(V)], settings).reshape(V, V, V)
    joint = p1[:, None] * p2                                                                 # [t1, t2]
    return joint.sum(0), np.einsum("ab,abc->c", joint, p3)


@pytest.mark.slow
def test_sampling_draws_from_the_targets_distribution():
    """1500 served requests of one prompt, seeds 0..1499, 3 tokens each: the verify call after the first token
    has limit 1 < k = 2 (max_tokens), so the second token is the draft's proposal or a residual draw and the
    third, where the proposal was accepted, a draw from the target's p. Both against their exact marginals
    under the target; the draft is an unrelated random model, so most proposals are rejected. The same
    statistic rejects the second token's marginal under the draft (what accepting every proposal would give)."""
    cfg = tiny_config(vocab_size=32, max_context=48, attention="gqa", kv_heads=2)
    model = scaled_model(cfg, seed=4)
    other = scaled_model(tiny_config(vocab_size=32, max_context=48, num_blocks=1), seed=9)   # MHA, 1 layer
    prompt = list(np.random.default_rng(5).permutation(cfg.vocab_size))
    rows, settings = 1500, dict(temperature=0.9, top_p=0.95)
    engine = make_engine(model, draft=other, speculative=SpecConfig("draft", 2, verify_costs=((1, 1.0),)),
                         block_size=8, num_blocks=300, max_running=32, max_queued=rows, decode_buckets=(32,),
                         max_batched_tokens=48, chunk_buckets=(8, 48), max_decode_steps=1)
    ids = [engine.add_request(prompt, SamplingOptions(max_new_tokens=3, seed=i, **settings)) for i in range(rows)]
    results = drain(engine, max_steps=20_000)
    stats = engine.stats()
    assert 0.05 < stats["spec_accepted_tokens"] / stats["spec_proposed_tokens"] < 0.7, stats
    second, third = (np.bincount([results[i][0][j] for i in ids], minlength=cfg.vocab_size) for j in (1, 2))
    m2, m3 = _marginals(model, prompt, settings)
    p1 = _next_probs(model, [prompt], settings)[0]
    q2 = _next_probs(other, [prompt + [a] for a in range(cfg.vocab_size)], settings)
    assert _chi_square(second, rows * m2) > 1e-3 and _chi_square(third, rows * m3) > 1e-3
    assert _chi_square(second, rows * (p1 @ q2)) < 1e-6


@pytest.mark.slow
def test_no_recompilation_after_warmup(target, draft):
    engine = make_engine(target, draft=draft, num_blocks=14, preemption="swap", speculative=SPEC)
    assert_speculation_compiles_nothing_after_warmup(engine, BATCH)


@pytest.mark.slow
def test_an_int8_per_channel_target_with_its_float_draft_equals_plain_served_greedy():
    """The serve default for GQA: int8 keys per channel in groups of 4 (k + 1 = 4 fits) and int8 values with
    float32 sinks; the draft, a noisy copy of the target with the same int8 config, gets a float32 pool
    (``draft_model.float_draft``). Tokens and logprobs are the plain int8 engine's."""
    model = lively_model(CFG.replace(cache_dtype="int8", kv_keys="channel", kv_key_group=4))
    requests = BATCH[:4]
    outputs = {}
    for name, draft in (("plain", None), ("draft", noisy_copy(model, 0.2, 2))):
        engine = make_engine(model, draft=draft, speculative=SPEC if draft is not None else None, num_blocks=40,
                             max_decode_steps=1)
        ids = [engine.add_request(p, SamplingOptions(max_new_tokens=n, logprobs=1)) for p, n in requests]
        got = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.logprobs or []
        outputs[name] = [got[rid] for rid in ids]
    stats = engine.stats()
    assert engine.residuals is not None and engine.draft_cfg.cache_dtype == "float32"
    assert stats["spec_verify_calls"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert_same_logprobs(outputs["plain"], outputs["draft"])


@pytest.mark.slow
def test_stop_ids_end_drafted_requests_where_plain_serving_ends_them(target):
    """A stop id inside a verified chunk ends the request there, as plain serving does: the target as its own
    draft (every proposal accepted, so the stop id arrives inside a chunk of k + 1), stop ids taken from the
    plain run's own output; tokens and finish reasons equal plain served greedy's."""
    def serve(spec, draft, stops):
        engine = make_engine(target, draft=draft, speculative=spec, num_blocks=60)
        ids = [engine.add_request(p, SamplingOptions(max_new_tokens=n, stop_token_ids=s))
               for (p, n), s in zip(BATCH, stops)]
        results = drain(engine)
        return [results[i] for i in ids]

    free = serve(None, None, [()] * len(BATCH))
    stops = [(tokens[len(tokens) // 2],) if i % 2 == 0 else () for i, (tokens, _) in enumerate(free)]
    plain = serve(None, None, stops)
    drafted = serve(SPEC, target, stops)
    assert drafted == plain
    assert [reason for _, reason in plain].count("stop") == 3
