"""After ``Generator(...)`` a generate or stream call of any prompt length and any max_new_tokens up to the
context compiles nothing. Run in a subprocess, so the test process's own compilations do not count. The child
shares the test run's persistent compilation cache (DANTINOX_XLA_CACHE, set by conftest.py): a program loaded
from it still counts as a compilation in CompileCounter (both fire JAX's backend_compile_duration event), and
the loads are also counted apart (cache_hits), so a load cannot stand in for a compilation after the warmup."""

import json
import os
import subprocess
import sys

import pytest
from paths import REPO
from run_util import make_run

from dantinox.generation.generator import prompt_buckets

CHILD = r"""
import json, sys
from dantinox import CompileCounter
from dantinox.generation.generator import Generator
gen = Generator(sys.argv[1])
S = gen.cfg.max_context
counts, hits = [], []
for prompt_len, new in [(1, 1), (1, S - 1), (5, 2), (17, 30), (40, 10), (S - 1, 1), (33, S - 33)]:
    prompt = ("Nel mezzo del cammin di nostra vita " * 4)[:prompt_len]
    with CompileCounter() as counted:
        gen.generate(prompt, new, temperature=0)
        gen.generate(prompt, new, temperature=0.9, top_k=5, top_p=0.8, seed=3)
        "".join(gen.stream(prompt, new, temperature=0.7, chunk_size=3))
    counts.append(counted.compilations)
    hits.append(counted.cache_hits)
print(json.dumps({"warmup": gen.warmup.compilations, "after": counts, "after_hits": hits}))
"""


# 1024: one-row requests decode in 512 or 1024 slots (slow tier)
@pytest.mark.parametrize("max_context", [64, pytest.param(1024, marks=pytest.mark.slow)])
def test_generator_warmup_covers_prefill_buckets_and_the_decode_loop(tmp_path, max_context):
    run_dir = make_run(tmp_path / "tiny", attention="gqa", kv_heads=2, max_context=max_context)  # char tokenizer
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", CHILD, run_dir], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["warmup"] > 0
    assert result["after"] == [0] * 7             # neither compiled nor loaded from the persistent cache
    assert result["after_hits"] == [0] * 7


def test_prompt_buckets_cover_every_prompt_length():
    from dantinox.generation.prompts import bucket_length

    for S in (16, 17, 64, 100, 256):
        buckets = prompt_buckets(S)
        assert {bucket_length(n, S) for n in range(1, S)} == {bucket_length(b, S) for b in buckets}
        assert all(b < S for b in buckets)
