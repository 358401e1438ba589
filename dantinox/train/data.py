"""Training data: a UTF-8 text file, split by characters into training and held-out validation text.

The last ``val_fraction`` of the characters is the validation split; each split is encoded on its own
(so no token straddles the boundary). Training batches are random windows of ``seq_len + 1`` tokens drawn
with a seeded ``numpy.random.Generator`` (inputs are a window's first seq_len tokens, targets its last
seq_len). Validation walks the held-out tokens in a fixed order, so every evaluation sees the same windows.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..runs.input_files import fail
from ..runs.input_files import read_text as read_text_file
from ..runs.tokenizer import TextTokenizer

LABEL = "training data file"   # how errors name the file (the command line names --data instead)


class DataError(ValueError):
    """The training text cannot be used (empty, not UTF-8, too short for the requested windows)."""


def read_text(path: str | os.PathLike) -> str:
    """The content of a UTF-8 text file.

    Raises InputFileNotFound (a FileNotFoundError naming the path) if it does not exist, DataError naming it if
    it is a directory or a device, unreadable, not UTF-8 (the byte, its line and column) or empty
    (``dantinox.runs.input_files``; the command line names its --data flag).
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        fail(DataError, LABEL, path, "is not a regular file (a device or a pipe): give a UTF-8 text file")
    text = read_text_file(path, LABEL, DataError)   # the file is hashed after reading, so it is read twice
    if not text:
        fail(DataError, LABEL, path, "the file is empty")
    return text


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def split_text(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """(train_text, val_text): the last ``val_fraction`` of the characters is held out.

    Raises DataError if val_fraction is not in (0, 1) or either part would be empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction!r} is not allowed: a number strictly between 0 and 1")
    cut = len(text) - int(round(len(text) * val_fraction))
    if cut <= 0 or cut >= len(text):
        raise DataError(f"a text of {len(text)} characters is too short to hold out val_fraction="
                        f"{val_fraction} of it")
    return text[:cut], text[cut:]


@dataclass
class TokenData:
    """Encoded splits. train, val: 1-D int32 token ids; val_chars: characters of the validation text."""

    train: np.ndarray
    val: np.ndarray
    val_chars: int

    @classmethod
    def from_text(cls, tokenizer: TextTokenizer, train_text: str, val_text: str, seq_len: int) -> "TokenData":
        """Encode both splits; characters unknown to the tokenizer (seen only in validation) become <unk>.

        Raises DataError naming the split if it has fewer than seq_len + 1 tokens.
        """
        data = cls(np.asarray(tokenizer.encode(train_text, unknown="replace"), np.int32),
                   np.asarray(tokenizer.encode(val_text, unknown="replace"), np.int32), len(val_text))
        for name, ids, text in (("training", data.train, train_text), ("validation", data.val, val_text)):
            if ids.size < seq_len + 1:
                raise DataError(f"the {name} split has {ids.size} tokens ({len(text)} characters); it "
                                f"needs at least seq_len + 1 = {seq_len + 1}. Use a longer text, a smaller "
                                "--seq_len, or a different val_fraction")
        return data

    @property
    def tokens_per_char(self) -> float:
        """Validation tokens per validation character (1.0 for a char tokenizer)."""
        return self.val.size / self.val_chars


def sample_batch(ids: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int) -> np.ndarray:
    """[B, seq_len + 1] int32 windows starting at uniform random offsets of ``ids`` (1-D int32).

    Advances ``rng``. Raises DataError if ids is shorter than seq_len + 1.
    """
    if ids.size < seq_len + 1:
        raise DataError(f"{ids.size} tokens cannot fill a window of seq_len + 1 = {seq_len + 1}")
    starts = rng.integers(0, ids.size - seq_len, size=batch_size)
    return ids[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def val_batches(ids: np.ndarray, batch_size: int, seq_len: int,
                max_batches: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Deterministic validation batches over ``ids`` (1-D int32): yields (windows, weights).

    windows: [B, seq_len + 1] int32, consecutive windows that overlap by one token, so each held-out token
    after the first is a target at most once (a tail shorter than seq_len is not evaluated).
    weights: [B, seq_len] float32, 1 for real targets and 0 for padding (the last batch is padded to B rows
    with token 0 so every batch has the same shape). At most max_batches batches (None: all).
    Raises DataError if ids is shorter than seq_len + 1.
    """
    if ids.size < seq_len + 1:
        raise DataError(f"{ids.size} validation tokens cannot fill a window of seq_len + 1 = {seq_len + 1}")
    starts = np.arange(0, ids.size - seq_len, seq_len)
    n_batches = -(-starts.size // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        chunk = starts[b * batch_size:(b + 1) * batch_size]
        windows = np.zeros((batch_size, seq_len + 1), np.int32)
        weights = np.zeros((batch_size, seq_len), np.float32)
        windows[:chunk.size] = ids[chunk[:, None] + np.arange(seq_len + 1)[None, :]]
        weights[:chunk.size] = 1.0
        yield windows, weights
