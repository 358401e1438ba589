"""Prompt preparation both paradigms share: length buckets, right-padded prompt batches, the capacity check
done before anything runs, and the fixed-shape set of stop ids.

Shape letters: B batch, T prompt bucket, E stop ids (at most MAX_EOS_IDS)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..kv.static import CapacityError

MIN_BUCKET = 16


def bucket_length(n: int, max_context: int) -> int:
    """Smallest power of two >= max(n, 16), capped at max_context (tokens)."""
    bucket = MIN_BUCKET
    while bucket < n:
        bucket *= 2
    return min(bucket, max_context)


def prepare_prompts(prompt_ids, vocab_size: int, max_context: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Right-pad prompts to a bucket. prompt_ids: one prompt (sequence of ints) or a batch (list of sequences
    or a [B, T] array). Returns (ids [B, T_bucket] int32, lengths [B] int32, was_single_prompt).

    Raises ValueError: empty batch, empty prompt, non-integer or out-of-vocabulary ids (row and value named);
    CapacityError: a prompt longer than max_context.
    """
    if isinstance(prompt_ids, (jax.Array, np.ndarray)) and np.ndim(prompt_ids) == 2:
        rows = [list(r) for r in np.asarray(prompt_ids)]
        single = False
    else:
        seq = list(prompt_ids) if not isinstance(prompt_ids, (str, bytes)) else None
        if seq is None:
            raise ValueError("prompt_ids must be token ids (ints), not text: encode the text with the tokenizer")
        single = len(seq) == 0 or np.ndim(seq[0]) == 0
        rows = [seq] if single else [list(r) for r in seq]
    if not rows:
        raise ValueError("prompt_ids is an empty batch: give at least one prompt")
    lengths = np.array([len(r) for r in rows], np.int32)
    for b, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"prompt {b} is empty: a prompt needs at least one token")
        arr = np.asarray(row)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"prompt {b} holds non-integer values (dtype {arr.dtype}); token ids are integers")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"prompt {b} holds token id {int(arr.max() if arr.max() >= vocab_size else arr.min())}"
                             f" outside [0, vocab_size={vocab_size})")
        if len(row) > max_context:
            raise CapacityError(f"prompt {b} has {len(row)} tokens, more than max_context={max_context}")
    ids = np.zeros((len(rows), bucket_length(int(lengths.max()), max_context)), np.int32)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    return ids, lengths, single


def check_request(lengths: np.ndarray, max_new_tokens: int, max_context: int) -> None:
    """Raise ValueError for max_new_tokens < 1 and CapacityError if any prompt_length + max_new_tokens exceeds
    max_context (the message names both numbers and the limit)."""
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is not allowed: an integer >= 1")
    longest = int(lengths.max())
    if longest >= max_context:
        raise CapacityError(
            f"prompt of {longest} tokens is too long: max_context={max_context} holds at most "
            f"{max_context - 1} prompt tokens (leaving room for 1 new token); shorten the prompt")
    if longest + max_new_tokens > max_context:
        raise CapacityError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {longest + max_new_tokens} "
            f"exceeds max_context={max_context}; use at most {max(max_context - longest, 0)} new tokens "
            f"or a shorter prompt")


MAX_EOS_IDS = 8  # stop ids one call may give (a fixed [E] shape, so no id set compiles anything new)


def eos_array(eos_id, vocab_size: int) -> np.ndarray:
    """eos_id (None, one token id, or a sequence of up to MAX_EOS_IDS ids) as [E] int32, padded with -1.

    Raises ValueError naming eos_id when an id is not an integer in [0, vocab_size) or there are too many.
    """
    given = [] if eos_id is None else [eos_id] if np.ndim(eos_id) == 0 else list(eos_id)
    for value in given:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < vocab_size:
            raise ValueError(f"eos_id={eos_id!r} is not allowed: None, a token id in [0, {vocab_size}) or a "
                             f"list of up to {MAX_EOS_IDS} such ids")
    if len(given) > MAX_EOS_IDS:
        raise ValueError(f"eos_id has {len(given)} ids; at most {MAX_EOS_IDS}")
    return np.array([int(v) for v in given] + [-1] * (MAX_EOS_IDS - len(given)), np.int32)


def is_eos(token: jax.Array, eos_id: jax.Array) -> jax.Array:
    """token: [B] int32; eos_id: [] or [E] int32 stop ids (-1 entries match nothing). Returns [B] bool."""
    return jnp.any(token[:, None] == jnp.atleast_1d(eos_id)[None, :], axis=-1)
