"""A provable lower bound on a text's token count from its length in characters, without tokenizing it.

If no token of a tokenizer can stand for more than C characters of the text, a text of N characters needs at
least ceil(N / C) tokens (:func:`fewest_tokens`). The server uses it to refuse a prompt that is obviously over
the context before spending seconds tokenizing it (``dantinox.serving.request_limits``).

:func:`max_chars_per_token` finds C from the ``tokenizer.json`` pipeline, and only where the pipeline lets it
be proved (otherwise it returns None and nothing is refused early):
  - no normalizer, or one made only of ``Prepend`` and of ``Replace`` of a literal string by one at least as
    long (the SentencePiece-style " " -> "▁"): the text the model splits is then at least as long as the
    text sent, never shorter (NFC / NFKC, which can merge characters, and any stripping have no bound here);
  - a pre-tokenizer that drops nothing (``ByteLevel``, ``Digits``, ``Metaspace``, ``Split`` / ``Punctuation``
    with any behaviour but "Removed", and sequences of them; not ``Whitespace`` / ``WhitespaceSplit`` /
    ``BertPreTokenizer``, which drop the spaces);
  - a BPE model: a token's vocabulary string is what it covers of the split text (plus a subword prefix or a
    word suffix, which only lengthen it), or, under ``ByteLevel``, one symbol per byte, and a character has
    at least one byte; so a token covers at most len(its string) characters. Every character must reach a
    token: under ``ByteLevel`` all 256 byte symbols are in the vocabulary; otherwise byte fallback with all
    256 ``<0xNN>`` tokens, or an unknown token that is not fused (a fused one swallows a run of unknown
    characters of any length);
  - a WordLevel model under dantinox's char pre-tokenizer (every character alone, ``dantinox.runs.tokenizer``):
    each token covers one character;
  - added tokens cover their own text (C is at least the longest); one that strips the spaces beside it
    (``lstrip`` / ``rstrip``) can cover any number of them, so there is no bound.
Encoding with special-token matching off, or in pieces (``TextTokenizer.encode_pieces``), keeps the bound:
each piece's tokens cover that piece's characters.
"""

from __future__ import annotations

import json
import math

from tokenizers import pre_tokenizers

_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "Split", "Punctuation"}
_CHAR_SPLIT = {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False}


def fewest_tokens(num_chars: int, max_chars: int) -> int:
    """ceil(num_chars / max_chars): the fewest tokens a text of num_chars characters can encode to when no
    token covers more than max_chars (>= 1) characters."""
    return math.ceil(num_chars / max_chars)


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text any single token of ``tokenizer`` (a dantinox TextTokenizer, or a
    ``tokenizers.Tokenizer``) can stand for, or None when its pipeline allows no such bound (see the module
    docstring). Reads the whole vocabulary once (about 50 ms for 50,000 tokens)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    spec = json.loads(hf.to_str())
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    if not _keeps_length(spec.get("normalizer")):
        return None
    longest_added = max((len(t.get("content", "")) for t in added), default=1)
    regular = _model_bound(spec.get("model") or {}, spec.get("pre_tokenizer"))
    return None if regular is None else max(regular, longest_added, 1)


def _model_bound(model: dict, pre_tokenizer) -> int | None:
    kind = model.get("type")
    if kind == "WordLevel":
        return 1 if pre_tokenizer == _CHAR_SPLIT else None
    if kind != "BPE" or not _drops_nothing(pre_tokenizer):
        return None
    vocab = model.get("vocab") or {}
    if _has(pre_tokenizer, "ByteLevel"):
        if not set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab):
            return None
    elif not (model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))):
        if model.get("unk_token") is None or model.get("fuse_unk"):
            return None
    return max((len(token) for token in vocab), default=1)


def _keeps_length(normalizer) -> bool:
    """True when the normalizer never makes a text shorter (None, Prepend, Replace of a literal string by one
    at least as long, or a sequence of those)."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_length(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        return "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"]) > 0
    return False


def _drops_nothing(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_drops_nothing(p) for p in pre_tokenizer.get("pretokenizers", []))
    return kind in _LOSSLESS_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _has(pre_tokenizer, kind: str) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has(p, kind) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == kind
