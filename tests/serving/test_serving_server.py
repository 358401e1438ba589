"""The HTTP server on 127.0.0.1: the official openai client (completions and streaming), K05 over HTTP,
64 concurrent greedy prompts equal to batch-1 runs, stop strings, errors naming the field, 429 with
Retry-After, client disconnects freeing blocks, metrics and health, and the `dantinox serve` start-up line."""

import asyncio
import json
import logging
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import tiny_config
from serving_util import SMALL_BUCKETS, lively_model

import dantinox as dx
from dantinox.cli import entrypoint as cli
from dantinox.cli.serve import build_engine, kv_summary, parse_bytes
from dantinox.runs.run_dir import load_run, save_run
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.server import ServerThread, create_app

TEXT = ("Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura, ché la diritta via era "
        "smarrita.\n") * 3


def save_tiny_bpe_run(path) -> str:
    """A run directory at ``path``: a lively tiny GQA model (max_context 32) with a BPE tokenizer of TEXT."""
    tokenizer = train_tokenizer(TEXT, "bpe", 260)
    cfg = tiny_config(attention="gqa", kv_heads=2, vocab_size=tokenizer.vocab_size)
    save_run(path, lively_model(cfg), cfg.replace(tie_embeddings=False), tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_bpe_run(tmp_path_factory.mktemp("serve") / "tiny-bpe")


@pytest.fixture(scope="module")
def loaded(run_dir):
    model, cfg, tokenizer, _ = load_run(run_dir)
    return model, tokenizer


def start_server(loaded, **fields) -> ServerThread:
    model, tokenizer = loaded
    settings = dict(block_size=4, num_blocks=48, max_running=16, max_batched_tokens=16,
                    decode_buckets=(1, 4, 16), **SMALL_BUCKETS)
    settings.update(fields)
    return ServerThread(create_app(PagedEngine(model, EngineConfig(**settings)), tokenizer, "tiny")).start()


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded)
    yield srv
    srv.stop()


def reference_text(loaded, prompt_ids, n, **sampling) -> str:
    model, tokenizer = loaded
    return tokenizer.decode(np.asarray(dx.generate(model, prompt_ids, n, **sampling)).tolist())


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_openai_client_completions_and_streaming(server, loaded):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "Nel mezzo del"
    ids = loaded[1].encode(prompt)
    want = reference_text(loaded, ids, 12)
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 12)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    sampled = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, seed=11,
                                        extra_body={"top_k": 50})
    assert sampled.choices[0].text == reference_text(loaded, ids, 12, temperature=1.0, top_k=50, seed=11)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="ché la", max_tokens=20, temperature=1.0, seed=3, stream=True)]
    whole = client.completions.create(model="tiny", prompt="ché la", max_tokens=20, temperature=1.0, seed=3)
    assert "".join(pieces) == whole.choices[0].text  # pieces never split a multi-byte character
    for piece in pieces:
        piece.encode("utf-8")


def test_stop_strings_end_the_text_and_free_the_request(server, loaded):
    ids = [5, 9, 40, 77, 3]
    full = reference_text(loaded, ids, 16)
    stop = full[6:8]
    body = dict(prompt=ids, max_tokens=16, temperature=0, stop=[stop])
    got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["text"] == full[:full.find(stop)]
    assert got["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "stop"' in lines[-2]


def finished_by(metrics_text: str, reason: str) -> float:
    """dantinox_requests_finished_total{finish_reason=reason} in a /metrics text (0 when absent)."""
    key = f'dantinox_requests_finished_total{{finish_reason="{reason}"}}'
    line = [x for x in metrics_text.splitlines() if x.startswith(key)]
    return float(line[0].split()[-1]) if line else 0.0


def test_health_and_metrics_agree_on_stop_strings(loaded):
    """A request the server ends on a stop string counts as finished by "stop" on /metrics and as finished, not
    aborted, in /health's engine counters. The engine is held after its first step, so the stop string (the
    first generated character) is seen while the request still runs: the server's abort ends it."""
    prompt = next(p for p in ([7, 8, 9], [5, 9, 40], [1, 2, 3], [11, 12])
                  if reference_text(loaded, p, 1) and "\ufffd" not in reference_text(loaded, p, 1))
    stop = reference_text(loaded, prompt, 1)[0]
    engine = GatedEngine(loaded[0], EngineConfig(block_size=4, num_blocks=48, max_running=1, max_batched_tokens=16,
                                                 decode_buckets=(1, 4, 16), max_decode_steps=1, **SMALL_BUCKETS))
    app = create_app(engine, loaded[1], "tiny")
    replies = []
    with ServerThread(app) as srv, httpx.Client(timeout=60) as client:
        hold(engine, wait=False)
        post = threading.Thread(target=lambda: replies.append(client.post(srv.url + "/v1/completions", json=dict(
            prompt=prompt, max_tokens=20, temperature=0, stop=[stop])).json()))
        post.start()
        wait_for(lambda: engine.at_gate() and engine.steps == 0)
        step_once(engine)                                   # prefill: the first token, which holds the stop string
        wait_for(lambda: app.state.worker.commands.qsize() == 1)  # the server's abort for the stop string
        engine.release()
        post.join(60)
        health = lambda: client.get(srv.url + "/health").json()["engine"]  # noqa: E731
        wait_for(lambda: health()["running"] == 0 and health()["waiting"] == 0)  # the abort has been taken
        health, metrics = health(), client.get(srv.url + "/metrics").text
    assert replies[0]["choices"][0]["finish_reason"] == "stop"
    assert (health["finished"], health["aborted"]) == (1, 0)
    assert finished_by(metrics, "stop") == 1 and finished_by(metrics, "abort") == 0


def test_k05_prompt_longer_than_context_gets_a_4xx_then_the_server_still_works(loaded):
    first = start_server(loaded)
    try:
        too_long = httpx.post(first.url + "/v1/completions", json=dict(prompt=list(range(40)), max_tokens=4),
                              timeout=60)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
        assert "max_prompt_tokens=31" in too_long.json()["error"]["message"]
        over = httpx.post(first.url + "/v1/completions", json=dict(prompt=list(range(28)), max_tokens=10),
                          timeout=60)
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        rest = httpx.post(first.url + "/v1/completions", json=dict(prompt=list(range(28))), timeout=60).json()
        assert rest["usage"]["completion_tokens"] == 4 and rest["choices"][0]["finish_reason"] == "length"
        valid = dict(prompt=list(range(10, 20)), max_tokens=8, temperature=0)
        after = httpx.post(first.url + "/v1/completions", json=valid, timeout=60).json()
        assert httpx.get(first.url + "/health").json()["status"] == "ok"
    finally:
        first.stop()
    with start_server(loaded) as fresh:
        again = httpx.post(fresh.url + "/v1/completions", json=valid, timeout=60).json()
    assert again["choices"] == after["choices"]
    assert after["choices"][0]["text"] == reference_text(loaded, list(range(10, 20)), 8)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_64_concurrent_greedy_prompts_equal_batch_one_generate(server, loaded):
    rng = np.random.default_rng(0)
    vocab = loaded[1].vocab_size
    jobs = [(rng.integers(0, vocab, 1 + i % 20).tolist(), 4 + i % 9) for i in range(64)]

    async def send_all():
        async with httpx.AsyncClient(timeout=120) as client:
            replies = await asyncio.gather(*(client.post(server.url + "/v1/completions", json=dict(
                prompt=p, max_tokens=n, temperature=0)) for p, n in jobs))
        return [r.json() for r in replies]

    replies = asyncio.run(send_all())
    for (prompt, n), reply in zip(jobs, replies):
        assert reply["choices"][0]["text"] == reference_text(loaded, prompt, n)
        assert reply["usage"]["completion_tokens"] == n


def test_invalid_input_names_the_field(server):
    url = server.url + "/v1/completions"
    bad = httpx.post(url, json=dict(prompt="x", max_tokens="many"), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    missing = httpx.post(url, json=dict(max_tokens=3), timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    lone = httpx.post(url, content=json.dumps(dict(prompt="Nel \ud800")),  # JSON's "\ud800": was a 500
                      headers={"content-type": "application/json"}, timeout=30)
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "prompt", lone.text
    assert "not valid Unicode: a lone surrogate U+D800 at character 4" in lone.json()["error"]["message"]
    for field in ("n", "logprobs"):
        typed = httpx.post(url, json={"prompt": "x", field: "several"}, timeout=30)
        assert typed.status_code == 400 and typed.json()["error"]["param"] == field
    for body, field in ((dict(prompt="x", n=0), "n"), (dict(prompt="x", n=17), "n"),
                        (dict(prompt="x", logprobs=6), "logprobs"), (dict(prompt="x", logprobs=-1), "logprobs"),
                        (dict(prompt="x", temperature=-1), "temperature"),
                        (dict(prompt="x", top_p=2.0), "top_p"), (dict(prompt=[1, 10**6]), "prompt"),
                        (dict(prompt=""), "prompt"), (dict(prompt="x", max_tokens=0), "max_tokens"),
                        (dict(prompt=["a", "b"]), "prompt"), (dict(prompt="x", stop=list("abcde")), "stop")):
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (body, reply.text)


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


class GatedEngine(PagedEngine):
    """An engine whose steps wait at a gate, so a test can hold the worker thread at a known point.

    While held, a step runs only when the test hands out a ticket (``step_once``); ``at_gate()`` tells that the
    worker is waiting there, ``steps`` counts finished steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cond = threading.Condition()
        self.held, self.tickets, self.waiting, self.steps = False, 0, False, 0

    def at_gate(self) -> bool:
        """True while the worker waits at the gate."""
        with self.cond:
            return self.waiting

    def step(self):
        with self.cond:
            while self.held and self.tickets == 0:
                self.waiting = True
                self.cond.notify_all()
                self.cond.wait(30)
            self.tickets -= 1 if self.held else 0
            self.waiting = False
        out = super().step()
        with self.cond:
            self.steps += 1
            self.cond.notify_all()
        return out

    def release(self) -> None:
        with self.cond:
            self.held = False
            self.cond.notify_all()


def hold(engine: GatedEngine, wait: bool = True) -> None:
    """Stop the worker at its next step (and, with wait, until it is there)."""
    with engine.cond:
        engine.held = True
    if wait:
        wait_for(engine.at_gate)


def step_once(engine: GatedEngine) -> None:
    """Let a held worker run exactly one step and wait until it is back at the gate."""
    with engine.cond:
        done = engine.steps
        engine.tickets += 1
        engine.cond.notify_all()
    wait_for(lambda: engine.steps > done and engine.at_gate())


def test_disconnect_frees_blocks_and_queue_bound_gives_429(loaded):
    model, tokenizer = loaded
    settings = dict(block_size=4, num_blocks=48, max_running=1, max_queued=1, max_batched_tokens=16,
                    decode_buckets=(1, 4, 16), max_decode_steps=1, **SMALL_BUCKETS)  # one token per held step
    engine = GatedEngine(model, EngineConfig(**settings))
    app = create_app(engine, tokenizer, "tiny")
    worker = app.state.worker
    with ServerThread(app) as srv, httpx.Client(timeout=60) as client:
        url, health = srv.url + "/v1/completions", lambda: client.get(srv.url + "/health").json()["engine"]
        long = dict(prompt=[1, 2, 3], max_tokens=28, temperature=0, stream=True)
        # 1. A client that disconnects mid-stream: its request is aborted and its blocks freed.
        with client.stream("POST", url, json=long) as streaming:
            lines = streaming.iter_lines()  # kept alive: closing this iterator would close the response
            assert next(lines).startswith("data: ")
            hold(engine)
        wait_for(lambda: worker.commands.qsize() == 1)  # the abort, sent when the stream was cancelled
        engine.release()
        wait_for(lambda: health()["aborted"] == 1 and health()["blocks_used"] == 0)
        # 2. With one request running and one waiting, the next one gets 429 with Retry-After.
        replies = {}

        def send(name, body):
            replies[name] = httpx.post(url, json=body, timeout=60)

        hold(engine, wait=False)  # A is admitted and stepped once, then held: it stays running
        threads = [threading.Thread(target=send, args=("A", {**long, "stream": False}))]
        threads[0].start()
        wait_for(engine.at_gate)
        step_once(engine)
        assert health()["running"] == 1
        for i, name in enumerate("BC"):
            threads.append(threading.Thread(target=send, args=(name, dict(prompt=[4 + i], max_tokens=2))))
            threads[-1].start()
            wait_for(lambda n=i + 1: worker.commands.qsize() == n)
        engine.release()
        for thread in threads:
            thread.join(60)
        assert replies["A"].status_code == replies["B"].status_code == 200
        assert replies["C"].status_code == 429 and int(replies["C"].headers["Retry-After"]) >= 1
        assert replies["C"].json()["error"]["type"] == "rate_limit_error"
        wait_for(lambda: health()["blocks_used"] == 0 and health()["running"] == 0)
        assert health()["blocks_free"] == health()["blocks_total"]
        metrics = client.get(srv.url + "/metrics").text
        for name in ("dantinox_time_to_first_token_seconds_bucket",
                     "dantinox_inter_token_latency_seconds_count",
                     "dantinox_waiting", "dantinox_running", "dantinox_blocks_used", "dantinox_blocks_free",
                     "dantinox_preemptions_total", "dantinox_prefix_cache_hits_total",
                     'dantinox_requests_rejected_total{reason="queue_full"} 1.0',
                     'dantinox_requests_finished_total{finish_reason="abort"} 1.0'):
            assert name in metrics, name
        assert client.get(srv.url + "/health").json()["status"] == "ok"


def test_serve_command_sizes_the_pool_from_memory(run_dir):
    args = cli.build_parser().parse_args(["serve", "--run_dir", run_dir, "--kv-memory", "64KiB",
                                          "--block-size", "4", "--policy", "swap"])
    engine, tokenizer, name = build_engine(args)
    per_block = 4 * engine.cfg.num_blocks * dx.bytes_per_token_per_layer(engine.cfg)
    assert engine.allocator.num_blocks == 64 * 1024 // per_block and name == "tiny-bpe"
    assert engine.policy.preemption == "swap"
    line = kv_summary(engine)
    n = engine.allocator.num_blocks
    assert line.startswith(f"KV cache: {n} blocks = {n * 4} tokens, max concurrency {n // 8} at 32 tokens "
                           "per request")
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="kv-memory") as raised:
        parse_bytes("lots")
    assert str(raised.value).count("is not allowed") == 1 and "--kv-memory lots" in str(raised.value)  # said once


def test_serve_warns_when_the_pool_is_smaller_than_one_request(run_dir):
    args = cli.build_parser().parse_args(["serve", "--run_dir", run_dir, "--kv-memory", "2KiB",
                                          "--block-size", "4"])
    engine, _, _ = build_engine(args)
    line = kv_summary(engine)
    assert "max concurrency 0" in line and "warning: the pool holds" in line


@pytest.mark.parametrize("flags, match", [
    (["--block-size", "0"], "--block-size 0 is not allowed: an integer >= 1"),
    (["--block-size", "-4"], "--block-size -4 is not allowed"),
    (["--max-running", "0"], "--max-running 0 is not allowed"),
    (["--max-queued", "0"], "--max-queued 0 is not allowed"),
    (["--max-batched-tokens", "-1"], "--max-batched-tokens -1 is not allowed"),
    (["--max-decode-steps", "0"], "--max-decode-steps 0 is not allowed"),
    (["--max-loaded-programs", "0"], "--max-loaded-programs 0 is not allowed"),
    (["--port", "70000"], r"--port 70000 is not allowed: an integer in 1..65535"),
    (["--port", "0"], "--port 0 is not allowed"),
    (["--host", "not a host!"], "--host 'not a host!' is not allowed"),
    (["--kv-memory", "1e400GB"], "--kv-memory"),
])
def test_serve_flags_are_checked_before_loading(flags, match, tmp_path, capsys):
    """Bad serve flags fail before the run dir is even read (a missing run dir would say otherwise)."""
    missing = str(tmp_path / "no-such-run")
    with pytest.raises(ValueError, match=match):
        build_engine(cli.build_parser().parse_args(["serve", "--run_dir", missing] + flags))
    assert cli.main(["serve", "--run_dir", missing] + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match.split()[0] in err


def test_serve_accepts_ordinary_hosts():
    from dantinox.cli.serve import check_serve_args
    for host in ("127.0.0.1", "0.0.0.0", "::1", "localhost", "my-host.example.org"):
        check_serve_args(cli.build_parser().parse_args(["serve", "--host", host]))


def test_strict_types_seed_range_unsupported_fields_and_bad_bodies(server):
    url = server.url + "/v1/completions"
    for body, field in ((dict(prompt="x", max_tokens=True), "max_tokens"),
                        (dict(prompt="x", max_tokens="5"), "max_tokens"),
                        (dict(prompt="x", stream="yes"), "stream"), (dict(prompt="x", seed="3"), "seed"),
                        (dict(prompt="x", stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
                        (dict(prompt="x", temperature="0.5"), "temperature"), (dict(prompt=["1", 2]), "prompt")):
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (body, reply.text)
        assert field in reply.json()["error"]["message"]
    union = httpx.post(url, json=dict(prompt="x", stop=5), timeout=30).json()["error"]   # str | list[str]
    assert union["param"] == "stop" and "valid string" in union["message"] and "valid list" in union["message"]
    for body, field in ((dict(prompt="x", seed=-1), "seed"), (dict(prompt="x", seed=2**32), "seed"),
                        (dict(prompt="x", best_of=2), "best_of"), (dict(prompt="x", suffix="!"), "suffix"),
                        (dict(prompt="x", stop=[""]), "stop"),
                        (dict(prompt="x", stop=""), "stop"), (dict(prompt="x", echo=True), "echo")):
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (body, reply.text)
        assert field in reply.json()["error"]["message"]
    unknown = httpx.post(url, json=dict(prompt="x", model="gpt-4"), timeout=30)   # OpenAI: 404 model_not_found
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert unknown.json()["error"]["param"] == "model" and "'gpt-4'" in unknown.json()["error"]["message"]
    ok = httpx.post(url, json=dict(prompt="Nel", max_tokens=2, model="tiny", best_of=1, suffix=None,
                                   seed=2**32 - 1, temperature=1), timeout=30)
    assert ok.status_code == 200, ok.text
    garbled = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert garbled.status_code == 400 and garbled.json()["error"]["param"] == "body"
    assert "not valid JSON" in garbled.json()["error"]["message"]
    empty = httpx.post(url, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "body"
    assert "body is missing" in empty.json()["error"]["message"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, "body"),                          # malformed
    ("/v1/completions", b"[1, 2]", 400, "body"),                             # not an object
    ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),                # missing field
    ("/v1/completions", b'{"prompt": "x", "n": "two"}', 400, "n"),           # wrong type
    ("/v1/completions", b'{"prompt": "x", "ignore_eos": 1}', 400, "ignore_eos"),
    ("/v1/chat/completions", b"{not json", 400, "body"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [], "max_completion_tokens": "9"}', 400, "max_completion_tokens"),
    ("/v1/nothing", b"{}", 404, None),
])
def test_every_error_is_openai_error_json(server, path, body, status, param):
    reply = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == status, reply.text
    assert set(reply.json()) == {"error"} and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["message"]
    if body == b'{"model": "tiny"}':  # a chat body without messages names messages, not prompt
        assert reply.json()["error"]["message"] == "messages is required"


def test_wrong_method_is_openai_error_json(server):
    reply = httpx.get(server.url + "/v1/completions", timeout=30)
    assert reply.status_code == 405 and reply.json()["error"]["message"].startswith("GET /v1/completions")


@pytest.mark.parametrize("extra, expected", [({"max_token": 5}, "max_token"), ({"user": "u"}, None)])
def test_the_server_answers_and_logs_the_ignored_fields(server, caplog, extra, expected):
    with caplog.at_level(logging.WARNING, logger="dantinox.serving"):
        reply = httpx.post(server.url + "/v1/completions", json=dict(prompt="Nel", max_tokens=2, **extra),
                           timeout=30)
    assert reply.status_code == 200, reply.text
    lines = [r.getMessage() for r in caplog.records if "request fields ignored" in r.getMessage()]
    if expected is None:
        assert lines == []
    else:
        assert lines == [f"/v1/completions: request fields ignored (this server does not read them): {expected}"]


@pytest.mark.parametrize("headers, said", [({"content-type": "application/x-www-form-urlencoded"},
                                             "its Content-Type is application/x-www-form-urlencoded"),
                                            ({"content-type": "text/plain"}, "its Content-Type is text/plain")])
def test_a_json_body_sent_with_another_content_type_names_the_header(server, headers, said):
    # curl -d sends form encoding; the body is a JSON object, so "not a JSON object" misled
    # (new-user walk-through, 2026-12-04)
    reply = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "Nel", "max_tokens": 2}',
                       headers=headers, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "body"
    assert said in reply.json()["error"]["message"]
    assert "Content-Type: application/json" in reply.json()["error"]["message"]
