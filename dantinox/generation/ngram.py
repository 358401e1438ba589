"""N-gram (prompt lookup) proposals for speculative decoding, computed inside the compiled loop.

For each row, the last n tokens of its sequence (prompt + generated so far) are looked up earlier in the same
sequence, for n from ``ngram_max`` down to ``ngram_min``; at the largest n with a match, the latest earlier
occurrence wins and the k tokens that followed it are the proposal (Saxena 2023, "Prompt Lookup Decoding";
vLLM's ``ngram`` speculator works the same way). No extra weights: the sequence buffer is all it reads.
A row with no match proposes nothing (``found`` False); the caller then decodes one token plainly.

Shapes: B batch, S sequence slots (max_context), k proposed tokens (static).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def propose_ngram(seq: jax.Array, last: jax.Array, k: int, ngram_max: int, ngram_min: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
    """Proposals from prompt lookup.

    seq: [B, S] int32 tokens, valid at positions 0..last[b]; last: [B] int32 position of each row's newest
    token. k, ngram_max, ngram_min: static ints (1 <= ngram_min <= ngram_max). Returns (proposals [B, k]
    int32: the k tokens after the match, clipped to the sequence's valid part, repeated last token where
    the match is too close to the end; found [B] bool).
    """
    B, S = seq.shape
    pos = jnp.arange(S)[None, :]                                         # candidate match ends e
    rows = jnp.arange(B)[:, None]
    best_end = jnp.full((B,), -1, jnp.int32)
    match = jnp.ones((B, S), bool)
    for i in range(ngram_max):                                          # match[e]: seq[e-j] == seq[last-j], j <= i
        tail = seq[rows[:, 0], jnp.maximum(last - i, 0)][:, None]       # [B, 1]
        earlier = jnp.take_along_axis(seq, jnp.maximum(pos - i, 0), axis=1)
        match = match & (earlier == tail) & (pos - i >= 0)
        n = i + 1
        if n >= ngram_min:
            ok = match & (pos < last[:, None]) & (last[:, None] - i >= 0)
            end = jnp.max(jnp.where(ok, pos, -1), axis=1).astype(jnp.int32)   # the latest match of length n
            best_end = jnp.where(end >= 0, end, best_end)               # longer n found later overrides
    found = best_end >= 0
    take = best_end[:, None] + 1 + jnp.arange(k)[None, :]              # [B, k]
    valid = take <= last[:, None]
    proposals = jnp.take_along_axis(seq, jnp.clip(take, 0, S - 1), axis=1)
    newest = seq[rows[:, 0], last][:, None]
    return jnp.where(valid, proposals, newest).astype(jnp.int32), found
