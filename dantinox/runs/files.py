"""Files written so that a crash or Ctrl-C leaves the old content or the new, never half of either:
write a temporary file in the same directory, fsync it, rename it over the target, fsync the directory.
Every command that writes a run directory, a checkpoint, a profile or a plan uses these."""

from __future__ import annotations

import json
import os
import secrets
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of ``data``.

    A temporary file in the same directory is written, flushed and fsync'ed, then renamed over ``path``
    with ``os.replace``; on any error the temporary file is removed and the error re-raised.
    Raises OSError from the file system.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform / file system
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """``atomic_write_bytes`` of ``obj`` as indented UTF-8 JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
