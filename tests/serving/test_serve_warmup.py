"""Background warm-up (``dantinox.serving.warmup``): the server listens at once, /health says "warming up" and
/ready answers 503 until every warm-up item ran; a request that arrives during warm-up is answered; the
engine's items come smallest batch and bucket first and cover every program a step can run."""

import threading
import time

import httpx
import numpy as np
import pytest
from conftest import tiny_config
from serving_util import lively_model

import dantinox as dx
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.serving.engine import Engine, EngineConfig, PagedEngine
from dantinox.serving.request import RequestOutput
from dantinox.serving.server import ServerThread, create_app
from dantinox.serving.warmup import Warmup, WarmupItem


TEXT = "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura.\n" * 3


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXT, "bpe", 260)


@pytest.fixture(scope="module")
def model(tokenizer):
    return lively_model(tiny_config(attention="gqa", kv_heads=2, vocab_size=tokenizer.vocab_size))


def _engine(model) -> PagedEngine:
    """One bucket per kind of call and one-token decode steps: a request compiles two small programs."""
    return PagedEngine(model, EngineConfig(block_size=4, num_blocks=32, max_running=1, max_batched_tokens=8,
                                           decode_buckets=(1,), prefill_buckets=(1,), chunk_buckets=(8,),
                                           max_decode_steps=1))


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_health_says_warming_up_until_the_warm_up_is_done(model, tokenizer):
    release, entered = threading.Event(), threading.Event()

    def held():
        entered.set()
        assert release.wait(60), "the test never released the warm-up"

    warmup = Warmup([WarmupItem("first", lambda: None), WarmupItem("held", held)])
    with ServerThread(create_app(_engine(model), tokenizer, "tiny", warmup=warmup)) as srv:
        assert entered.wait(60)   # listening, and the warm-up is inside its second item
        health, ready = httpx.get(srv.url + "/health"), httpx.get(srv.url + "/ready")
        assert health.status_code == 200 and health.json()["status"] == "warming up"
        assert health.json()["warmup"]["programs_done"] == 1 and health.json()["warmup"]["programs_total"] == 2
        assert ready.status_code == 503 and ready.json()["status"] == "warming up"
        release.set()
        _wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200)
        assert httpx.get(srv.url + "/ready").json()["status"] == "ready"
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "ok" and health["warmup"]["programs_done"] == 2


def test_a_request_that_can_never_run_is_refused_while_a_warm_up_program_compiles(model, tokenizer):
    # the engine thread is held inside a warm-up item (as by a long compile): value checks answer anyway
    release, entered = threading.Event(), threading.Event()

    def held():
        entered.set()
        assert release.wait(60), "the test never released the warm-up"

    engine = _engine(model)
    with ServerThread(create_app(engine, tokenizer, "tiny", warmup=Warmup([WarmupItem("held", held)]))) as srv:
        assert entered.wait(60)
        try:
            too_long = dict(prompt=[5, 9, 40], max_tokens=engine.max_context + 1)
            bad_token = dict(prompt=[5, tokenizer.vocab_size + 7], max_tokens=2)
            for body, field in ((too_long, "max_tokens"), (bad_token, "prompt")):
                got = httpx.post(srv.url + "/v1/completions", json=body, timeout=10)
                assert got.status_code == 400 and got.json()["error"]["param"] == field
        finally:
            release.set()


class EchoEngine(Engine):
    """An engine without a model: each request gets its prompt's first token back, in one step."""

    vocab_size, max_context = 260, 32

    def __init__(self):
        self.queued: list = []

    def add_request(self, prompt_ids, options, request_id=None, share_prompt_with=None):
        self.queued.append((request_id, list(prompt_ids)))
        return request_id

    def step(self):
        done, self.queued = self.queued, []
        return [RequestOutput(rid, [ids[0]], True, "length", None, len(ids), 1) for rid, ids in done]

    def abort(self, request_id, reason="abort"):
        return False

    def stats(self):
        return {}

    def has_unfinished(self):
        return bool(self.queued)


def test_a_request_during_warm_up_is_answered_between_two_items(tokenizer):
    # an endless warm-up of short items: the worker serves the request between two of them
    warmup = Warmup([WarmupItem(f"item {i}", lambda: time.sleep(0.005)) for i in range(20_000)],
                    log_every=False)
    with ServerThread(create_app(EchoEngine(), tokenizer, "tiny", warmup=warmup)) as srv:
        got = httpx.post(srv.url + "/v1/completions", json=dict(prompt=[40, 5, 9], max_tokens=1), timeout=60)
        assert got.json()["choices"][0]["text"] == tokenizer.decode([40])
        assert httpx.get(srv.url + "/ready").status_code == 503   # still warming up
        assert 0 < warmup.done < len(warmup.items)


@pytest.mark.slow
def test_a_request_during_warm_up_compiles_its_programs_and_is_answered_exactly(model, tokenizer):
    warmup = Warmup([WarmupItem(f"item {i}", lambda: time.sleep(0.01)) for i in range(20_000)], log_every=False)
    prompt = [5, 9, 40, 77, 3]
    want = np.asarray(dx.generate(model, prompt, 6)).tolist()
    with ServerThread(create_app(_engine(model), tokenizer, "tiny", warmup=warmup)) as srv:
        got = httpx.post(srv.url + "/v1/completions", json=dict(prompt=prompt, max_tokens=6, temperature=0),
                         timeout=120).json()
        assert got["choices"][0]["text"] == tokenizer.decode(want)
        assert httpx.get(srv.url + "/ready").status_code == 503   # still warming up
        assert 0 < warmup.done < len(warmup.items)


def test_a_failing_warm_up_item_makes_the_server_unhealthy(model, tokenizer):
    def broken():
        raise RuntimeError("compiler crashed")

    warmup = Warmup([WarmupItem("broken", broken)])
    with ServerThread(create_app(_engine(model), tokenizer, "tiny", warmup=warmup)) as srv:
        _wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503)
        body = httpx.get(srv.url + "/health").json()
        assert body["status"] == "unhealthy" and "compiler crashed" in body["error"]
        assert httpx.get(srv.url + "/ready").status_code == 503


def test_engine_items_cover_every_program_batch_one_first(model):
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=64, max_running=4, max_batched_tokens=16,
                                             prefill_buckets=(1, 2), chunk_buckets=(8, 16)))
    labels = [item.label for item in engine.warmup_items()]
    want = ({f"forward B={B} T=1" for B in engine.decode_buckets}
            | {f"forward B={B} T={T}" for B in (1, 2) for T in (8, 16)}
            | {f"decode_steps B={B} M={M}" for B in engine.decode_buckets for M in engine.table_buckets}
            | {"block moves"})
    assert len(labels) == len(set(labels)) and set(labels) == want
    first_batch_two = min(i for i, label in enumerate(labels) if "B=2" in label)
    assert labels[:2] == ["forward B=1 T=16", f"decode_steps B=1 M={engine.table_buckets[0]}"]
    assert labels[2:4] == ["forward B=1 T=8", "forward B=1 T=1"] and first_batch_two == 4   # rank 1, batch 1 first
    assert f"B={engine.decode_buckets[-1]} " in labels[-1] + " "   # the largest batch comes last


def test_one_running_sequence_compiles_no_batch_larger_than_one(model):
    # a step has at most max_running rows: the default prefill buckets (1, 2, 4) would compile 2 x 4 programs
    # no step of a max_running=1 engine can run
    engine = PagedEngine(model, EngineConfig(block_size=4, num_blocks=64, max_running=1, max_batched_tokens=16,
                                             chunk_buckets=(8, 16)))
    labels = [item.label for item in engine.warmup_items()]
    assert engine.prefill_buckets == engine.decode_buckets == (1,)
    assert labels and all(" B=1 " in label + " " for label in labels if label != "block moves")
    three = PagedEngine(model, EngineConfig(block_size=4, num_blocks=64, max_running=3, decode_buckets=(1, 4, 8)))
    assert three.prefill_buckets == (1, 2, 4) and three.decode_buckets == (1, 4)   # 3 rows run in B = 4


def test_an_empty_warm_up_is_ready_at_once():
    warmup = Warmup([])
    assert warmup.finished and warmup.status()["status"] == "ready" and not warmup.run_next()
