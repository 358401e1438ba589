"""K10 (a client that leaves is noticed while tokens flow) and the metrics a scripted mix of requests leaves.

The server runs on 127.0.0.1 in this process (``ServerThread``). The engine sleeps a little in every step, so
a long request keeps producing a token every few milliseconds for seconds: the old check, which ran only
after half a second with no token, never fired. Clients are raw sockets that close mid-request.
"""

import json
import re
import socket
import time

import httpx
import pytest
from conftest import tiny_config
from serving_util import SMALL_BUCKETS, lively_model

from dantinox.runs.tokenizer import train_tokenizer
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.server import ServerThread, create_app

TEXT = "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura.\n" * 3
MAX_TOKENS = 400
STEP_SLEEP_S = 0.02  # 400 single-token steps take at least 8 s


class SlowEngine(PagedEngine):
    """A paged engine whose every step also sleeps STEP_SLEEP_S (a slow model with tokens flowing)."""

    def step(self):
        time.sleep(STEP_SLEEP_S)
        return super().step()


@pytest.fixture(scope="module")
def served():
    tokenizer = train_tokenizer(TEXT, "bpe", 260)
    cfg = tiny_config(attention="gqa", kv_heads=2, vocab_size=tokenizer.vocab_size, max_context=512)
    settings = dict(block_size=16, num_blocks=96, max_running=4, max_batched_tokens=16, decode_buckets=(1, 4),
                    max_decode_steps=1, **SMALL_BUCKETS)
    engine = SlowEngine(lively_model(cfg), EngineConfig(**settings))
    engine.warmup()  # tokens flow from the first step (no compile pause the old idle check could catch)
    app = create_app(engine, tokenizer, "tiny")
    with ServerThread(app) as srv:
        yield srv, engine


def _stats(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=30).json()["engine"]


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _post_and_leave(srv, body: dict, stream: bool) -> None:
    """POST ``body`` on a raw socket; leave after the first event (streamed) or after 0.5 s (plain)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((srv.host, srv.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    if stream:
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    else:
        time.sleep(0.5)
    sock.close()


def _metric(srv, name: str, label: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    match = re.search(rf'^{name}{{{label}}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("stream,n", [(False, 1), (True, 1), (False, 3), (True, 2)])
def test_k10_abandoned_request_is_aborted_while_tokens_flow(served, stream, n):
    srv, engine = served
    before = _stats(srv)
    aborts = _metric(srv, "dantinox_requests_finished_total", 'finish_reason="abort"')
    body = dict(prompt=[1, 2, 3], max_tokens=MAX_TOKENS, temperature=0.7, seed=1, n=n, stream=stream)
    _post_and_leave(srv, body, stream)
    _wait_for(lambda: _stats(srv)["aborted"] == before["aborted"] + n and _stats(srv)["running"] == 0)
    after = _stats(srv)
    assert after["blocks_used"] == 0 and after["blocks_free"] == after["blocks_total"]
    assert after["finished"] == before["finished"]  # no choice ran to max_tokens
    # noticed within a bounded time: far fewer tokens than max_tokens were produced for the n choices
    assert after["generated_tokens"] - before["generated_tokens"] < n * MAX_TOKENS / 2
    assert _metric(srv, "dantinox_requests_finished_total", 'finish_reason="abort"') == aborts + n


def test_metrics_count_a_scripted_mix(served):
    """Each finished request under its real finish reason, each rejected one once under one reason label."""
    srv, engine = served
    url = srv.url + "/v1/completions"
    finished = lambda r: _metric(srv, "dantinox_requests_finished_total", f'finish_reason="{r}"')  # noqa: E731
    rejected = lambda r: _metric(srv, "dantinox_requests_rejected_total", f'reason="{r}"')  # noqa: E731
    labels = ["invalid_prompt", "invalid_n", "invalid_model", "invalid_json", "invalid_body",
              "invalid_temperature", "invalid_stop", "invalid_seed"]
    start = {r: finished(r) for r in ("stop", "length", "abort")} | {r: rejected(r) for r in labels}
    plain = dict(prompt=[5, 6, 7], max_tokens=12, temperature=0)
    text = httpx.post(url, json=plain, timeout=60).json()["choices"][0]["text"]
    assert len(text) >= 4
    stopped = httpx.post(url, json={**plain, "stop": text[1:3]}, timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    streamed = httpx.post(url, json={**plain, "stop": [text[1:3]], "stream": True}, timeout=60).text
    assert '"finish_reason": "stop"' in streamed
    bad = [dict(json={"prompt": ""}), dict(json={**plain, "n": 0}), dict(json={**plain, "n": 99}),
           dict(json={**plain, "model": "gpt-4"}), dict(content=b"{not json", headers={"content-type":
                                                                                     "application/json"}),
           dict(json=[1, 2]), dict(json={**plain, "temperature": "hot"}), dict(json={**plain, "stop": ""}),
           dict(json={**plain, "seed": -1})]
    for kwargs in bad:
        status = 404 if kwargs.get("json", {}) and "model" in kwargs["json"] else 400   # model_not_found
        assert httpx.post(url, timeout=60, **kwargs).status_code == status, kwargs
    _wait_for(lambda: _stats(srv)["running"] == 0 and _stats(srv)["blocks_used"] == 0)
    assert finished("length") - start["length"] == 1
    assert finished("stop") - start["stop"] == 2
    assert finished("abort") - start["abort"] == 0
    expected = {"invalid_prompt": 1, "invalid_n": 2, "invalid_model": 1, "invalid_json": 1, "invalid_body": 1,
                "invalid_temperature": 1, "invalid_stop": 1, "invalid_seed": 1}
    assert {r: rejected(r) - start[r] for r in labels} == expected
    total = sum(float(v) for v in re.findall(r'^dantinox_requests_rejected_total{[^}]*} (\S+)$',
                                             httpx.get(srv.url + "/metrics").text, re.M))
    assert total - sum(start[r] for r in labels) == len(bad)
