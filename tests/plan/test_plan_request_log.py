"""Plans from production: the server's request log is a trace (log -> trace -> the same arrivals and lengths
in a replay), a bad log line is refused by number, and a Mooncake trace converts with its prefix sharing.
Host-side only: the worker runs with a stand-in engine, the replay is the simulator with constant costs."""

import asyncio
import json

import pytest

from dantinox.cli import entrypoint as cli
from dantinox.plan.candidate import Candidate
from dantinox.plan.cost_model import constant
from dantinox.plan.simulate import simulate
from dantinox.plan.trace import TraceError, prompt_token_ids, read_trace
from dantinox.plan.trace_import import read_mooncake
from dantinox.runs.bundled import bundled_run_dir
from dantinox.runs.run_dir import load_run
from dantinox.serving.request import RequestOutput, SamplingOptions
from dantinox.serving.request_log import RequestLog, slice_from
from dantinox.serving.worker import EngineWorker


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class StandInEngine:
    """One token per request per step until max_new_tokens, then finished by "length" (no model)."""

    def __init__(self):
        self.requests, self.made = {}, {}

    def add_request(self, prompt_ids, options, request_id=None, share_prompt_with=None):
        self.requests[request_id] = type("R", (), {"num_cached_tokens": 16 if len(prompt_ids) > 16 else 0})()
        self.made[request_id] = [0, options.max_new_tokens]

    def step(self):
        outs = []
        for rid, (done, want) in list(self.made.items()):
            self.made[rid][0] += 1
            finished = done + 1 == want
            outs.append(RequestOutput(rid, [7], finished, "length" if finished else None))
            if finished:
                del self.made[rid], self.requests[rid]
        return outs

    def stats(self):
        return {}


def _serve(tmp_path, arrivals):
    """Drive the worker's commands and routing by hand with a fake clock; returns the log path.
    arrivals: [(seconds, prompt length, output tokens, body fields)]; one engine step every 0.01 s."""
    clock = FakeClock()
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path), "ab" * 32, clock=clock)
    worker = EngineWorker(StandInEngine(), request_log=log)
    loop = asyncio.new_event_loop()
    pending = sorted(arrivals)
    import dantinox.serving.worker as worker_module

    real = worker_module.time.perf_counter
    worker_module.time.perf_counter = clock
    try:
        for step in range(400):
            t = 100.0 + step * 0.01
            while pending and 100.0 + pending[0][0] <= t + 1e-12:
                at, plen, out, body = pending.pop(0)
                clock.now = 100.0 + at
                worker.submit([f"r{at}"], list(range(1, plen + 1)), [SamplingOptions(out)], loop, asyncio.Queue(),
                              slice_from(body))
                worker._take_commands(block=False)
            clock.now = t
            worker._route(worker.engine.step())
    finally:
        worker_module.time.perf_counter = real
        loop.close()
        log.close()
    return path


def test_request_log_round_trips_into_a_trace_that_replays_the_same_arrivals_and_lengths(tmp_path):
    # a long request first, then short ones: the log is written in finish order, not arrival order
    arrivals = [(0.0, 20, 30, {"metadata": {"slice": "doc"}}), (0.05, 8, 2, {"user": "chat"}), (0.1, 5, 3, {}),
                (0.2, 12, 4, {"metadata": {"slice": "doc"}, "user": "ignored"})]
    path = _serve(tmp_path, arrivals)
    lines = [json.loads(t) for t in path.read_text().splitlines()]
    assert [ln["arrival"] for ln in lines] != sorted(ln["arrival"] for ln in lines)   # finish order
    first = next(ln for ln in lines if ln["arrival"] == 0.0)
    assert first == {"source": "request-log", "arrival": 0.0, "prompt_tokens": 20, "max_tokens": 30,
                     "cached_tokens": 16, "finish_reason": "length", "slice": "doc", "ttft_s": 0.0,
                     "tpot_s": 0.01, "model_sha256": "ab" * 32, "dantinox_version": first["dantinox_version"]}
    reqs = read_trace(str(path))
    assert [(q.arrival, q.prompt_tokens, q.max_tokens, q.slice) for q in reqs] == [
        (a, p, o, s) for (a, p, o, _), s in zip(arrivals, ("doc", "chat", "default", "doc"))]
    _, cfg, tok, _ = load_run(bundled_run_dir())
    prompts = [prompt_token_ids(q, tok, cfg.vocab_size) for q in reqs]
    replay = simulate(cfg, Candidate(), constant(0.001), reqs, prompts)
    assert [r.arrival for r in replay["records"]] == [a for a, *_ in arrivals]
    assert [len(r.token_times) for r in replay["records"]] == [o for _, _, o, _ in arrivals]
    assert [len(p) for p in prompts] == [p for _, p, _, _ in arrivals]
    out = tmp_path / "plain.jsonl"                                    # and as a plain trace file
    assert cli.main(["plan", "trace", "--from", "request-log", str(path), "--out", str(out)]) == 0
    assert [(q.arrival, q.max_tokens) for q in read_trace(str(out))] == [(a, o) for a, _, o, _ in arrivals]


def test_a_request_log_line_that_does_not_parse_is_refused_by_number(tmp_path, capsys):
    good = '{"source":"request-log","arrival":0.5,"prompt_tokens":4,"max_tokens":2,"finish_reason":"length"}'
    path = tmp_path / "log.jsonl"
    path.write_text(good + "\n" + good[:30] + "\n")
    with pytest.raises(TraceError, match=r"log.jsonl line 2: not valid JSON"):
        read_trace(str(path))
    path.write_text(good + "\n" + good.replace('"max_tokens":2', '"max_tokens":-1') + "\n")
    code = cli.main(["plan", "--trace", str(path), "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "line 2: max_tokens=-1 is not allowed" in err[0], err
    # a request that ended before its first token is skipped; an observed field outside a log is unknown
    path.write_text(good + "\n" + good.replace('"max_tokens":2', '"max_tokens":0') + "\n")
    assert len(read_trace(str(path))) == 1
    path.write_text('{"arrival":0,"prompt_tokens":4,"max_tokens":2,"ttft_s":0.1}\n')
    with pytest.raises(TraceError, match="line 1: unknown field 'ttft_s'"):
        read_trace(str(path))


def test_slice_from_metadata_then_user():
    assert slice_from({"metadata": {"slice": "rare"}, "user": "u"}) == "rare"
    assert slice_from({"metadata": {"other": 1}, "user": "u"}) == "u"
    assert slice_from({"metadata": "x"}) is None and slice_from(None) is None


MOONCAKE = [
    {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [11, 12]},
    {"timestamp": 1250, "input_length": 530, "output_length": 5, "hash_ids": [11, 13]},
    {"timestamp": 3000, "input_length": 40, "output_length": 9, "hash_ids": [14]},
]


def test_mooncake_trace_converts_with_arrivals_lengths_and_shared_blocks(tmp_path):
    src = tmp_path / "mooncake.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MOONCAKE))
    out = tmp_path / "t.jsonl"
    assert cli.main(["plan", "trace", "--from", "mooncake", str(src), "--out", str(out)]) == 0
    reqs = read_trace(str(out))
    assert [(q.arrival, q.prompt_tokens, q.max_tokens) for q in reqs] == [(0.0, 600, 20), (0.25, 530, 5),
                                                                         (2.0, 40, 9)]
    assert [q.hash_ids for q in reqs] == [(11, 12), (11, 13), (14,)]
    a, b, c = (prompt_token_ids(q, None, 1000) for q in reqs)
    assert [len(a), len(b), len(c)] == [600, 530, 40]
    assert a[:512] == b[:512] and a[512:530] != b[512:530]            # block 11 shared, then 12 vs 13


@pytest.mark.parametrize("line, expected", [
    ('{"timestamp": 5, "input_length": 3}', "line 2: field 'output_length' is missing"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 1, "x": 1}', "line 2: unknown field 'x'"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1}', "line 2: timestamp=0 is not allowed"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 1}', "line 2: input_length=0 is not allowed"),
    ("{not json", "line 2: not valid JSON"),
])
def test_bad_mooncake_line_is_named(tmp_path, line, expected):
    src = tmp_path / "m.jsonl"
    src.write_text('{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=expected):
        read_mooncake(str(src))


@pytest.mark.slow   # a real server (compiles a tiny model's calls)
def test_serve_request_log_of_a_real_server_is_a_trace(tmp_path):
    import httpx
    from conftest import tiny_config
    from serving_util import SMALL_BUCKETS, lively_model

    from dantinox.runs.tokenizer import train_tokenizer
    from dantinox.serving.engine import EngineConfig, PagedEngine
    from dantinox.serving.server import ServerThread, create_app

    tok = train_tokenizer("abcdefghij klmnop\n" * 4, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size)
    engine = PagedEngine(lively_model(cfg), EngineConfig(block_size=4, num_blocks=48, max_running=4,
                                                         max_batched_tokens=16, decode_buckets=(1, 4),
                                                         **SMALL_BUCKETS))
    path = tmp_path / "requests.jsonl"
    srv = ServerThread(create_app(engine, tok, "tiny", request_log=RequestLog(str(path), None))).start()
    bodies = [{"prompt": "abc def", "max_tokens": 5, "temperature": 0, "metadata": {"slice": "doc"}},
              {"prompt": "ghij", "max_tokens": 3, "temperature": 0, "user": "chat"},
              {"prompt": "klmnop abc", "max_tokens": 4, "temperature": 0}]
    try:
        for body in bodies:
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code == 200
    finally:
        srv.stop()
    reqs = read_trace(str(path))
    assert [(q.prompt_tokens, q.max_tokens, q.slice) for q in reqs] == [
        (len(tok.encode(b["prompt"])), b["max_tokens"], s) for b, s in zip(bodies, ("doc", "chat", "default"))]
    assert [q.arrival for q in reqs] == sorted(q.arrival for q in reqs) and reqs[0].arrival >= 0
    lines = [json.loads(t) for t in path.read_text().splitlines()]
    assert all(ln["finish_reason"] == "length" and ln["ttft_s"] > 0 for ln in lines)
