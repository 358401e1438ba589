"""Speculative decoding under a grammar: n-gram proposals checked against each row's matcher, verified k at a
time from the masked distributions, in a host-stepped loop (``constrained_decode``'s, with a verify step).

Each iteration, on the host:
  1. Propose k tokens per row by prompt lookup (``ngram.propose_ngram`` over the row's prompt + tokens).
  2. Draft (``_draft``): a constrained row's proposals are walked through its matcher. Position 0's mask is
     the row's current one; each proposal the mask of its position allows is consumed and the matcher writes
     the mask of the next position; the proposal is truncated at the first token the grammar forbids (or a
     stop id, or where the grammar is complete), then the matcher is rolled back. ``limit[b]`` is the number
     of proposals left (0..k); an unconstrained row keeps all k, with all-ones masks.
  3. Verify (``masked_verify``): one forward of [last token, d_1 .. d_k] at each row's slot; each position's
     logits are masked with its mask, then ``speculative.accept_proposals`` with ``limit``: greedy rows accept
     the longest prefix equal to the masked argmax and emit the masked argmax after it, so the tokens are
     those of plain constrained greedy decoding, token for token; sampled rows take the rejection rule on the
     masked distributions (the output distribution is the masked target's).
  4. Emit: the accepted proposals and the target's token go through ``ConstrainedRows.push`` (matcher
     advance, stop ids, a complete grammar, max_new_tokens), then the row's mask is refreshed.
When no row keeps a proposal, when a live row has fewer than k + 1 free cache slots, or for rows whose
measured acceptance makes verifying a loss (``speculative.PROBE_VERIFIES``, ``min_accept``), the iteration is
one plain ``constrained_decode.masked_step``. The cache needs no rollback (as in ``speculative``): slots past
a row's index hold rejected keys that no query reads. The verify step compiles once per (B, k, model shape);
the masks are traced, so every grammar shares it. Keys: iteration j (plain or verify) uses
``fold_in(key, j)``; the prefill is iteration 0.
Shape letters: B batch, S max_context, V vocabulary, W mask words, k proposed tokens.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from flax import nnx

from ..parallel.mesh import mesh_of, mesh_scope
from .constrained_decode import ConstrainedRows, check_constraints, masked_prefill, masked_step
from .decode import GenerationResult, _prepare, new_cache, place_on_mesh, split_model
from .grammar import mask_allows
from .ngram import propose_ngram
from .sampling import SamplingParams, apply_token_mask
from .speculative import PROBE_VERIFIES, accept_proposals
from .speculative_generate import DEFAULT_SETTINGS, SpecSettings, SpecStats, spec_settings

_propose = jax.jit(propose_ngram, static_argnames=("k", "ngram_max", "ngram_min"))


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def masked_verify(graphdef, params, cache, inputs, index, limit, key, sampling: SamplingParams, token_masks):
    """Verify proposals under per-position masks. inputs: [B, k + 1] int32 (each row's newest token, then its
    k proposals) written at slots index [B] int32 ..; limit: [B] int32, the proposals that may be accepted;
    token_masks: [B, k + 1, W] int32 (position j's mask applies to the logits after inputs[:, j]). Returns
    (tokens [B, k + 1] int32, accepted [B] int32, cache): as ``speculative.accept_proposals``."""
    model = nnx.merge(graphdef, params)
    logits, cache, _ = model(inputs, use_cache=True, kv_caches=cache, cache_index=index)
    B, T, V = logits.shape
    masked = apply_token_mask(logits.reshape(B * T, V), token_masks.reshape(B * T, -1)).reshape(B, T, V)
    tokens, accepted = accept_proposals(masked, inputs[:, 1:], key, sampling, limit)
    return tokens, accepted, cache


def _draft(rows: ConstrainedRows, b: int, proposals, masks: np.ndarray) -> int:
    """Write row b's masks for positions 0..k into ``masks`` ([k + 1, W] int32) and return how many of its
    ``proposals`` ([k] ints) the grammar allows in a row (module docstring, step 2); the matcher is left as
    it was. An unconstrained row: all-ones masks, all k."""
    masks[:] = rows.mask[b]
    matcher = rows.matchers[b]
    if matcher is None:
        return len(proposals)
    n = 0
    for token in proposals:
        if token in rows.stop_ids or not mask_allows(masks[n], token):
            break
        if not matcher.advance(token):
            raise RuntimeError(f"row {b}: token {token} is in its mask but its grammar refuses it: {matcher.error}")
        n += 1
        matcher.fill_mask(masks[n])
        if matcher.stopped:
            break
    matcher.rollback(n)
    return n


class _Speculation:
    """Host state of the loop besides ``ConstrainedRows``: each row's sequence (for lookup), slot and acceptance."""

    def __init__(self, req, settings: SpecSettings, max_context: int):
        B = len(req.ids)
        self.settings, self.S = settings, max_context
        self.seq = np.zeros((B, max_context), np.int32)
        self.seq[:, :req.ids.shape[1]] = req.ids
        self.prompt = np.asarray(req.lengths, np.int32)
        self.proposed, self.accepted, self.calls = np.zeros(B, int), np.zeros(B, int), np.zeros(B, int)
        self.verify_calls, self.iterations = 0, 1   # iterations: the prefill was iteration 0 (its key)

    def slots(self, rows: ConstrainedRows) -> np.ndarray:
        """[B] int32: each row's newest token's slot (0 for an ended row: its writes are never read)."""
        live = np.array([r is None for r in rows.reasons])
        return np.where(live, self.prompt + rows.lengths - 1, 0).astype(np.int32)

    def pays(self, b: int) -> bool:
        calls = self.calls[b]
        return calls < PROBE_VERIFIES or self.accepted[b] >= self.settings.min_accept * calls

    def stats(self) -> SpecStats:
        return SpecStats(self.proposed.tolist(), self.accepted.tolist(), self.verify_calls, self.iterations - 1)


def _plan(rows: ConstrainedRows, spec: _Speculation, index: np.ndarray):
    """(proposals [B, k] int32, limit [B] int32, masks [B, k + 1, W] int32) of this iteration, or None when
    it should be a plain step (no row keeps a proposal, or a live row lacks k + 1 free slots)."""
    k = spec.settings.spec_tokens
    live = [b for b, r in enumerate(rows.reasons) if r is None]
    if max(index[b] for b in live) + k + 1 > spec.S:
        return None
    for b in live:   # the row's tokens after its prompt: a verify call may have emitted several
        spec.seq[b, spec.prompt[b]:index[b] + 1] = rows.out[b, :rows.lengths[b]]
    proposals, found = _propose(spec.seq, index, k, spec.settings.ngram_max, spec.settings.ngram_min)
    proposals, found = np.asarray(proposals), np.asarray(found)
    limit = np.zeros(len(index), np.int32)
    masks = np.repeat(rows.mask[:, None], k + 1, axis=1)
    for b in live:
        if found[b] and spec.pays(b):
            limit[b] = _draft(rows, b, proposals[b].tolist(), masks[b])
    return (proposals, limit, masks) if limit.any() else None


def _emit(rows: ConstrainedRows, spec: _Speculation, tokens: np.ndarray, accepted: np.ndarray,
          limit: np.ndarray) -> None:
    """Push each live row's accepted proposals and the target's token, count its acceptance, refresh its mask."""
    for b, reason in enumerate(list(rows.reasons)):
        if reason is not None:
            continue
        if limit[b]:
            spec.calls[b] += 1
            spec.proposed[b] += int(limit[b])
            spec.accepted[b] += int(accepted[b])
        for token in tokens[b, :int(accepted[b]) + 1].tolist():
            if rows.push(b, token):
                break
        else:
            rows.refresh(b)


def constrained_speculative_result(model, prompt_ids, constraints: list, max_new_tokens: int = 64, *,
                                   settings: SpecSettings = DEFAULT_SETTINGS, temperature=0.0, top_k=0, top_p=1.0,
                                   seed: int = 0, eos_id=None, mesh=None) -> tuple[GenerationResult, SpecStats]:
    """Generate with one Constraint (or None) per row and n-gram speculation (module docstring).

    Arguments as :func:`dantinox.generation.constrained_decode.constrained_result`; settings: the SpecSettings
    (spec_tokens k, n-gram bounds, min_accept). Returns (GenerationResult, SpecStats): greedy tokens equal
    constrained_result's; SpecStats.proposed counts the proposals left after the grammar's truncation.
    Raises as constrained_result, and ValueError naming a bad setting (``spec_settings``)."""
    settings = spec_settings(*settings)
    place_on_mesh(model, mesh)
    req = _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
    check_constraints(constraints, len(req.ids), model.cfg.vocab_size)
    stops = tuple(int(e) for e in np.asarray(req.eos_id) if e >= 0)
    rows = ConstrainedRows(list(constraints), stops, model.cfg.vocab_size, req.max_new_tokens, int(req.fill))
    spec = _Speculation(req, settings, model.cfg.max_context)
    graphdef, params = split_model(model)
    with mesh_scope(mesh_of(params)):
        token, cache = masked_prefill(graphdef, params, req.ids, req.lengths, req.key, req.sampling, rows.mask,
                                      new_cache(model.cfg, len(req.ids), params))
        done = rows.take(np.asarray(token))
        while not done:
            index = spec.slots(rows)
            newest = rows.out[np.arange(len(index)), np.maximum(rows.lengths - 1, 0)]
            key = jax.random.fold_in(req.key, spec.iterations)
            plan = _plan(rows, spec, index)
            if plan is None:
                token, cache = masked_step(graphdef, params, cache, newest, index, np.int32(spec.iterations),
                                           req.key, req.sampling, rows.mask)
                done = rows.take(np.asarray(token))
            else:
                proposals, limit, masks = plan
                inputs = np.concatenate([newest[:, None], proposals], axis=1)
                tokens, accepted, cache = masked_verify(graphdef, params, cache, inputs, index, limit, key,
                                                        req.sampling, masks)
                _emit(rows, spec, np.asarray(tokens), np.asarray(accepted), limit)
                spec.verify_calls += 1
                done = all(r is not None for r in rows.reasons)
            spec.iterations += 1
    return GenerationResult(rows.out, rows.lengths, list(rows.reasons)), spec.stats()

