"""A SentencePiece tokenizer from GGUF metadata (``tokenizer.ggml.model = llama``) as a ``tokenizers`` BPE.

llama.cpp's converter stores a SentencePiece model (Llama 2, Mistral 7B v0.1, TinyLlama, Phi-3, Gemma 3) as
its pieces, not as merges:
  tokenizer.ggml.tokens            the pieces, id i at index i; "▁" (U+2581) stands for a space
  tokenizer.ggml.scores            float per piece; for SentencePiece's BPE models the merge priority
  tokenizer.ggml.token_type        1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte (<0x0A>)
  tokenizer.ggml.add_space_prefix  whether a "▁" is put before the text (default true; Gemma: false)
  tokenizer.ggml.unknown_token_id  the <unk> piece

SentencePiece's BPE encoding (Kudo and Richardson 2018, "SentencePiece", and its ``bpe_model``): replace
spaces by "▁" (after the optional prefix), split into characters, then repeatedly merge the adjacent pair whose
concatenation is a piece with the highest score; a character outside the vocabulary becomes the byte pieces
of its UTF-8 encoding (byte fallback). A ``tokenizers`` BPE model computes the same when its merge list holds
every split (left, right) of every normal piece whose two halves are pieces themselves, ranked by the merged
piece's score (highest first; ties by the merged piece's id, then the left half's): the merge it applies next
is the one whose result scores highest. Byte fallback is the model's ``byte_fallback``. The normalizer adds the
prefix and replaces spaces (a leading space becomes "▁▁", as SentencePiece does); the decoder turns "▁" back
into spaces, byte pieces into bytes, and drops the prefix. Control pieces (<s>, </s>) become special added
tokens (one id each when a chat template writes them), user-defined pieces ordinary added tokens, both matched
whole in the raw text; each stretch of text between them is normalized on its own and so gets its own prefix,
as llama.cpp's tokenizer (and transformers' legacy Llama tokenizer) does: the text after such a piece decodes
with one more leading space than it had.
Checked against the ids the models' own Hugging Face tokenizers give for llama.cpp's tokenizer test texts
(Llama 2 and Phi-3 vocabularies, tests/checkpoints/test_gguf_tokenizers.py, slow tier).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from .errors import CheckpointError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


class SentencePieceError(CheckpointError):
    """SentencePiece metadata that is missing or inconsistent (the key is named)."""


def _merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) split of every normal piece whose halves are normal pieces, ranked by the merged
    piece's score (highest first), then its id, then the left half's id."""
    ids = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL:
            ids.setdefault(token, i)
    ranked = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _checked_lists(meta: dict) -> tuple[list[str], list[float], list[int]]:
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise SentencePieceError("tokenizer.ggml.tokens is missing or empty")
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise SentencePieceError(f"tokenizer.ggml.scores has {len(scores or [])} entries for {len(tokens)} tokens "
                                 "(a SentencePiece tokenizer needs one score per token)")
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise SentencePieceError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return tokens, [float(s) for s in scores], [int(t) for t in types]


def sentencepiece_tokenizer(meta: dict) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` (BPE with byte fallback, V = len(tokens) ids) of a GGUF file's SentencePiece
    metadata (module docstring). Raises SentencePieceError naming the key: no tokens, scores or token types of
    another length, an unknown_token_id outside the vocabulary."""
    tokens, scores, types = _checked_lists(meta)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is not None and not (isinstance(unk_id, int) and 0 <= unk_id < len(tokens)):
        raise SentencePieceError(f"tokenizer.ggml.unknown_token_id={unk_id!r} is not an id of the "
                                 f"{len(tokens)} tokens")
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk = tokens[unk_id] if unk_id is not None else None
    hf = Tokenizer(models.BPE(vocab=vocab, merges=_merges(tokens, scores, types), unk_token=unk, fuse_unk=True,
                              byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    hf.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else [])
                                         + [normalizers.Replace(" ", SPACE)])
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                   + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, kind in zip(tokens, types) if kind == CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return hf
