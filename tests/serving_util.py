"""Helpers for the serving tests: drive an engine to completion with a bounded loop, batch-1 references."""

from functools import partial

import jax
import numpy as np
from conftest import forward, spiky_mla, spiky_model
from flax import nnx

import dantinox as dx
from dantinox.serving.engine import EngineConfig, PagedEngine
from dantinox.kv.paged import paged_views
from dantinox.serving.request import SamplingOptions

# Few buckets keep the number of compilations (and the suite's time on two CPUs) small.
SMALL_BUCKETS = dict(prefill_buckets=(1, 4), chunk_buckets=(8, 16))


def lively_model(cfg: dx.ModelConfig, seed: int = 3):
    """A random model (untied output projection, sharp attention) whose greedy output changes from token to
    token and from prompt to prompt. A plain random tiny model with tied embeddings repeats its last input
    token, which would hide position and cache bugs."""
    return spiky_model(cfg.replace(tie_embeddings=False), seed=seed, qk_scale=4.0)


def lively_mla_model(cfg: dx.ModelConfig, seed: int = 3, scale: float = 8.0):
    """The MLA counterpart of ``lively_model``: untied output projection, and the query up-projection, the key
    up-projection W_UK and the RoPE-key projection scaled up so attention is far from uniform."""
    return spiky_mla(cfg.replace(tie_embeddings=False), seed=seed, scale=scale)


def make_engine(model, **fields) -> PagedEngine:
    settings = dict(block_size=4, max_running=4, max_batched_tokens=16, decode_buckets=(1, 4),
                    **SMALL_BUCKETS)
    settings.update(fields)
    draft = settings.pop("draft", None)
    return PagedEngine(model, EngineConfig(**settings), draft=draft)


def drain(engine, max_steps: int = 2000, on_step=None) -> dict:
    """Step until nothing is unfinished (at most max_steps). Returns {request_id: (tokens, finish_reason)}."""
    tokens, reasons = {}, {}
    for step in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in reasons, f"{out.request_id} finished twice"
                reasons[out.request_id] = out.finish_reason
        if on_step is not None:
            on_step(step, tokens)
    else:
        raise AssertionError(f"engine still busy after {max_steps} steps: {engine.stats()}")
    return {rid: (tokens.get(rid, []), reasons[rid]) for rid in reasons}


def solo(model, prompt, max_new_tokens: int, **sampling) -> list:
    """The batch-1 reference: dx.generate on one prompt."""
    return np.asarray(dx.generate(model, prompt, max_new_tokens, **sampling)).tolist()


def greedy(n: int) -> SamplingOptions:
    return SamplingOptions(max_new_tokens=n)


@partial(jax.jit, static_argnames=("graphdef",))
def paged_logits(graphdef, params, pool, ids, start, num_new, table):
    """The model over a paged pool: logits [B, T, V] and the updated pool."""
    model = nnx.merge(graphdef, params)
    views = paged_views(pool, table, num_new)
    logits, views, _ = model(ids, use_cache=True, kv_caches=views, cache_index=start)
    return logits, tuple(v.pool for v in views)


def static_logits(model, tokens):
    """The reference: prefill of the whole sequence into the static cache. Returns [T, V]."""
    cache = dx.init_cache(model.cfg, 1)
    logits, _, _ = forward(model, np.array([tokens], np.int32), use_cache=True, kv_caches=cache, cache_index=0)
    return np.asarray(logits[0])


def chunked_paged_run(model, pool, seqs, tables):
    """Feed three sequences through the pool in ragged chunks (two prefill chunks, then decode-sized steps),
    with a fourth, unused row (num_new 0) and block tables ``tables`` [3, M]. Returns (per-sequence logits
    [len, V] in order, the pool)."""
    graphdef, params = nnx.split(model)
    M = tables.shape[1]
    chunks = [(3, 6, 8), (2, 5, 7), (0, 0, 1), (0, 0, 1)]
    done, got = [0, 0, 0], [[], [], []]
    for sizes in chunks:
        T = max(8 if max(sizes) > 1 else 1, max(sizes))
        ids = np.zeros((4, T), np.int32)
        for b, n in enumerate(sizes):
            ids[b, :n] = seqs[b][done[b]:done[b] + n]
        start = np.array(done + [0], np.int32)
        num_new = np.array(list(sizes) + [0], np.int32)
        table = np.concatenate([tables, np.zeros((1, M), np.int32)])
        logits, pool = paged_logits(graphdef, params, pool, ids, start, num_new, table)
        for b, n in enumerate(sizes):
            got[b].append(np.asarray(logits[b, :n]))
            done[b] += n
    assert done == [len(s) for s in seqs]
    return [np.concatenate(g) for g in got], pool


def assert_speculation_compiles_nothing_after_warmup(engine, prompts) -> None:
    """Warm a speculative ``engine`` (its verify programs among the warm-up items), then serve ``prompts``
    [(prompt ids, max new tokens)] with mixed sampling (greedy and sampled rows, top-k, top-p, seeds, logprobs on
    the fourth): no program is compiled or loaded, the engine verified and preempted."""
    labels = [item.label for item in engine.warmup_items()]
    assert "verify B=1 M=16" in labels and "verify B=4 M=16" in labels
    engine.warmup()
    with dx.CompileCounter() as counted:
        for i, (prompt, n) in enumerate(prompts):
            engine.add_request(prompt, SamplingOptions(max_new_tokens=n, temperature=0.5 * (i % 2), top_k=i,
                                                       top_p=0.9, seed=i, logprobs=1 if i == 3 else None))
        drain(engine)
    assert counted.compilations == 0 and counted.cache_hits == 0, counted
    assert engine.stats()["spec_verify_calls"] > 0 and engine.stats()["preemptions"] >= 1
