"""Load a run directory as the draft model of another run's speculative decoding, after checking that the two
share a tokenizer: the same vocabulary size, the same special token ids and the same stop ids (a draft that
tokenises differently would propose ids that mean other text to the target). The model-level checks
(vocab_size, max_context, paradigm) are ``generation.speculative_generate.check_draft``'s.
"""

from __future__ import annotations

import os

from .bundled import resolve_run_dir
from .run_dir import load_run
from .stop_ids import read_stop_ids


def tokenizer_difference(tokenizer, stop_ids, draft_tokenizer, draft_stop_ids) -> str | None:
    """One line naming the first difference between the target's tokenizer / stop ids and the draft's, or None
    when they agree: vocabulary size, then special ids, then stop ids (each listed, at most 8 ids)."""
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        return (f"the draft's vocabulary holds {draft_tokenizer.vocab_size} tokens, the target's "
                f"{tokenizer.vocab_size}")
    for what, ours, theirs in (("special ids", tokenizer.special_ids, draft_tokenizer.special_ids),
                               ("stop ids", set(stop_ids), set(draft_stop_ids))):
        if set(ours) != set(theirs):
            return f"the draft's {what} {sorted(theirs)[:8]} differ from the target's {sorted(ours)[:8]}"
    return None


def load_draft_run(run_dir: str | os.PathLike, tokenizer, stop_ids):
    """The draft model (a Transformer) of ``run_dir`` for a target with ``tokenizer`` and ``stop_ids``.
    Raises RunDirError as ``load_run`` and ValueError naming the draft run and the tokenizer difference."""
    path = resolve_run_dir(run_dir)
    model, _, draft_tokenizer, _ = load_run(path)
    diff = tokenizer_difference(tokenizer, stop_ids, draft_tokenizer, read_stop_ids(path, draft_tokenizer))
    if diff is not None:
        raise ValueError(f"draft run {path} does not share the target's tokenizer: {diff}")
    return model
