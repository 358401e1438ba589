"""benchmarks/serve_vs_llamacpp.py without servers: the seeded text workloads land in their bands, the stream
parser reads both servers' event formats, and the summary and table compute the right figures from synthetic
timings. (Running the servers is the benchmark itself: minutes, on a quiet host.)"""

import asyncio
import json
import os
import sys

import httpx
import numpy as np
import pytest
from paths import REPO
from tokenizers import Tokenizer

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import serve_vs_llamacpp as bench  # noqa: E402
from stream_client import derive, stream_one  # noqa: E402
from text_workloads import (PREFIX_HEX_DIGITS, Band, PromptCutter, TextRequest, Workload,  # noqa: E402
                            parse_bands, single_workload, trace_workload)

DANTE = os.path.join(REPO, "dantinox", "bundled", "dante")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(os.path.join(DANTE, "tokenizer.json"))


@pytest.fixture(scope="module")
def cutter(tokenizer):
    return PromptCutter(tokenizer, "\n".join(open(p, encoding="utf-8").read() for p in bench.DEFAULT_CORPUS))


def count(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_trace_is_seeded_and_lands_in_its_bands(tokenizer, cutter):
    bands = (Band(0.7, 8, 16), Band(0.2, 40, 60), Band(0.1, 100, 120))
    trace = trace_workload(cutter, 1000, 2.0, bands, (3, 5, 7), seed=1)
    again = trace_workload(cutter, 1000, 2.0, bands, (3, 5, 7), seed=1)
    other = trace_workload(cutter, 1000, 2.0, bands, (3, 5, 7), seed=2)
    assert trace == again and trace.requests != other.requests
    lengths = np.array([count(tokenizer, r.text) for r in trace.requests])
    assert all(r.prompt_tokens == n for r, n in zip(trace.requests, lengths))
    band_of = np.select([lengths <= 16, (lengths >= 38) & (lengths <= 60), lengths >= 98], [0, 1, 2], -1)
    assert (band_of >= 0).all(), sorted(set(lengths[band_of < 0]))
    shares = np.bincount(band_of, minlength=3) / len(lengths)
    np.testing.assert_allclose(shares, [0.7, 0.2, 0.1], atol=0.04)
    arrivals = np.array([r.arrival_s for r in trace.requests])
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    assert abs(np.diff(arrivals).mean() - 0.5) < 0.05  # Poisson at 2/s: mean gap 0.5 s
    assert {r.max_tokens for r in trace.requests} == {3, 5, 7}


def test_prompts_hit_their_length_and_share_no_prefix(tokenizer, cutter):
    workloads = [single_workload(cutter, n, 4, 8, seed=0) for n in (32, 200, 700)]
    for w in workloads:
        target = int(w.name.split("-")[1])
        assert all(target - 2 <= count(tokenizer, r.text) == r.prompt_tokens <= target for r in w.requests)
    prompts = [tokenizer.encode(r.text, add_special_tokens=False).ids for w in workloads for r in w.requests]
    heads = {bytes(r.text[:PREFIX_HEX_DIGITS], "ascii") for w in workloads for r in w.requests}
    assert len(heads) == len(prompts)
    for i, a in enumerate(prompts):
        for b in prompts[:i]:
            shared = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            assert shared <= 4  # no prefix-cache hit is possible (dantinox caches whole 16-token blocks)


def test_bands_flag_is_parsed_and_refused_with_its_value():
    assert parse_bands("0.7:64-256, 0.3:512-1024") == (Band(0.7, 64, 256), Band(0.3, 512, 1024))
    for bad in ("0.7:64", "0:1-2", "1:5-4", "1:0-3"):
        with pytest.raises(ValueError, match=f"--bands '{bad}'"):
            parse_bands(bad)


def test_flags_the_benchmark_sets_are_refused_in_passthrough():
    args = bench.parse_args(["--run-dir", DANTE, "--only", "dantinox", "--dantinox-args", "--port=9 --policy swap"])
    with pytest.raises(ValueError, match="--dantinox-args .* sets --port"):
        bench.check_args(args)
    args = bench.parse_args(["--run-dir", DANTE, "--llama-server", os.path.join(DANTE, "config.json")])
    with pytest.raises(ValueError, match="--llama-server .* is not an executable"):
        bench.check_args(args)


def sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def text_event(text, finish=None):
    return {"choices": [{"text": text, "index": 0, "finish_reason": finish}]}


@pytest.mark.parametrize("final", [
    # dantinox: a usage-only chunk after the last token's
    [text_event("c", "length"), {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                                          "prompt_tokens_details": {"cached_tokens": 0}}}],
    # llama-server: the final chunk carries an empty text, the finish reason, usage and timings
    [text_event("c"), {**text_event("", "length"), "timings": {"prompt_n": 9},
                       "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                 "prompt_tokens_details": {"cached_tokens": 0}}}],
])
def test_stream_is_read_in_both_servers_formats(final):
    body = sse(text_event("a"), text_event("b"), *final)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_one(client, "http://x/v1/completions", TextRequest("r", 0.0, "p", 9, 3), 0.0, False)

    record = asyncio.run(go())
    assert (record["text"], record["completion_tokens"], record["prompt_tokens"], record["cached_tokens"],
            record["finish_reason"], len(record["chunk_s"]), record["complete"]) == ("abc", 3, 9, 0, "length", 3, True)


def synthetic(ttft, tpot, tokens=5, max_tokens=5, status=200):
    """A record whose first token came ttft s after sending and its others tpot s apart."""
    record = dict(name="r", sent_s=1.0, ref_prompt_tokens=10, max_tokens=max_tokens, status=status,
                  chunk_s=[ttft + k * tpot for k in range(tokens)], end_s=1.0 + ttft + (tokens - 1) * tpot,
                  usage={"completion_tokens": tokens, "prompt_tokens": 11,
                         "prompt_tokens_details": {"cached_tokens": 2}}, text="x")
    return derive(record)


def test_summary_and_table_from_synthetic_timings():
    fast = [synthetic(float(t), 0.01) for t in range(1, 101)]
    slow = [synthetic(2.0 * t, 0.03) for t in range(1, 101)] + [synthetic(0.5, 0.01, tokens=2)]  # one cut short
    assert fast[0]["tpot_s"] == pytest.approx(0.01) and not slow[-1]["complete"]
    s_fast, s_slow = bench.summarize(fast, 100.0), bench.summarize(slow, 250.0)
    # linear interpolation between ranks: p50 of 1..100 is 50.5, p99 is 99.01
    assert (s_fast["ttft_p50_s"], s_fast["ttft_p99_s"]) == pytest.approx((50.5, 99.01))
    assert s_slow["complete"] == 100  # the short one is left out of every figure
    assert (s_slow["ttft_p50_s"], s_slow["tpot_p99_s"]) == pytest.approx((101.0, 0.03))
    assert s_slow["output_tokens_per_s"] == pytest.approx(500 / 250.0)
    assert (s_fast["prompt_tokens_vs_reference"], s_fast["cached_tokens"]) == (1.0, 200)
    workload = trace_like(101)
    servers = {name: dict(workloads={workload.name: dict(summary=s, requests=r)}, ready_s=r_s, peak_rss_bytes=m)
               for name, s, r, r_s, m in (("dantinox", s_slow, slow, 30.0, 2 ** 30),
                                          ("llamacpp", s_fast, fast, 3.0, 2 ** 28))}
    lines = bench.table(servers, [workload]).splitlines()
    row = {line.split(" | ")[1]: line.split(" | ")[2:] for line in lines[2:]}
    assert row["TTFT p50, s"] == ["101", "50.5", "2.00 |"]
    assert row["TPOT p99, ms"] == ["30", "10", "3.00 |"]
    assert row["output tokens/s"] == ["2", "5", "0.40 |"]
    assert row["complete"] == ["100/101", "100/101", "|"]
    assert row["start to ready, s"] == ["30", "3", "10.00 |"] and row["peak RSS, MiB"] == ["1024", "256", "4.00 |"]
    check = bench.checks(servers, [workload])
    assert "identical greedy texts on both servers: 100 of 100" in check[-1]


def trace_like(n):
    """A trace Workload of n requests (only its name, kind and size matter to the table)."""
    return Workload("trace-1", "trace", tuple(TextRequest(f"trace-1/{i}", float(i), "x", 10, 5) for i in range(n)))
