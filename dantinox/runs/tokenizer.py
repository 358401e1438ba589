"""Text <-> token ids, stored as a standard Hugging Face ``tokenizer.json``.

Two kinds, both exact round trips (``decode(encode(text)) == text``):

- ``"char"``: one token per distinct character (Unicode code point) of the training text, sorted, plus
  ``<unk>`` at id 0. Stored as a ``tokenizers`` WordLevel model whose pre-tokenizer isolates every
  character (spaces and newlines included) and whose decoder (``Fuse``) concatenates tokens with nothing in
  between. Characters outside the vocabulary follow the ``unknown=`` policy of :meth:`TextTokenizer.encode`;
  ``<unk>`` decodes to the literal text ``"<unk>"``.
- ``"bpe"``: byte-level BPE (ByteLevel pre-tokenizer and decoder, the 256 byte symbols always in the
  vocabulary), so every text encodes and nothing is unknown. A token may hold part of a multi-byte
  character; :class:`StreamDecoder` holds such pieces back until the character is complete.

Special tokens (added tokens marked special: an imported model's ``<|im_start|>``, a diffusion run's
``<mask>``) are matched in the text by default, as the ``tokenizers`` library does: the text "<|im_end|>"
encodes to that one id. ``encode(text, special=False)`` turns that off (the library's
``encode_special_tokens``), so the same text encodes as the ordinary characters it is made of; and
:meth:`TextTokenizer.encode_pieces` matches special tokens only in the pieces a caller trusts (a chat
template's own text, not a message's content: case K12).

A long text (GIL_FREE_CHARS characters or more) is encoded through the library's ``encode_batch``, which
releases Python's GIL while the Rust code runs (``encode`` does too in recent releases, not by contract), so a
server thread tokenizing a huge prompt does not stop the event loop; the ids are the same (one text, one
encoding). Nothing here mutates a ``tokenizers.Tokenizer`` after it is built, so threads may encode at once.
"""

from __future__ import annotations

import json
import os

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from .files import atomic_write_bytes

KINDS = ("char", "bpe")
UNK = "<unk>"
MIN_BPE_VOCAB = 256  # the byte alphabet
_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete byte sequence
GIL_FREE_CHARS = 4096  # texts at least this long are encoded with the GIL released (see the module docstring)


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` of kind "char" or "bpe" with an explicit unknown-character policy.

    Attributes:
      kind: "char" or "bpe".
      vocab_size: V, the number of token ids (ids lie in [0, V)).
      unk_id: id of ``<unk>`` for "char" tokenizers; None for "bpe" (nothing is unknown).
      hf: the wrapped ``tokenizers.Tokenizer``.
    """

    def __init__(self, hf: Tokenizer, kind: str):
        if kind not in KINDS:
            raise ValueError(f"tokenizer kind={kind!r} is not allowed: one of {KINDS}")
        self.hf = hf
        self.kind = kind
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.unk_id = hf.token_to_id(UNK) if kind == "char" else None
        if kind == "char" and self.unk_id is None:
            raise ValueError(f"a char tokenizer must hold the token {UNK!r}")
        self._literal: Tokenizer | None = None  # a copy of hf that matches no special token (built on first use)

    @property
    def special_ids(self) -> frozenset:
        """The ids of the added tokens marked special (control tokens such as ``<|im_end|>``)."""
        return frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, unknown: str = "error", special: bool = True) -> list[int]:
        """Token ids of ``text`` (a list of ints in [0, V)); "" encodes to [].

        unknown: policy for characters outside a char vocabulary: "error" raises, "replace" maps each to
          ``<unk>``. Byte-level BPE has no unknown characters, so the policy never applies to it.
        special: match special-token texts ("<|im_end|>" -> its id); False encodes them as ordinary text.
        Raises:
          ValueError: unknown="error" and the text holds unknown characters (names them and their
            positions, 0-based character offsets); an unknown policy name; text not a str; text with a lone
            surrogate (not valid Unicode, ``check_unicode``).
        """
        if unknown not in ("error", "replace"):
            raise ValueError(f"unknown={unknown!r} is not allowed: 'error' or 'replace'")
        if not isinstance(text, str):
            raise ValueError(f"text must be a str; got {type(text).__name__}")
        if not text:
            return []
        ids = _encoding(self.hf if special else self._literal_tokenizer(), text).ids
        if self.kind == "char" and unknown == "error":
            # Char tokens are one per code point, so token index == character offset.
            where = np.flatnonzero(np.asarray(ids, np.int64) == self.unk_id)
            if where.size:
                raise UnknownCharactersError(_unknown_message(text, where))
        return ids

    def encode_pieces(self, pieces, unknown: str = "error") -> list[int]:
        """Token ids of the text ``"".join(text for text, _ in pieces)`` where special tokens are matched only
        in the pieces whose flag is False; text of a piece flagged True (e.g. a chat message's content) always
        encodes as ordinary text, and a special token that reaches into such a piece is not matched either.

        pieces: [(text, literal: bool)]. The ids equal :meth:`encode` of the joined text when no literal piece
        holds a special-token text: the whole text is encoded once to find where the special tokens lie
        (``tokenizers`` offsets), and the text between the trusted ones is encoded with special=False.
        Raises ValueError as :meth:`encode`.
        """
        text, literal, at = "", [], 0
        for piece, is_literal in pieces:
            if is_literal:
                literal.append((at, at + len(piece)))
            text, at = text + piece, at + len(piece)
        if not text:
            return []
        specials = self.special_ids
        ids, done = [], 0
        found = _encoding(self.hf, text)
        for token, (start, end) in zip(found.ids, found.offsets):
            if token in specials and not any(start < b and a < end for a, b in literal):
                ids += self.encode(text[done:start], unknown, special=False) + [token]
                done = end
        return ids + self.encode(text[done:], unknown, special=False)

    def _literal_tokenizer(self) -> Tokenizer:
        if self._literal is None:
            literal = Tokenizer.from_str(self.hf.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal

    def decode(self, ids) -> str:
        """Text of a sequence of token ids (list, tuple or 1-D integer array).

        Raises ValueError if an id lies outside [0, V) (the underlying library would drop it silently).
        """
        ids = [int(i) for i in np.asarray(ids, np.int64).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:10]} lie outside [0, vocab_size={self.vocab_size})")
        return self.hf.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        """The standard ``tokenizer.json`` text (the kind follows from the model type: WordLevel or BPE)."""
        return self.hf.to_str(pretty=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` atomically (temporary file, fsync, rename)."""
        atomic_write_bytes(path, self.to_json().encode("utf-8"))

    @classmethod
    def from_json(cls, text: str) -> "TextTokenizer":
        """Parse a ``tokenizer.json`` string. Raises ValueError if it is not a char/BPE tokenizer file."""
        try:
            kind = _infer_kind(json.loads(text))
            return cls(Tokenizer.from_str(text), kind)
        except ValueError:
            raise
        except Exception as err:  # the Rust library raises plain Exception
            raise ValueError(f"not a valid tokenizer.json: {err}") from err

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TextTokenizer":
        """Read a ``tokenizer.json``. Raises FileNotFoundError, or ValueError naming the file if invalid."""
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            return cls.from_json(text)
        except ValueError as err:
            raise ValueError(f"{os.fspath(path)}: {err}") from err


def check_unicode(text: str, what: str = "text") -> None:
    """ValueError naming ``what`` when ``text`` holds a lone surrogate (U+D800..U+DFFF), which no Unicode
    encoding can write and the tokenizer cannot read: JSON's "\\ud800" escape, or on a command line bytes that
    are not UTF-8, which Python keeps as U+DC80..U+DCFF (the message gives the byte)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        byte = f" (the byte 0x{code - 0xDC00:02x}, not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate U+{code:04X}{byte} at character "
                         f"{err.start}; send UTF-8 text") from None


def _encoding(hf: Tokenizer, text: str):
    """``hf``'s Encoding of ``text`` without added special tokens; the GIL is released for long texts.
    ValueError for a text with a lone surrogate (``check_unicode``)."""
    check_unicode(text)
    if len(text) < GIL_FREE_CHARS:
        return hf.encode(text, add_special_tokens=False)
    return hf.encode_batch([text], add_special_tokens=False)[0]


def _infer_kind(data: dict) -> str:
    model_type = data.get("model", {}).get("type")
    if model_type == "WordLevel":
        return "char"
    if model_type == "BPE":
        return "bpe"
    raise ValueError(f"model type {model_type!r} is neither WordLevel (char) nor BPE")


class UnknownCharactersError(ValueError):
    """Characters outside a char vocabulary. ``detail`` says which and where; the message adds the Python
    remedy (``unknown='replace'``), which the CLI spells ``--unknown replace`` and the HTTP server replaces
    with its own (it has no such option)."""

    def __init__(self, detail: str):
        super().__init__(f"{detail} Pass unknown='replace' to map them to {UNK!r}, or train the tokenizer on "
                         "text that has them.")
        self.detail = detail


def _unknown_message(text: str, where: np.ndarray) -> str:
    shown = ", ".join(f"{text[i]!r} (U+{ord(text[i]):04X}) at {i}" for i in where[:10])
    more = f" and {where.size - 10} more" if where.size > 10 else ""
    distinct = sorted({text[i] for i in where})
    return f"{where.size} character(s) outside the char vocabulary: {shown}{more}; distinct: {distinct}."


def train_tokenizer(text: str, kind: str = "char", vocab_size: int | None = None) -> TextTokenizer:
    """Train a tokenizer on ``text``.

    kind: "char" (vocab_size must be None or equal the number of distinct characters + 1) or "bpe"
      (byte-level BPE; vocab_size, default 1024, must be >= 256 and is an upper bound: a short text may
      yield fewer merges).
    Returns a TextTokenizer. Deterministic for a given text, kind and vocab_size.
    Raises ValueError: empty text, an unknown kind, or a vocab_size that is not allowed.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("cannot train a tokenizer on empty text")
    if kind == "char":
        return _train_char(text, vocab_size)
    if kind == "bpe":
        return _train_bpe(text, 1024 if vocab_size is None else vocab_size)
    raise ValueError(f"tokenizer kind={kind!r} is not allowed: one of {KINDS}")


def _train_char(text: str, vocab_size: int | None) -> TextTokenizer:
    chars = sorted(set(text))
    if vocab_size is not None and vocab_size != len(chars) + 1:
        raise ValueError(f"vocab_size={vocab_size} is not allowed for a char tokenizer of this text: it has "
                         f"{len(chars)} distinct characters, so the vocabulary is {len(chars) + 1} (with "
                         f"{UNK!r}); pass None")
    vocab = {UNK: 0, **{c: i + 1 for i, c in enumerate(chars)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    return TextTokenizer(hf, "char")


def _train_bpe(text: str, vocab_size: int) -> TextTokenizer:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"bpe vocab_size={vocab_size!r} is not allowed: an integer >= {MIN_BPE_VOCAB} "
                         "(the byte alphabet)")
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    hf.train_from_iterator([text], trainer=trainer)
    return TextTokenizer(hf, "bpe")


MASK = "<mask>"


def with_mask_token(tokenizer: TextTokenizer) -> TextTokenizer:
    """The tokenizer with the masked-diffusion MASK token ``<mask>`` appended as its last id (V_old).

    Idempotent: a tokenizer that already holds ``<mask>`` is returned unchanged. The token is a special
    (added) token: the literal text "<mask>" encodes to it, and it decodes to "<mask>".
    """
    if tokenizer.hf.token_to_id(MASK) is not None:
        return tokenizer
    hf = Tokenizer.from_str(tokenizer.hf.to_str())
    hf.add_special_tokens([MASK])
    return TextTokenizer(hf, tokenizer.kind)


class StreamDecoder:
    """Incremental detokenizer: feed token ids one at a time, get text as soon as it is complete.

    ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)``. A byte-level BPE token can end
    in the middle of a multi-byte character; its bytes decode to a trailing U+FFFD, which is never emitted:
    the pending tokens are held back and re-decoded with the next token. Text before the incomplete
    character is emitted at once. ``flush()`` returns whatever is still pending (including U+FFFD for a
    sequence that never completed).
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._pending: list[int] = []  # ids since the last clean character boundary
        self._emitted = 0  # characters of decode(_pending) already returned

    def push(self, token_id: int) -> str:
        """Add one token id; return the newly completed text (maybe ""). Raises ValueError if out of range."""
        self._pending.append(int(token_id))
        text = self.tokenizer.decode(self._pending)
        if text.endswith(_REPLACEMENT):
            stable = len(text.rstrip(_REPLACEMENT))
            out = text[self._emitted:stable]
            self._emitted = max(self._emitted, stable)
            return out
        out = text[self._emitted:]
        self._pending, self._emitted = [], 0
        return out

    def flush(self) -> str:
        """Return the remaining text (an incomplete character decodes to U+FFFD) and reset."""
        text = self.tokenizer.decode(self._pending)[self._emitted:] if self._pending else ""
        self._pending, self._emitted = [], 0
        return text
