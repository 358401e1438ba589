"""The file format of the disk tier's blocks and of saved sessions: a JSON header, raw arrays, a checksum.

One file holds one record:

    8 bytes   magic b"DTXKV01\\n"
    4 bytes   header length H, little-endian unsigned
    H bytes   the header, UTF-8 JSON: what the record is (its kind, the cache layout it was written under, the
              block hash or the session's tokens) and ``arrays``: [[shape, dtype], ...] of the payload
    payload   every array's bytes, C order, in the header's order
    32 bytes  BLAKE2b-256 of everything before it

``write_record`` writes a temporary file in the same directory and renames it over the target (``os.replace``,
atomic on POSIX), so a process killed mid-write leaves the old file or none under the name, plus at most a
temporary file that the disk tier removes when it opens the directory again. The checksum covers the case
rename atomicity does not (a file cut short by a full disk after the rename on a machine crash, a flipped
bit): ``read_record`` verifies magic, lengths and checksum before it returns anything and raises
``DamagedRecord`` otherwise, so a damaged file is never read as keys and values. (No fsync: the disk tier is a
cache, and a record lost to a machine crash is recomputed; a record that survives is whole or refused.)
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct

import numpy as np

MAGIC = b"DTXKV01\n"
DIGEST_BYTES = 32
TEMP_SUFFIX = ".tmp"


class DamagedRecord(ValueError):
    """A record file that cannot be trusted: cut short, a wrong magic or checksum, an unreadable header, or
    arrays that are not what the header says. The message names the file and what is wrong."""


def encode_record(header: dict, arrays: list[np.ndarray]) -> bytes:
    """The bytes of one record (module docstring). header: a JSON-serializable dict (its ``arrays`` entry is
    set here from ``arrays``); arrays: numpy arrays of any shape and dtype."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = dict(header, arrays=[[list(a.shape), a.dtype.str] for a in arrays])
    text = json.dumps(head, sort_keys=True, separators=(",", ":")).encode("utf-8")
    body = b"".join([MAGIC, struct.pack("<I", len(text)), text] + [a.tobytes() for a in arrays])
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def write_record(path: str, header: dict, arrays: list[np.ndarray]) -> int:
    """Write one record to ``path`` atomically (a temporary file renamed over it). Returns the bytes written.
    Raises OSError from the file system (the temporary file is removed first)."""
    data = encode_record(header, arrays)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return len(data)


def decode_record(data: bytes, name: str) -> tuple[dict, list[np.ndarray]]:
    """(header, arrays) of a record's bytes; DamagedRecord naming ``name`` when they are not a whole record."""
    fixed = len(MAGIC) + 4
    if len(data) < fixed + DIGEST_BYTES or not data.startswith(MAGIC):
        raise DamagedRecord(f"{name}: not a dantinox KV record (wrong magic or {len(data)} bytes)")
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        raise DamagedRecord(f"{name}: checksum mismatch ({len(data)} bytes): the file was cut short or changed")
    (length,) = struct.unpack("<I", body[len(MAGIC):fixed])
    try:
        header = json.loads(body[fixed:fixed + length].decode("utf-8"))
        specs = [(tuple(int(n) for n in shape), np.dtype(dtype)) for shape, dtype in header["arrays"]]
    except (ValueError, KeyError, TypeError) as err:
        raise DamagedRecord(f"{name}: unreadable header ({err})") from None
    arrays, offset = [], fixed + length
    for shape, dtype in specs:
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset + size > len(body):
            raise DamagedRecord(f"{name}: the payload is shorter than its header says")
        arrays.append(np.frombuffer(body, dtype, int(np.prod(shape, dtype=np.int64)), offset).reshape(shape))
        offset += size
    if offset != len(body):
        raise DamagedRecord(f"{name}: {len(body) - offset} bytes beyond the arrays its header lists")
    return header, arrays


def read_record(path: str) -> tuple[dict, list[np.ndarray]]:
    """(header, arrays) of the record in ``path`` (arrays read-only views of one buffer). Raises OSError from
    the file system, DamagedRecord naming the file when it is not a whole record."""
    with open(path, "rb") as f:
        data = f.read()
    return decode_record(data, path)
