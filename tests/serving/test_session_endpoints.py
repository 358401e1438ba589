"""POST /sessions/save and /sessions/restore (llama-server's slot save / restore, by prompt): a prompt's KV blocks
saved by one server and restored by another are hit by the next request with that prompt, which answers what
a server without a prefix cache answers; a file from another model is refused (400) naming the difference; a
bad or missing filename and a server without --session-dir answer 400 / 404 / 501 naming what is wrong; /metrics
counts the KV tiers' hits, promotions, stores and bytes per tier."""

import httpx
import numpy as np
import pytest
from conftest import tiny_config
from run_util import TEXT
from serving_util import SMALL_BUCKETS, lively_model

from dantinox.kv.tiers import TierConfig
from dantinox.runs.tokenizer import train_tokenizer
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.serving.server import ServerThread, create_app

CFG = tiny_config(attention="gqa", kv_heads=2, max_context=64)


@pytest.fixture(scope="module")
def setup():
    tokenizer = train_tokenizer(TEXT, "char")
    return lively_model(CFG.replace(vocab_size=tokenizer.vocab_size)), tokenizer


def serve(setup, **app_fields):
    model, tokenizer = setup
    tiers = app_fields.pop("kv_tiers", None)
    settings = dict(block_size=4, num_blocks=12, max_running=4, max_batched_tokens=16, decode_buckets=(1, 4),
                    enable_prefix_caching=app_fields.pop("prefix", True), kv_tiers=tiers, **SMALL_BUCKETS)
    app = create_app(PagedEngine(model, EngineConfig(**settings)), tokenizer, "tiny", **app_fields)
    return ServerThread(app).start()


def complete(server, prompt, n=6) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=dict(prompt=prompt, max_tokens=n, temperature=0.0),
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


PROMPT = np.random.default_rng(0).integers(1, 24, 13).tolist()   # three full blocks of 4 and one token


def test_a_session_saved_by_one_server_is_restored_by_another_and_hit(setup, tmp_path):
    with serve(setup, prefix=False) as plain:
        want = complete(plain, PROMPT)["choices"][0]["text"]
    with serve(setup, session_dir=str(tmp_path), model_digest="model-a") as first:
        r = httpx.post(first.url + "/sessions/save", json=dict(filename="doc.session", prompt=PROMPT), timeout=120)
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["filename"] == "doc.session" and saved["n_saved"] == 12
        assert saved["n_written"] == (tmp_path / "doc.session").stat().st_size and saved["timings"]["save_ms"] > 0
    with serve(setup, session_dir=str(tmp_path), model_digest="model-a") as second:
        r = httpx.post(second.url + "/sessions/restore", json=dict(filename="doc.session"), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == 12 and r.json()["n_read"] == saved["n_written"]
        answer = complete(second, PROMPT)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 12
        assert answer["choices"][0]["text"] == want


def test_session_requests_that_cannot_be_served_say_why(setup, tmp_path):
    with serve(setup, session_dir=str(tmp_path), model_digest="model-a") as first:
        assert httpx.post(first.url + "/sessions/save", json=dict(filename="a.session", prompt=PROMPT),
                          timeout=120).status_code == 200
        for name in ("../a.session", ".hidden", "", "sub/a.session"):
            r = httpx.post(first.url + "/sessions/restore", json=dict(filename=name), timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "filename", (name, r.text)
        r = httpx.post(first.url + "/sessions/restore", json=dict(filename="none.session"), timeout=60)
        assert r.status_code == 404 and "none.session" in r.json()["error"]["message"]
        r = httpx.post(first.url + "/sessions/save", json=dict(filename="b.session"), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    with serve(setup, session_dir=str(tmp_path), model_digest="model-b") as other:
        r = httpx.post(other.url + "/sessions/restore", json=dict(filename="a.session"), timeout=60)
        assert r.status_code == 400
        assert "a.session was saved under another model or cache layout: model weights digest model-b here, " \
               "model-a in the file" in r.json()["error"]["message"]
    with serve(setup) as off:
        r = httpx.post(off.url + "/sessions/save", json=dict(filename="a.session", prompt=PROMPT), timeout=60)
        assert r.status_code == 501 and "--session-dir" in r.json()["error"]["message"]


def test_metrics_count_the_kv_tiers_per_tier(setup):
    with serve(setup, kv_tiers=TierConfig(host_bytes=1 << 20)) as server:
        complete(server, PROMPT)
        for seed in range(3):   # other prompts take the pool's blocks: the prompt's go to host memory
            complete(server, np.random.default_rng(seed + 1).integers(1, 24, 13).tolist())
        again = complete(server, PROMPT)
        text = httpx.get(server.url + "/metrics", timeout=30).text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 12
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("dantinox_kv_tier")}
    assert lines['dantinox_kv_tier_promotions_total{tier="host"}'] == 3
    assert lines['dantinox_kv_tier_hits_total{tier="host"}'] == 3
    assert lines['dantinox_kv_tier_stores_total{tier="host"}'] >= 3
    assert lines['dantinox_kv_tier_capacity_bytes{tier="host"}'] == 1 << 20
    assert 0 < lines['dantinox_kv_tier_bytes{tier="host"}'] <= 1 << 20
