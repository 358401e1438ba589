"""Trace format and generator: determinism, the mixture's shape, and bad lines named by number and value."""

import json

import numpy as np
import pytest

from dantinox.cli import entrypoint as cli
from dantinox.plan.trace import (
    TraceClass,
    TraceError,
    TraceSpec,
    default_classes,
    generate_trace,
    prompt_token_ids,
    read_trace,
    trace_text,
)

RARE = "Tan m'abellis vostre cortes deman,\nqu'ieu no me puesc ni voill a vos cobrire.\n"


def test_same_seed_same_bytes_other_seed_other_trace(tmp_path):
    rare = tmp_path / "rare.txt"
    rare.write_text(RARE)
    paths = []
    for i, seed in enumerate((3, 3, 4)):
        out = tmp_path / f"t{i}.jsonl"
        assert cli.main(["plan", "trace", "--out", str(out), "--requests", "50", "--rate", "5", "--seed", str(seed),
                         "--arrivals", "gamma", "--rare-file", str(rare)]) == 0
        paths.append(out.read_bytes())
    assert paths[0] == paths[1]
    assert paths[0] != paths[2]


def test_mixture_rates_lengths_and_prefixes():
    spec = TraceSpec(requests=2000, rate=10.0, classes=(TraceClass("a", 3, 20, 0.3, 10, 0.3, "sys", 8),
                                                         TraceClass("b", 1, 100, 0.3, 5, 0.3)), seed=1)
    recs = generate_trace(spec)
    gaps = np.diff([0.0] + [r["arrival"] for r in recs])
    assert abs(gaps.mean() - 0.1) < 0.01                      # Poisson at 10 requests/s
    share_a = np.mean([r["slice"] == "a" for r in recs])
    assert abs(share_a - 0.75) < 0.03
    b_prompts = [r["prompt_tokens"] for r in recs if r["slice"] == "b"]
    assert abs(np.median(b_prompts) - 100) < 8                # log-normal median
    assert all(r["prefix_tokens"] == 8 for r in recs if r["slice"] == "a")
    bursty = generate_trace(TraceSpec(requests=2000, rate=10.0, classes=spec.classes, arrivals="gamma",
                                      burstiness=3.0, seed=1))
    cv = np.std(np.diff([r["arrival"] for r in bursty])) / np.mean(np.diff([r["arrival"] for r in bursty]))
    assert 2.0 < cv < 4.0


def test_shared_prefix_ids_are_shared_and_rest_differs(tmp_path):
    path = tmp_path / "t.jsonl"
    recs = generate_trace(TraceSpec(requests=20, rate=5, classes=default_classes(), seed=2))
    path.write_text(trace_text(recs))
    reqs = read_trace(str(path), 256)
    chat = [q for q in reqs if q.prefix == "system-a"]
    ids = [prompt_token_ids(q, None, 1024) for q in chat]
    assert len(chat) >= 2
    assert all(i[:32] == ids[0][:32] for i in ids)
    assert ids[0][32:] != ids[1][32:]


@pytest.mark.parametrize("line, expected", [
    ("{not json", "line 2: not valid JSON"),
    ('{"arrival": 1.0, "prompt_tokens": 5}', "line 2: field 'max_tokens' is missing"),
    ('{"arrival": -1, "prompt_tokens": 5, "max_tokens": 3}', "line 2: arrival=-1 is not allowed"),
    ('{"arrival": 1, "prompt_tokens": -5, "max_tokens": 3}', "line 2: prompt_tokens=-5 is not allowed"),
    ('{"arrival": 1, "prompt_tokens": 200, "max_tokens": 100}', "line 2: prompt of 200 tokens + max_tokens=100"),
    ('{"arrival": 0.5, "prompt_tokens": 5, "max_tokens": 3}', "line 2: arrival=0.5 is not allowed: arrivals must"),
])
def test_bad_trace_line_exit_2_names_line(tmp_path, capsys, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 1.0, "prompt_tokens": 5, "max_tokens": 3}\n' + line + "\n")
    with pytest.raises(TraceError, match=expected.replace("(", r"\(").replace("+", r"\+")):
        read_trace(str(path), 256)
    code = cli.main(["plan", "simulate", "--trace", str(path), "--profile", str(tmp_path / "none.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0]


def test_trace_lines_are_sorted_compact_json():
    recs = generate_trace(TraceSpec(requests=3, rate=1, classes=default_classes(), seed=0))
    for line in trace_text(recs).splitlines():
        obj = json.loads(line)
        assert line == json.dumps(obj, sort_keys=True, separators=(",", ":"))
