"""Host side of speculative decoding: check the request, prefill, run the compiled speculative loop, report
the acceptance.

``speculative_generate(model, prompt_ids, max_new_tokens, spec_tokens=k, ngram_max=n, ...)`` takes the same
arguments as ``decode.generate_result`` and returns the same GenerationResult (greedy: the same tokens) with a
SpecStats. ``speculative_stream`` is ``decode.stream_tokens`` with speculation: the same compiled loop called
with a step bound a chunk further each time (greedy: the same tokens; sampling: the same distribution, not the
same draws as the unchunked call, since the loop's PRNG stream is per iteration). ``SpecSettings`` /
``spec_settings`` carry and check what a caller (``Generator``, the CLI) asks for; ``warm_up_speculative``
compiles the loop ahead; ``verify_cost`` measures what a verify call costs against a plain step, from which
``break_even`` gives the switch-off threshold min_accept (``speculative``'s module docstring).
Errors: ValueError naming ``speculative`` / ``spec_tokens`` / ``ngram_max`` / ``ngram_min`` / ``min_accept`` out
of bounds, or a diffusion model; CapacityError as plain generation.
"""

from __future__ import annotations

import math
import statistics
import time
from functools import partial
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..parallel.distributed import to_host
from ..parallel.mesh import mesh_of, mesh_scope
from ..kv.cache import init_cache
from ..kv.channel_keys import check_spec_group
from .decode import (SINGLE_ROW_WINDOW, DecodeState, _finish, _prepare, _windows, cache_window, decode, new_cache,
                     place_on_mesh, prefill, split_model)
from .speculative import MAX_SPEC_TOKENS, spec_state, speculative_decode


class SpecStats(NamedTuple):
    """Per request: proposed and accepted proposal counts ([B] ints), verify calls and loop iterations (plain
    decode steps after a hand-off included), and handed_off: the tokens per row when the switch-off rule handed
    the request to the compiled decode loop (None: it was not).
    acceptance_rate: accepted / proposed over the batch (0.0 when nothing was proposed); mean accepted length:
    tokens emitted per verify call, accepted + 1 (the target's own token)."""

    proposed: list
    accepted: list
    verify_calls: int
    iterations: int
    handed_off: int | None = None   # tokens generated when the request moved to the compiled decode loop

    @property
    def acceptance_rate(self) -> float:
        total = sum(self.proposed)
        return float(sum(self.accepted) / total) if total else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return float(sum(self.accepted) / (self.verify_calls * len(self.proposed)) + 1) if self.verify_calls else 0.0


PROPOSERS = ("ngram", "draft")


class SpecSettings(NamedTuple):
    """One request's speculation: the proposer ("ngram": prompt lookup; "draft": a draft model, given to the
    call, ``check_draft``), spec_tokens k proposed per verify
    call, the n-gram lengths tried (ngram_max down to ngram_min), and min_accept, the accepted proposals per
    verify call below which a row stops speculating (0.0: never; ``break_even``)."""

    proposer: str = "ngram"
    spec_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    min_accept: float = 0.0


DEFAULT_SETTINGS = SpecSettings()


def spec_settings(speculative, spec_tokens=4, ngram_max=4, ngram_min=1, min_accept=0.0) -> SpecSettings | None:
    """The checked SpecSettings, or None when ``speculative`` is None (plain decoding). ValueError naming
    ``speculative`` (not one of PROPOSERS), the bound it breaks (``check_spec_settings``) or ``min_accept``
    (a finite number in [0, spec_tokens])."""
    if speculative is None:
        return None
    if speculative not in PROPOSERS:
        raise ValueError(f"speculative={speculative!r} is not allowed: one of {', '.join(map(repr, PROPOSERS))} "
                         "or None")
    check_spec_settings(spec_tokens, ngram_max, ngram_min)
    if (not isinstance(min_accept, (int, float, np.floating, np.integer)) or isinstance(min_accept, bool)
            or not math.isfinite(min_accept) or not 0 <= min_accept <= spec_tokens):
        raise ValueError(f"min_accept={min_accept!r} is not allowed: a number in [0, spec_tokens={spec_tokens}]")
    return SpecSettings(speculative, int(spec_tokens), int(ngram_max), int(ngram_min), float(min_accept))


def check_spec_settings(spec_tokens, ngram_max, ngram_min) -> None:
    """ValueError naming the setting: spec_tokens in 1..MAX_SPEC_TOKENS, 1 <= ngram_min <= ngram_max <= 16."""
    for name, value in (("spec_tokens", spec_tokens), ("ngram_max", ngram_max), ("ngram_min", ngram_min)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed: an integer >= 1")
    if spec_tokens > MAX_SPEC_TOKENS:
        raise ValueError(f"spec_tokens={spec_tokens} is not allowed: at most {MAX_SPEC_TOKENS} proposed tokens")
    if ngram_max > 16 or ngram_min > ngram_max:
        raise ValueError(f"ngram_min={ngram_min}, ngram_max={ngram_max} is not allowed: 1 <= ngram_min <= "
                         "ngram_max <= 16")


def speculative_generate(model, prompt_ids, max_new_tokens: int = 64, *, spec_tokens: int = 4, ngram_max: int = 4,
                         ngram_min: int = 1, min_accept: float = 0.0, temperature=0.0, top_k=0, top_p=1.0,
                         seed: int = 0, eos_id=None, mesh=None, draft=None):
    """Generate with speculation: n-gram proposals, or a draft model's when ``draft`` (a Transformer over the
    same vocabulary, ``check_draft``) is given. Returns (GenerationResult, SpecStats); see the module
    docstring. min_accept: the switch-off threshold (SpecSettings; 0.0 never switches off)."""
    settings = spec_settings("ngram" if draft is None else "draft", spec_tokens, ngram_max, ngram_min, min_accept)
    check_spec_group(model.cfg, settings.spec_tokens)
    req = _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    place_on_mesh(model, mesh)
    graphdef, params = split_model(model)
    drafted = _draft_split(model, draft)
    with mesh_scope(mesh_of(params)):
        run = _start(graphdef, params, req, model, draft, drafted)
        run = _advance(graphdef, params, run, req, req.max_new_tokens, settings, _windows(req, model.cfg), drafted)
    return _finish(to_host(run.state.out), req), run.stats()


def speculative_stream(model, prompt_ids, max_new_tokens: int = 64, *, settings: SpecSettings = DEFAULT_SETTINGS,
                       chunk_size: int = 8, temperature=0.0, top_k=0, top_p=1.0, seed: int = 0, eos_id=None,
                       mesh=None, draft=None) -> Iterator[tuple[np.ndarray, SpecStats]]:
    """Yield (new tokens [B, n] int32, SpecStats so far) as ``decode.stream_tokens`` yields its chunks: up to
    chunk_size tokens per device call (the first chunk holds the prefill token too; a verify call that would
    pass the chunk's bound keeps only the tokens up to it). Rows past their stop id yield the fill id. draft:
    the draft model of settings.proposer "draft" (ValueError when one is given without the other).
    ValueError for chunk_size < 1 and as :func:`speculative_generate`."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} is not allowed: an integer >= 1")
    settings = spec_settings(*settings)
    check_spec_group(model.cfg, settings.spec_tokens)
    if (settings.proposer == "draft") != (draft is not None):
        raise ValueError(f"speculative={settings.proposer!r} is not allowed with draft="
                         f"{'None' if draft is None else 'a model'}: a draft model goes with speculative='draft'")
    req = _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    place_on_mesh(model, mesh)
    graphdef, params = split_model(model)
    on, sent, windows = mesh_of(params), 0, _windows(req, model.cfg)
    with mesh_scope(on):
        drafted = _draft_split(model, draft)
        run = _start(graphdef, params, req, model, draft, drafted)
    while True:
        with mesh_scope(on):
            run = _advance(graphdef, params, run, req, min(sent + chunk_size, req.max_new_tokens), settings, windows,
                           drafted)
        produced, done = run.produced(), np.asarray(run.state.done)
        reached = int(produced.max())
        if reached > sent:
            yield np.asarray(run.state.out)[:, sent:reached], run.stats()
            sent = reached
        if bool(np.all(done | (produced >= req.max_new_tokens))):
            return


def warm_up_speculative(model, settings: SpecSettings, prompt_lengths: list[int], draft=None) -> None:
    """Compile the speculative loop of ``settings`` at batch 1 and its start for each prompt length's bucket
    (one 2-token generation from token 0 per length; prefill itself is ``generator.warm_up``'s). Sampling
    settings, seed, stop ids and budget are traced: later calls with the same settings, batch and prompt
    buckets compile nothing."""
    for length in prompt_lengths:
        speculative_generate(model, [0] * length, 2, spec_tokens=settings.spec_tokens,
                             ngram_max=settings.ngram_max, ngram_min=settings.ngram_min, temperature=1.0,
                             draft=draft)


class SpecRun(NamedTuple):
    """Host-side progress of one speculative request: ``state`` is the SpecState of the speculative loop or,
    after ``hand_off``, the DecodeState of the compiled decode loop; ``at_hand_off`` the SpecStats when the
    request was handed off (None before) and ``steps_at`` the decode step it began at."""

    state: object
    at_hand_off: SpecStats | None = None
    steps_at: int = 0

    def produced(self) -> np.ndarray:
        """[B] tokens generated per row so far."""
        if self.at_hand_off is None:
            return np.asarray(self.state.produced)
        return np.full(self.state.done.shape, int(self.state.step))

    def stats(self) -> SpecStats:
        """The SpecStats so far: plain decode steps after the hand-off count as loop iterations."""
        if self.at_hand_off is None:
            return _stats(self.state)
        return self.at_hand_off._replace(iterations=self.at_hand_off.iterations + int(self.state.step)
                                         - self.steps_at)


def check_draft(model, draft) -> None:
    """ValueError naming the first difference that keeps ``draft`` from proposing for ``model``: its paradigm
    (autoregressive only), vocab_size (the proposals and q must index the target's vocabulary) or a
    max_context below the target's (its cache keeps the target's slots). Tokenizer identity (special ids) is
    the caller's check (``Generator``, ``runs.draft``)."""
    ours, theirs = model.cfg, draft.cfg
    if theirs.paradigm != "ar":
        raise ValueError(f"draft paradigm={theirs.paradigm!r} is not allowed: a draft model is autoregressive")
    if theirs.vocab_size != ours.vocab_size:
        raise ValueError(f"draft vocab_size={theirs.vocab_size} differs from the target's vocab_size="
                         f"{ours.vocab_size}: a draft model needs the same tokenizer")
    if theirs.max_context < ours.max_context:
        raise ValueError(f"draft max_context={theirs.max_context} is below the target's max_context="
                         f"{ours.max_context}: the draft's cache keeps every slot the target's does")


def _draft_split(model, draft):
    """(graphdef, params) of the checked draft model, or None."""
    if draft is None:
        return None
    check_draft(model, draft)
    return split_model(draft)


def _start(graphdef, params, req, model, draft=None, drafted=None) -> SpecRun:
    """Prefill ``req`` (into the draft's cache too, when ``drafted``: the split of ``draft``) and return the
    SpecRun after it. model, draft: the Transformers, whose configs size the caches (``decode.new_cache``)."""
    state = prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill,
                    new_cache(model.cfg, len(req.ids), params))
    state = spec_state(state, jnp.asarray(req.ids))
    if drafted is not None:
        draft_state = prefill(*drafted, req.ids, req.lengths, req.key, req.sampling, req.eos_id, req.fill,
                              new_cache(draft.cfg, len(req.ids), drafted[1]))
        state = state._replace(draft_cache=draft_state.cache)
    return SpecRun(state)


def _advance(graphdef, params, run: SpecRun, req, stop: int, settings: SpecSettings, windows,
             drafted=None) -> SpecRun:
    """Advance ``run`` until every row has ``stop`` tokens or met a stop id: the speculative loop while it pays,
    then (``hand_off``) the compiled decode loop over ``windows``; a batch that cannot be handed off finishes in
    the speculative program's own plain loop (the same program: plain_tail is traced)."""
    if run.at_hand_off is None:
        state = _speculate(graphdef, params, run.state, req, stop, settings, False, drafted)
        produced, done = np.asarray(state.produced), np.asarray(state.done)
        live = ~done & (produced < stop)
        if not live.any():
            return SpecRun(state)
        handed = hand_off(state, produced, done)
        if handed is None:
            return SpecRun(_speculate(graphdef, params, state, req, stop, settings, True, drafted))
        run = SpecRun(handed, _stats(state)._replace(handed_off=int(handed.step)), int(handed.step))
    state = decode(graphdef, params, run.state, jnp.int32(stop), req.key, req.sampling, req.eos_id, req.fill,
                   windows=windows)
    return run._replace(state=state)


def _speculate(graphdef, params, state, req, stop: int, settings: SpecSettings, plain_tail: bool, drafted=None):
    draft_graphdef, draft_params = (None, None) if drafted is None else drafted
    return speculative_decode(graphdef, params, state, jnp.int32(stop), req.key, req.sampling, req.eos_id, req.fill,
                              k=settings.spec_tokens, ngram_max=settings.ngram_max, ngram_min=settings.ngram_min,
                              min_accept=jnp.float32(settings.min_accept), plain_tail=jnp.bool_(plain_tail),
                              draft_graphdef=draft_graphdef, draft_params=draft_params)


def _stats(state) -> SpecStats:
    return SpecStats([int(x) for x in np.asarray(state.proposed)], [int(x) for x in np.asarray(state.accepted)],
                     int(state.verify_calls), int(state.iteration))


def hand_off(state, produced: np.ndarray, done: np.ndarray) -> DecodeState | None:
    """The DecodeState that continues SpecState ``state`` in ``decode.decode`` (its cache, tokens, slots, stop
    state and output move over; the PRNG stream continues at decode's step keys, which no speculative iteration
    used since every iteration emits at least one token), or None when the rows are not in step: decode writes
    every row at one shared step, so every row not yet stopped must have the same token count P and every stopped
    row at most P (always so at B = 1). produced, done: [B] host copies of the state's fields."""
    running = produced[~done]
    if len(running) == 0 or running.min() != running.max() or (produced[done] > running[0]).any():
        return None
    return DecodeState(jnp.int32(int(running[0])), state.token, state.index, state.done, state.out, state.cache)


FORWARDS_PER_CALL = 8   # cached forwards one timed call of ``forward_seconds`` runs in a compiled loop


@partial(jax.jit, static_argnames=("graphdef", "count"), donate_argnames=("cache",))
def _forward_loop(graphdef, params, tokens, cache, index, count: int):
    """``count`` cached forwards of ``tokens`` [1, T] at slot ``index`` [1] in one compiled loop, each writing
    its tokens' slots in place as the decode and speculative loops do (the cache is donated and carried).
    Returns (a [] float32 sum of one logit per forward, so no forward is dead code; the written cache)."""
    model = nnx.merge(graphdef, params)

    def one(_, carry):
        cache, total = carry
        logits, cache, _ = model(tokens, use_cache=True, kv_caches=cache, cache_index=index)
        return cache, total + logits[0, -1, 0]

    cache, total = jax.lax.fori_loop(0, count, one, (cache, jnp.float32(0.0)))
    return total, cache


def forward_seconds(model, width: int, repeats: int = 5, at: int | None = None, slots: int | None = None) -> float:
    """The wall time (seconds) of one cached forward of ``width`` new tokens at batch 1 over the first ``slots``
    slots of the static cache (None: all) at slot ``at`` (None: about max_context // 2): the median over
    ``repeats`` timed calls of FORWARDS_PER_CALL forwards each in one compiled loop (after one untimed call that
    compiles), divided by FORWARDS_PER_CALL. Inside a loop, as the decode and speculative loops run them: a call
    from Python adds milliseconds of dispatch per forward (SmolLM2 Q4_1 blocks: 12-15 ms per one-token call
    against 7.5-8.7 ms per step inside the decode loop), which made a verify call look cheaper relative to a step
    than it is (docs/explanation/speculation.md)."""
    graphdef, params = split_model(model)
    cache = init_cache(model.cfg, 1) if slots is None else cache_window(init_cache(model.cfg, 1), slots, model.cfg)
    index = jnp.full((1,), (model.cfg.max_context - width) // 2 if at is None else at, jnp.int32)
    with mesh_scope(mesh_of(params)):
        tokens = jnp.zeros((1, width), jnp.int32)
        total, cache = _forward_loop(graphdef, params, tokens, cache, index, FORWARDS_PER_CALL)
        total.block_until_ready()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            total, cache = _forward_loop(graphdef, params, tokens, cache, index, FORWARDS_PER_CALL)
            total.block_until_ready()
            samples.append((time.perf_counter() - start) / FORWARDS_PER_CALL)
    return statistics.median(samples)


def verify_cost(model, k: int, repeats: int = 5) -> float:
    """c: the time of one cached forward over k + 1 new tokens (a verify call, over the whole static cache as the
    speculative loop runs it) divided by the time of one over 1 token (a plain step as the decode loop runs it
    after a hand-off: over its smallest one-row window, ``decode.SINGLE_ROW_WINDOW`` slots or max_context if
    fewer), at batch 1 and slot (window - k - 1) // 2; medians of ``repeats`` timed calls each
    (``forward_seconds``). Wall time, so a loaded host moves it."""
    window = min(SINGLE_ROW_WINDOW, model.cfg.max_context)
    at = (window - k - 1) // 2
    return forward_seconds(model, k + 1, repeats, at) / forward_seconds(model, 1, repeats, at, window)


def draft_cost(model, draft, repeats: int = 5) -> float:
    """r: one draft forward of 1 token over one target forward of 1 token (``forward_seconds``); a draft round
    of k proposals costs about k * r plain steps on top of the verify call."""
    at = model.cfg.max_context // 2
    return forward_seconds(draft, 1, repeats, at) / forward_seconds(model, 1, repeats, at)


def break_even(cost: float, k: int) -> float:
    """min_accept for a verify call that costs ``cost`` plain steps: it emits 1 + a tokens for a accepted
    proposals and pays while 1 + a > cost, so a row switches off below a = cost - 1 (clipped to [0, k])."""
    return float(min(max(cost - 1.0, 0.0), k))
