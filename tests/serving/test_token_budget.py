"""The prefill token budget (dantinox.serving.token_budget): derived from a TPOT target and the measured step
costs, clipped to its floor and to --max-batched-tokens, the whole budget when nobody decodes; the engine's
steps follow it (a long prompt beside a running stream is cut into the budget's chunks) and serve's flags refuse
bad values in one line."""

import subprocess
import sys

import pytest
from conftest import tiny_config
from serving_util import drain, greedy, lively_model, make_engine

from dantinox.serving.token_budget import TokenBudget


def test_without_a_target_the_budget_is_max_batched_tokens():
    budget = TokenBudget(None, 512)
    budget.observe(512, 4, 1.0)
    assert budget.budget(4) == 512 and budget.budget(0) == 512


def test_the_budget_keeps_the_target():
    budget = TokenBudget(0.05, 512, min_tokens=16)
    assert budget.budget(2) == 512                       # nothing measured yet
    budget.observe(0, 2, 0.040, iterations=4)            # a decode iteration: 10 ms
    budget.observe(256, 0, 0.512)                        # 2 ms per prefill token
    assert budget.budget(0) == 512                       # nobody decodes: nothing to protect
    assert budget.budget(2) == 20                        # (50 ms - 10 ms) / 2 ms
    budget.observe(20, 2, 0.050)                         # 20 tokens in 40 ms beside the decode: 2 ms still
    assert budget.budget(2) == 20


def test_the_budget_never_drops_below_its_floor_nor_above_the_maximum():
    slow = TokenBudget(0.01, 512, min_tokens=32)
    slow.observe(0, 1, 0.02)                             # the decode alone misses the target
    slow.observe(100, 0, 1.0)
    assert slow.budget(1) == 32
    fast = TokenBudget(1.0, 64, min_tokens=8)
    fast.observe(100, 0, 0.001)
    assert fast.budget(3) == 64


@pytest.mark.parametrize("args, message", [
    ((0, 64, 8), "--tpot-slo 0 is not allowed"), ((-1.0, 64, 8), "--tpot-slo -1.0 is not allowed"),
    ((float("inf"), 64, 8), "--tpot-slo inf is not allowed"),
    ((0.05, 16, 32), "--max-batched-tokens 16 is not allowed with --min-prefill-chunk 32"),
    ((None, 0, 8), "--max-batched-tokens 0 is not allowed")])
def test_bad_budgets_are_refused_naming_the_flags(args, message):
    with pytest.raises(ValueError, match=message):
        TokenBudget(*args)


def test_the_engine_cuts_a_prompt_beside_a_stream_to_the_budget():
    model = lively_model(tiny_config(attention="gqa", kv_heads=2, max_context=64))
    engine = make_engine(model, max_batched_tokens=16, chunk_buckets=(4, 8, 16))
    asked = []
    engine.token_budget.budget = lambda decoding: asked.append(decoding) or (4 if decoding else 16)
    stream = engine.add_request([1, 2, 3], greedy(30))
    first = engine.step()                                            # the stream's prompt: it decodes from now
    long = engine.add_request(list(range(5, 45)), greedy(2))
    out = drain(engine)
    assert len(first[0].new_token_ids) + len(out[stream][0]) == 30 and len(out[long][0]) == 2
    finished = {r.request_id: r for r in engine.finished}
    chunks = [e[2] for e in finished[long].events if e[0] == "chunk" and e[1] < 40]
    assert sum(chunks) == 40 and max(chunks) == 4, chunks            # 4-token chunks beside the stream
    alone = make_engine(model, max_batched_tokens=16, chunk_buckets=(4, 8, 16))
    alone.token_budget.budget = lambda decoding: 4 if decoding else 16
    rid = alone.add_request(list(range(5, 45)), greedy(2))
    drain(alone)
    chunks = [e[2] for e in {r.request_id: r for r in alone.finished}[rid].events if e[0] == "chunk" and e[1] < 40]
    assert chunks == [16, 16, 8], chunks                              # nobody decodes: the whole budget


def test_serve_refuses_a_bad_tpot_slo_in_one_line():
    out = subprocess.run([sys.executable, "-m", "dantinox.cli", "serve", "--tpot-slo", "0", "--no-warmup"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "--tpot-slo 0.0 is not allowed" in out.stderr
