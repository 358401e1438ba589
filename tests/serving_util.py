"""Helpers for the serving tests: drive an engine to completion with a bounded loop, batch-1 references."""

import numpy as np

import dantinox as dx
from conftest import spiky_model
from dantinox.serving.engine import EngineConfig, PagedEngine
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
    cfg = cfg.replace(tie_embeddings=False)
    model = dx.build_model(cfg, seed)
    C, Q = cfg.kv_latent_dim, cfg.q_latent_dim or 0
    for blk in model.blocks:
        a = blk.attn
        a.q_up.kernel[...] = a.q_up.kernel[...] * scale
        a.w_uk[...] = a.w_uk[...] * scale
        a.down.kernel[...] = a.down.kernel[...].at[:, Q + C:].multiply(scale)
    return model


def make_engine(model, **fields) -> PagedEngine:
    settings = dict(block_size=4, max_running=4, max_batched_tokens=16, decode_buckets=(1, 4),
                    **SMALL_BUCKETS)
    settings.update(fields)
    return PagedEngine(model, EngineConfig(**settings))


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
