"""The speculative part of ``PagedEngine``'s step: which decode rows run a verify call, the calls themselves
(n-gram proposals checked by the target, ``verify_step``, or a draft model's, ``draft_verify``), and their
bookkeeping (accepted tokens, the verify-cost meter). A mixin: its methods read the engine's allocator, cache
manager, buckets and counters.
"""

from __future__ import annotations

import jax
import numpy as np

from .draft_verify import draft_verify_step
from .request import Request, RequestOutput, TokenLogprobs
from .runner import StepLogprobs
from .scheduler import Chunk
from .speculation import eligible, plan_speculation, record
from .step_plan import bucket
from .verify_step import verify_step


class SpeculationCalls:
    """PagedEngine's speculative decoding (module docstring)."""

    def _time_call(self, verifies: list, forwards: list, chunks: list[Chunk], seconds: float) -> None:
        """Book a step that ran one call, a verify call or a decode-only forward call, in the verify-cost
        meter (``verify_cost``); steps with several calls or prefill rows are not timed."""
        if len(verifies) + len(forwards) != 1 or not self.speculative:
            return
        if verifies:
            _, B, M = verifies[0]
            self.verify_meter.verify(B, M, seconds)
        elif all(c.num_tokens == 1 for c in chunks) and forwards[0][2] == 1:
            self.verify_meter.plain(forwards[0][1], -1, seconds)

    # Speculative decoding ---------------------------------------------------------------------------
    def _plan_speculation(self, chunks: list[Chunk]) -> dict | None:
        """{id(chunk): limit} of the decode chunks a verify call runs this step, or None (``speculation``)."""
        if self.speculative is None:
            return None
        P = self.allocator.block_size
        held = lambda c: len(self.allocator.table(c.request.request_id)) * P - c.start  # noqa: E731
        if self.speculative.verify_costs:   # --spec-verify-cost: the user's c(n)
            return plan_speculation(chunks, self.speculative, held)
        rows = sum(map(eligible, chunks))
        B = bucket(min(rows, self.decode_buckets[-1]), self.decode_buckets) if rows else 0
        if not rows or self.verify_meter.needs_plain(B):   # probe: a plain step gets its time measured
            return None
        return plan_speculation(chunks, self.speculative, held, self.verify_meter.cost(B))

    def _verify_calls(self, chunks: list[Chunk], limits: dict) -> list[tuple[list, int, int]]:
        """The verify calls: [(chunks, B, M)], B at most the largest decode bucket, M the table bucket covering
        the furthest position a row of the call writes."""
        calls, width = [], self.decode_buckets[-1]
        for i in range(0, len(chunks), width):
            part = chunks[i:i + width]
            reach = max(c.start + limits[id(c)] + 1 for c in part)
            M = bucket(self.allocator.blocks_for(reach), self.table_buckets)
            calls.append((part, bucket(len(part), self.decode_buckets), M))
        return calls

    def _verify_args(self, part: list[Chunk], limits: list[int], B: int, M: int) -> tuple:
        """verify_step's arguments for ``part`` padded to B rows over block tables of M entries (the rows'
        tokens seq [B, M * P] for prompt lookup; with a draft model draft_verify_step's, the last tokens [B])."""
        limit = np.full(B, -1, np.int32)
        limit[:len(part)] = limits
        if self.draft_cfg is not None:   # the draft's pool holds each row's history: its last token only
            seq = np.zeros(B, np.int32)
            seq[:len(part)] = [c.request.all_tokens[c.start] for c in part]
        else:
            seq = np.zeros((B, M * self.allocator.block_size), np.int32)
            for b, chunk in enumerate(part):
                tokens = chunk.request.all_tokens[:chunk.start + 1]
                seq[b, :len(tokens)] = tokens
        start, tables, seeds, steps, sampling = self._row_inputs(part, B, M)
        with_logprobs = np.bool_(any(c.request.options.logprobs is not None for c in part))
        return (self.graph, self.params, self.pool, seq, start, limit, tables, seeds, steps, sampling, with_logprobs)

    def _verify_fn(self):
        """The compiled verify call and its static arguments: ``verify_step`` (n-gram) or ``draft_verify_step``."""
        spec = self.speculative
        if self.draft_cfg is not None:
            return draft_verify_step, dict(k=spec.spec_tokens, target_layers=self.cfg.num_blocks)
        return verify_step, dict(k=spec.spec_tokens, ngram_max=spec.ngram_max, ngram_min=spec.ngram_min)

    def _warm_verify(self, B: int, M: int) -> None:
        """Compile the verify call for bucket (B, M) without running it (as ``_warm_forward``)."""
        fn, statics = self._verify_fn()
        fn.lower(*self._verify_args([], [], B, M), **statics).compile()

    def _call_verify(self, part: list[Chunk], limits: list[int], B: int, M: int):
        """Dispatch one verify call; returns its VerifyOut (device arrays) without waiting."""
        fn, statics = self._verify_fn()
        out, self.pool = fn(*self._verify_args(part, limits, B, M), **statics)
        self.counters["forward_calls"] += 1
        self.counters["spec_verify_calls"] += 1
        self.step_calls.append(("verify", B, M * self.allocator.block_size, self.speculative.spec_tokens + 1))
        return out

    def _verified_rows(self, part: list[Chunk], limits: dict, out) -> dict:
        """{id(chunk): (tokens, logprobs or None, (limit, proposed))} of one fetched verify call."""
        out = jax.device_get(out)
        rows = {}
        for b, chunk in enumerate(part):
            n = int(out.accepted[b]) + 1
            tokens = [int(t) for t in out.tokens[b, :n]]
            logprobs = None
            if chunk.request.options.logprobs is not None:
                lp = out.logprobs
                logprobs = [row_logprobs(chunk, t, StepLogprobs(lp.chosen[:, j], lp.top_ids[:, j], lp.top[:, j]), b)
                            for j, t in enumerate(tokens)]
            rows[id(chunk)] = (tokens, logprobs, (limits[id(chunk)], int(out.proposed[b])))
        return rows

    def _record_verify(self, req: Request, verified: tuple, emitted: int, outs: list[RequestOutput]) -> None:
        """Book a verify call of ``req`` (engine counters, the request's SpecRowStats) and stamp its outputs."""
        proposed, accepted = record(req, *verified, emitted)
        self.counters["spec_proposed_tokens"] += proposed
        self.counters["spec_accepted_tokens"] += accepted
        totals = (req.spec.proposed, req.spec.accepted)
        for out in outs:
            out.speculative = totals


def row_logprobs(chunk: Chunk, token: int, step: StepLogprobs | None, b: int) -> TokenLogprobs | None:
    """Row b of a step's log-probabilities as the chunk's request asked for them (None if it did not; step is
    None when no row of the call asked)."""
    k = chunk.request.options.logprobs
    if k is None:
        return None
    top = tuple((int(i), float(lp)) for i, lp in zip(step.top_ids[b, :k], step.top[b, :k]))
    return TokenLogprobs(token, float(step.chosen[b]), top)
