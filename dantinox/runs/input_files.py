"""Files a user names (a config, a trace, a gate, a schema, a profile, training text): read as UTF-8 text, YAML
or JSON, with one error line naming the file and what is wrong with it.

Every fault of the class gets the same shape, ``LABEL PATH: REASON``, where LABEL is the flag or argument the
path came from (``--config``, ``--slice rare=``, ``data_path``):

  missing          --config serve.yaml: no such file
  a directory      --config conf: is a directory, not a regular file
  unreadable       --config serve.yaml: cannot read it (Permission denied)
  not UTF-8        --config serve.yaml: not UTF-8 text (byte 0xff at line 1, column 1)
  not YAML / JSON  --config serve.yaml: not valid YAML: expected ',' or ']', but got '<stream end>' (line 2,
                   column 1)

A missing file raises :class:`InputFileNotFound` (a FileNotFoundError too); the other faults raise the
caller's error class (``error``, default :class:`InputFileError`), so a library keeps its own exception types
(DataError, TraceError, GateError, ConfigError). Each raised error carries ``input_file = (path, reason)``:
the command line (``dantinox.cli.entrypoint``) uses it to name the flag that held the path when the library
did not know it. Pipes and process substitutions (``--config <(...)``) are read like files; only directories
are refused before reading.
"""

from __future__ import annotations

import json
import os
from typing import Any, NoReturn


class InputFileError(ValueError):
    """A file the user named cannot be used: the message is ``LABEL PATH: REASON``; ``input_file`` is (path,
    reason)."""


class InputFileNotFound(InputFileError, FileNotFoundError):
    """The file the user named does not exist (an InputFileError and a FileNotFoundError)."""


def where(label: str | None, path: str) -> str:
    """How a message names the file: "--config x.yaml", "--slice rare=x.txt" (a label ending in "="), or the
    path alone without a label."""
    if not label:
        return path
    return f"{label}{path}" if label.endswith("=") else f"{label} {path}"


def fail(error: type[Exception], label: str | None, path: str, reason: str) -> NoReturn:
    """Raise ``error("LABEL PATH: REASON")`` carrying ``input_file = (path, reason)``."""
    err = error(f"{where(label, path)}: {reason}")
    err.input_file = (path, reason)
    raise err


def read_bytes(path: str | os.PathLike, label: str | None = None, error: type[Exception] = InputFileError) -> bytes:
    """The bytes of ``path``. Raises InputFileNotFound (missing), ``error`` (a directory, unreadable)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        fail(error, label, path, "is a directory, not a regular file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        fail(InputFileNotFound, label, path, "no such file")
    except OSError as err:
        fail(error, label, path, f"cannot read it ({err.strerror or type(err).__name__})")


def decode_utf8(raw: bytes, path: str, label: str | None = None, error: type[Exception] = InputFileError) -> str:
    """``raw`` decoded as UTF-8; ``error`` naming the first bad byte and its line and column (1-based, the column
    counted in bytes) otherwise."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        fail(error, label, path, f"not UTF-8 text (byte 0x{raw[err.start]:02x} at line {line}, column {column})")


def read_text(path: str | os.PathLike, label: str | None = None, error: type[Exception] = InputFileError) -> str:
    """The UTF-8 text of ``path`` (see the module docstring for the errors)."""
    path = os.fspath(path)
    return decode_utf8(read_bytes(path, label, error), path, label, error)


def read_yaml(path: str | os.PathLike, label: str | None = None, error: type[Exception] = InputFileError) -> Any:
    """The YAML document in ``path`` (JSON is read too: YAML 1.2 holds it; None for an empty file). Raises as
    :func:`read_text`, and ``error`` "not valid YAML: PROBLEM (line L, column C)"."""
    import yaml

    path = os.fspath(path)
    text = read_text(path, label, error)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        fail(error, label, path, f"not valid YAML: {problem}{at}")


def parse_json(text: str, path: str, label: str | None = None, error: type[Exception] = InputFileError) -> Any:
    """``json.loads(text)``; ``error`` "not valid JSON: MESSAGE (line L, column C)" otherwise."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        fail(error, label, path, f"not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})")


def read_json(path: str | os.PathLike, label: str | None = None, error: type[Exception] = InputFileError) -> Any:
    """The JSON document in ``path``. Raises as :func:`read_text`, and ``error`` for text that is not JSON."""
    path = os.fspath(path)
    return parse_json(read_text(path, label, error), path, label, error)
