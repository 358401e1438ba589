"""Prove speculative verification exact: the cached logits of every accepted position equal the uncached forward.

``verify_speculative`` runs greedy n-gram speculation one verify call at a time through the static cache, as
``generation.speculative`` does inside its loop: propose k tokens by prompt lookup (``ngram.propose_ngram``),
feed [newest token, d_1 .. d_k] at the row's slot (T = k + 1), accept the longest prefix equal to the argmax,
move the slot by the tokens emitted, and leave the rejected proposals' keys past it for the next call to
overwrite. It keeps the logits at each emitted position (the accepted proposals' and the target's own token's),
then compares them position by position with one plain causal forward (use_cache=False) over prompt + generated
tokens, with ``verify.verify_cache``'s tolerance rule; an int8 cache is compared against the reference that
adopts its rounding flips (``quality.int8_reference``; per (group, channel) for per-channel keys, the int8
default, ``quality.channel_reference``: a rejected proposal that completed a key group is re-quantized when
the group completes again, so the final cache's groups are the accepted tokens'), as there. Where fewer than
k + 1 slots are left, the run finishes with one-token steps. Shape letters: T tokens, V vocabulary.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..generation.ngram import propose_ngram
from ..generation.prompts import check_request, prepare_prompts
from ..kv.cache import init_cache
from ..parallel.mesh import mesh_of, mesh_scope
from ..kv.channel_keys import check_spec_group
from .int8_reference import RoundingAudit
from .verify import VerifyReport, _int8_reference, _reference, _step


def verify_speculative(model, prompt_ids, new_tokens: int = 64, spec_tokens: int = 4, ngram_max: int = 4,
                       tolerance: float = 1e-4, relative_tolerance: float = 0.0) -> tuple[VerifyReport, int, int]:
    """Compare the cached logits of greedy n-gram speculation with uncached logits (module docstring).

    prompt_ids: one prompt (ints); spec_tokens k (1..16) and ngram_max as ``speculative_generate``'s. Returns
    (VerifyReport over the prompt's and every emitted position, proposals accepted, proposals made).
    Raises ValueError / CapacityError as ``verify_cache`` (a diffusion model, a bad prompt, no room), and
    ValueError naming --spec-tokens and --kv-key-group for per-channel keys with spec_tokens + 1 > the key group
    (``check_spec_group``)."""
    cfg = model.cfg
    if cfg.paradigm != "ar":
        raise ValueError(f"verify --speculative checks the autoregressive static cache; this model has "
                         f"paradigm={cfg.paradigm!r}")
    check_spec_group(cfg, spec_tokens)
    ids, lengths, _ = prepare_prompts(list(prompt_ids), cfg.vocab_size, cfg.max_context)
    check_request(lengths, new_tokens, cfg.max_context)
    prompt = ids[0, : int(lengths[0])]
    graphdef, params = nnx.split(model)
    with mesh_scope(mesh_of(params)):
        cached, tokens, cache, accepted, proposed = _speculative_run(graphdef, params, cfg, prompt, new_tokens,
                                                                     spec_tokens, ngram_max)
        full = jnp.asarray(np.concatenate([prompt, tokens[:-1]]).astype(np.int32)[None])
        flips = None
        if cfg.cache_dtype == "int8" and cfg.compute_dtype == "float32":
            reference, counts = _int8_reference(graphdef, params, full, cache)
            flips = RoundingAudit(*(int(c) for c in np.asarray(counts)))
        else:
            reference = _reference(graphdef, params, full)
        reference = np.asarray(reference[0])
    diff = np.abs(cached - reference).max(axis=-1)
    allowed = np.maximum(tolerance, relative_tolerance * np.abs(reference).max(axis=-1))
    passed = bool((diff <= allowed).all()) and (flips is None or flips.faults == 0)
    return VerifyReport(np.arange(len(diff)), diff, tokens, allowed, passed, None, flips), accepted, proposed


def _speculative_run(graphdef, params, cfg, prompt: np.ndarray, new_tokens: int, k: int, ngram_max: int):
    """Prefill, then greedy verify calls of k proposals (one-token steps where k + 1 slots do not fit).
    Returns (logits [T + new_tokens - 1, V] float32 at the prompt's and each emitted position but the last,
    the new_tokens greedy tokens, the final cache, proposals accepted, proposals made)."""
    n, S = len(prompt), cfg.max_context
    seq = np.zeros((1, S), np.int32)
    seq[0, :n] = prompt
    logits, cache = _step(graphdef, params, jnp.asarray(prompt[None], jnp.int32), init_cache(cfg, 1), jnp.int32(0))
    kept = [np.asarray(logits[0])]
    tokens = [int(np.argmax(kept[-1][-1]))]
    accepted = proposed = 0
    while len(tokens) < new_tokens:
        index = n + len(tokens) - 1            # the slot of tokens[-1], not yet in the cache
        seq[0, index] = tokens[-1]
        width = k if index + k + 1 <= S else 0
        feed = [tokens[-1]]
        if width:
            props, _ = propose_ngram(jnp.asarray(seq), jnp.asarray([index], jnp.int32), k, ngram_max, 1)
            feed += [int(t) for t in np.asarray(props)[0]]
        logits, cache = _step(graphdef, params, jnp.asarray([feed], jnp.int32), cache, jnp.int32(index))
        logits = np.asarray(logits[0])
        picks = np.argmax(logits, axis=-1)
        a = 0
        while a < width and picks[a] == feed[a + 1]:
            a += 1
        emit = min(a + 1, new_tokens - len(tokens))
        accepted, proposed = accepted + min(a, emit), proposed + width
        kept.append(logits[:emit])
        tokens += [int(t) for t in picks[:emit]]
        if emit > 1:
            seq[0, index + 1: index + emit] = tokens[-emit:-1]
    cached = np.concatenate(kept, axis=0)[: n + new_tokens - 1]
    return cached, tokens, cache, accepted, proposed
