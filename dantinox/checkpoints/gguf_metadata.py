"""Typed access to one GGUF file's metadata, every error naming the key (``{arch}.attention.head_count``).

GGUF metadata keys of a model's hyperparameters are prefixed with its architecture name (llama.cpp's GGUF
specification: ``llama.block_count``, ``qwen2.rope.freq_base``, ...); :class:`Metadata` reads them by their
unprefixed names and checks their types.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import GGUFError

_MISSING = object()


class Metadata:
    """The metadata dict of one GGUF file (key -> plain Python value) for architecture ``arch``.

    ``key("attention.head_count")`` is the full key ("llama.attention.head_count"); ``int`` / ``float`` /
    ``get`` read ``{arch}.name`` (``raw=True``: the key as given). Raises GGUFError naming the file and the full
    key for a missing key without a default, or a value of the wrong type or range.
    """

    def __init__(self, meta: dict, arch: str, path: str):
        self.meta, self.arch, self.path = meta, arch, path

    def key(self, name: str, raw: bool = False) -> str:
        """The full key of ``name``."""
        return name if raw else f"{self.arch}.{name}"

    def has(self, name: str, raw: bool = False) -> bool:
        """Whether the file has the key."""
        return self.key(name, raw) in self.meta

    def get(self, name: str, default: Any = None, raw: bool = False) -> Any:
        """The value of the key, or ``default`` when absent."""
        return self.meta.get(self.key(name, raw), default)

    def refuse(self, name: str, value: Any, why: str, raw: bool = False):
        """Raise GGUFError: ``{path}: {key}={value!r} is not supported: {why}``."""
        raise GGUFError(f"{self.path}: {self.key(name, raw)}={value!r} is not supported: {why}")

    def _value(self, name: str, default: Any, raw: bool) -> Any:
        key = self.key(name, raw)
        if key in self.meta:
            return self.meta[key]
        if default is _MISSING:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return default

    def int(self, name: str, default: Any = _MISSING, minimum: int = 1, raw: bool = False) -> int:
        """An integer >= minimum (per-layer arrays are refused: one value for every layer is required)."""
        value = self._value(name, default, raw)
        if isinstance(value, list):
            self.refuse(name, value, "one value for every layer (per-layer values are not supported)", raw)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.refuse(name, value, f"an integer >= {minimum}", raw)
        return value

    def float(self, name: str, default: Any = _MISSING, raw: bool = False) -> float:
        """A finite positive number. A float32 value (GGUF stores most floats so) is given as the shortest
        decimal that rounds to it (1e-05, not 9.999999747378752e-06): the number its Hugging Face config holds."""
        value = self._value(name, default, raw)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            self.refuse(name, value, "a positive number", raw)
        single = np.float32(value)
        return float(str(single)) if float(single) == value else float(value)
