"""Where the fields of a JSON object begin and end in text that may still be growing (a tool call being written).

``scan_objects(text)`` reads the top-level ``{...}`` objects of ``text`` (anything between them, such as "[",
",", ";" or whitespace, is skipped) and gives, for each, its top-level keys with the character span of each
value: ``(start, end)`` with ``end`` None while the value is not finished. Every character from a value's start
to the end of the text belongs to that value while it is open, so the raw text of an unfinished value can be
sent as it grows (streamed tool-call arguments) and the finished text is the same characters. The scan checks
no more of JSON than the spans need: the final text is validated with ``json.loads`` by the caller.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

SCALAR = re.compile(r"[^,}\]\s]*")
SPACE = re.compile(r"\s*")


@dataclass
class PartialObject:
    """fields: key -> [value start, value end or None] (character offsets into the scanned text); closed: the
    object's "}" was read; broken: the text stopped looking like an object (a key that is not a string, no ":")."""

    fields: dict = field(default_factory=dict)
    closed: bool = False
    broken: bool = False

    def raw(self, text: str, key: str) -> str | None:
        """The text of ``key``'s value so far (all of it when finished); None when the key has not started."""
        span = self.fields.get(key)
        if span is None:
            return None
        return text[span[0]:span[1] if span[1] is not None else len(text)]

    def done(self, key: str) -> bool:
        span = self.fields.get(key)
        return span is not None and span[1] is not None


def scan_objects(text: str, start: int = 0, limit: int | None = None) -> list[PartialObject]:
    """The top-level objects of ``text[start:]``, in order, the last possibly unfinished; at most ``limit``."""
    objects, i = [], start
    while i < len(text) and (limit is None or len(objects) < limit):
        if text[i] != "{":
            i += 1
            continue
        obj, i = _scan_object(text, i)
        objects.append(obj)
        if not obj.closed:
            break
    return objects


def _scan_object(text: str, i: int) -> tuple[PartialObject, int]:
    """(the object starting at text[i] == "{", the index after it, or len(text) when it is unfinished)."""
    obj, n, j = PartialObject(), len(text), i + 1
    while True:
        j = SPACE.match(text, j).end()
        if j >= n:
            return obj, n
        if text[j] == "}":
            obj.closed = True
            return obj, j + 1
        if text[j] == ",":
            j += 1
            continue
        key_end = _string_end(text, j) if text[j] == '"' else -1
        if key_end is None:
            return obj, n
        colon = SPACE.match(text, key_end).end() if key_end > 0 else -1
        if key_end < 0 or (colon < n and text[colon] != ":"):
            obj.broken = True
            return obj, j + 1
        if colon >= n:
            return obj, n
        value = SPACE.match(text, colon + 1).end()
        if value >= n:
            return obj, n
        span = [value, _value_end(text, value)]
        obj.fields[_key(text[j:key_end])] = span
        if span[1] is None:
            return obj, n
        j = span[1]


def _key(quoted: str) -> str:
    """The key of a finished JSON string (its escapes read); the raw text when they are not valid JSON."""
    try:
        return json.loads(quoted)
    except json.JSONDecodeError:
        return quoted[1:-1]


def _string_end(text: str, i: int) -> int | None:
    """The index after the string starting at text[i] == '"'; None when it is unfinished."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i]; None when it may still grow."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        end = SCALAR.match(text, i).end()
        return end if end < len(text) else None  # a number or literal at the end may go on
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            j = _string_end(text, j)
            if j is None:
                return None
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None
