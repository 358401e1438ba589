"""Case K14 (../shared/cases/ACCEPTANCE.md): the serving engine compiles nothing after its warm-up. The paged
engine of a tiny model is warmed, then driven through every block move it has: a prompt wholly in the prefix
cache (its last token recomputed into a shared block: copy-on-write), more prompts with a shared first block
(prefix-cache hits), and a pool too small for the running requests (preemption, with ``recompute`` and with
``swap``: blocks read to host memory and written back). Compilations are counted with ``dantinox.CompileCounter``
(a ``jax.monitoring`` listener; a load from the persistent XLA cache counts too) from the end of the warm-up:
zero, under both policies, with and without the persistent program store (serve runs with it on).

Each case starts from empty caches (``jax.clear_caches``, ``clear_programs``), as a new server process does:
otherwise a program compiled by an earlier case would hide a compilation here.

The fault this case found on the way: the warm-up compiled the block moves on the pool as ``init_pool`` made it
(uncommitted arrays), while the steps call them with the pool a stored forward program returned (committed to
the CPU device), so with the program store on ``copy_blocks`` compiled at the first copy-on-write and
``read_blocks`` / ``write_blocks`` at the first swap; the engine now commits its pool to its device
(``PagedEngine._place_pool``)."""

import jax
import numpy as np
import pytest
from conftest import tiny_config
from serving_util import drain, lively_model, make_engine

import dantinox as dx
from dantinox.programs.store import clear_programs
from dantinox.serving.request import SamplingOptions

CFG = tiny_config(attention="gqa", kv_heads=2, max_context=64)


@pytest.fixture(scope="module")
def model():
    return lively_model(CFG)


@pytest.fixture(params=["store-off", "store-on"])
def store(request, tmp_path, monkeypatch):
    """The program store off (the suite's default) or on in tmp_path; every cache empty at the start."""
    if request.param == "store-on":
        monkeypatch.setenv("DANTINOX_PROGRAM_STORE", "on")
        monkeypatch.setenv("DANTINOX_XLA_CACHE", str(tmp_path))
    jax.clear_caches()
    clear_programs()
    yield request.param
    clear_programs()


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_k14_no_compilation_after_warmup(model, store, policy):
    engine = make_engine(model, num_blocks=14, preemption=policy)
    warm = engine.warmup()
    assert warm.compilations > 0                      # the warm-up did compile (the caches were empty)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, CFG.vocab_size, 8).tolist()      # two full blocks of 4 tokens
    with dx.CompileCounter() as counted:
        engine.add_request(shared, SamplingOptions(max_new_tokens=4))
        engine.step()                                             # its prompt is computed and cached
        engine.add_request(shared, SamplingOptions(max_new_tokens=4))            # wholly cached: copy-on-write
        engine.add_request(shared[:4] + [1, 2, 3], SamplingOptions(max_new_tokens=4))   # first block cached
        for i, n in enumerate([3, 17, 30, 6, 9]):                 # more than 14 blocks: preemption
            engine.add_request(rng.integers(0, CFG.vocab_size, n).tolist(),
                               SamplingOptions(max_new_tokens=12 + i, temperature=0.5 * (i % 2), seed=i))
        results = drain(engine)
    assert {reason for _, reason in results.values()} <= {"length", "stop"}, results   # no failed step
    stats = engine.stats()
    assert stats["cow_copies"] >= 1 and stats["prefix_cache_hits"] >= 2 and stats["preemptions"] >= 1, stats
    assert counted.compilations == 0 and counted.cache_hits == 0, counted
