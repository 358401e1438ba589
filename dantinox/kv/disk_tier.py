"""The disk tier: prefix-cache blocks in files, one per block, found again after a restart.

Layout on disk: ``DIR/<layout key>/`` (``dantinox.kv.tier_block.TierLayout.key``: one folder per model and
cache layout, with the layout itself in ``layout.json``), and in it ``<prefix hash hex>.kvb``, one record of
``dantinox.kv.block_file`` per block: the header names the layout and the hash, the checksum covers the
whole file. A restarted server with the same DIR, model and layout reads the folder's names (not their
contents) into its index, least recently used first by modification time, and removes the temporary files a
killed writer left.

Writes go through one background thread (``put`` queues a block and returns; the step does not wait for the
disk), each atomic (``block_file.write_record``: temporary file and rename). A block waiting in the queue is
found by lookups all the same; a process that ends waits for the queue (at most EXIT_WAIT_S), and one that is
killed loses only the blocks still queued (computed again later). Reads happen on the caller's thread when the
prefix cache looks a block up (``get``): the file is read and verified whole; a damaged one (cut short,
checksum or header wrong, arrays not the layout's) is refused with one warning naming it, removed, and
reported as a miss, so its tokens are computed again, never read wrong. The first write that fails (disk full,
directory no longer writable) turns the tier off with one warning: lookups miss from then on and requests
carry on without it.

The folder holds at most ``capacity`` bytes of block files (least recently used removed first); a lookup
touches its file's modification time, so the order survives a restart.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict

from .block_file import TEMP_SUFFIX, DamagedRecord, read_record, write_record
from .tier_block import TierBlock, TierLayout

log = logging.getLogger("dantinox.kv")

SUFFIX = ".kvb"
LAYOUT_FILE = "layout.json"


def check_directory(path: str) -> str | None:
    """None when ``path`` is (or can be made) a directory this process can write (a probe file is written and
    removed), else the reason in words."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe.{os.getpid()}{TEMP_SUFFIX}")
        with open(probe, "wb") as f:
            f.write(b"dantinox")
        os.remove(probe)
    except OSError as err:
        return str(err.strerror or err)
    return None


class DiskTier:
    """Block files under ``directory`` for one layout, at most ``capacity`` bytes (module docstring).

    Raises ValueError naming kv_disk_dir when the directory cannot be made or written (a probe file is
    written and removed), kv_disk_bytes when the capacity holds not one block.
    Counters: hits, stores, evictions, refused (damaged files removed); ``bytes`` the bytes of block files.
    """

    name = "disk"

    def __init__(self, directory: str, capacity: int, layout: TierLayout):
        block_bytes = layout.block_bytes(first=True)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < block_bytes:
            raise ValueError(f"kv_disk_bytes={capacity!r} holds no block: one block file takes about "
                             f"{block_bytes} bytes ({block_bytes / 2**20:.2f} MiB) for this model and block size")
        self.directory, self.capacity, self.layout = directory, capacity, layout
        self.folder = os.path.join(directory, layout.key)
        self._open_folder()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = self._scan()
        self.bytes = sum(self._index.values())
        self.enabled = True
        self.hits = self.stores = self.evictions = self.refused = 0
        self._waiting: dict[bytes, TierBlock] = {}
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="dantinox-kv-disk", daemon=True)
        self._thread.start()
        atexit.register(_finish_writes, weakref.ref(self))
        with self._lock:
            self._trim()

    # Opening ----------------------------------------------------------------------------------------------
    def _open_folder(self) -> None:
        """Make the layout's folder, record its layout, check it can be written."""
        problem = check_directory(self.folder)
        if problem is None:
            layout_path = os.path.join(self.folder, LAYOUT_FILE)
            try:
                if not os.path.exists(layout_path):   # for people reading the folder; records carry the key
                    tmp = f"{layout_path}.{os.getpid()}{TEMP_SUFFIX}"
                    with open(tmp, "w") as f:
                        json.dump(self.layout.as_dict(), f, indent=1)
                    os.replace(tmp, layout_path)
            except OSError as err:
                problem = str(err.strerror or err)
        if problem is not None:
            raise ValueError(f"kv_disk_dir={self.directory!r} is not a writable directory ({problem}): give a "
                             "directory this process can create and write")

    def _scan(self) -> OrderedDict:
        """{hash: file bytes} of the folder's block files, oldest modification first; stale temporary files
        (a writer killed mid-write) are removed."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(TEMP_SUFFIX):
                _remove(entry.path)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(entry.name[:-len(SUFFIX)])
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        return OrderedDict((h, size) for _, h, size in sorted(found))

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.folder, block_hash.hex() + SUFFIX)

    def __len__(self) -> int:
        return len(self._index)

    # Lookups ----------------------------------------------------------------------------------------------
    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return self.enabled and (block_hash in self._index or block_hash in self._waiting)

    def get(self, block_hash: bytes) -> TierBlock | None:
        """The block stored under ``block_hash``, read and verified, or None (not stored, the tier off, or a
        damaged file: refused, removed, one warning)."""
        with self._lock:
            if not self.enabled:
                return None
            waiting = self._waiting.get(block_hash)
            if waiting is None and block_hash not in self._index:
                return None
            if waiting is None:
                self._index.move_to_end(block_hash)
        if waiting is not None:
            self.hits += 1
            return waiting
        path = self._path(block_hash)
        try:
            block = self._read(path, block_hash)
            os.utime(path)
        except OSError as err:   # gone or unreadable: a miss, recomputed
            self._forget(block_hash, remove=False)
            log.warning("KV disk tier: %s cannot be read (%s): its tokens are computed again", path,
                        err.strerror or err)
            return None
        except DamagedRecord as err:
            self._forget(block_hash, remove=True)
            self.refused += 1
            log.warning("KV disk tier: refused %s; removed, its tokens are computed again", err)
            return None
        self.hits += 1
        return block

    def _read(self, path: str, block_hash: bytes) -> TierBlock:
        """The block in ``path``; DamagedRecord naming it when it is not a whole block of this layout."""
        header, arrays = read_record(path)
        if header.get("kind") != "kv-block" or header.get("layout") != self.layout.key:
            raise DamagedRecord(f"{path}: not a block of this layout ({header.get('kind')}, "
                                f"{header.get('layout')})")
        if header.get("hash") != block_hash.hex():
            raise DamagedRecord(f"{path}: holds the block {header.get('hash')}, not the one its name says")
        try:
            return TierBlock.from_arrays(self.layout, arrays)
        except ValueError as err:
            raise DamagedRecord(f"{path}: {err}") from None

    def _forget(self, block_hash: bytes, remove: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.bytes -= size
        if remove:
            _remove(self._path(block_hash))

    # Stores -----------------------------------------------------------------------------------------------
    def put(self, block_hash: bytes, block: TierBlock) -> None:
        """Queue ``block`` for writing (nothing when stored or queued already, or the tier is off)."""
        with self._lock:
            if not self.enabled or block_hash in self._index or block_hash in self._waiting:
                return
            self._waiting[block_hash] = block
        self._queue.put(block_hash)

    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            try:
                if block_hash is None:
                    return
                self._write(block_hash)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes) -> None:
        with self._lock:
            block = self._waiting.get(block_hash)
        if block is None:
            return
        header = dict(kind="kv-block", layout=self.layout.key, hash=block_hash.hex())
        try:
            size = write_record(self._path(block_hash), header, block.arrays())
        except OSError as err:
            self._turn_off(err)
            return
        with self._lock:
            self._waiting.pop(block_hash, None)
            if self.enabled and block_hash not in self._index:
                self._index[block_hash] = size
                self.bytes += size
                self.stores += 1
                self._trim()

    def _trim(self) -> None:
        """Remove least recently used block files until the bytes fit the capacity (lock held)."""
        while self.bytes > self.capacity and self._index:
            block_hash, size = self._index.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
            _remove(self._path(block_hash))

    def _turn_off(self, err: OSError) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self._waiting.clear()
        log.warning("KV disk tier off: cannot write to %s (%s); serving continues without it (restart with "
                    "space or another --kv-disk-dir to have it back)", self.folder, err.strerror or err)

    def flush(self) -> None:
        """Wait until every queued block is written (tests; a server shutting down)."""
        self._queue.join()

    def stats(self) -> dict:
        with self._lock:
            return dict(blocks=len(self._index), bytes=self.bytes, capacity_bytes=self.capacity, hits=self.hits,
                        stores=self.stores, evictions=self.evictions, refused=self.refused,
                        queued=len(self._waiting), enabled=self.enabled)


EXIT_WAIT_S = 30   # at most this long a process ending waits for the disk tier's queued writes


def _finish_writes(ref) -> None:
    """At exit: let the writer thread finish the queued blocks (at most EXIT_WAIT_S), so a server stopped
    right after answering still leaves its prefixes on disk."""
    tier = ref()
    if tier is None or not tier._waiting:
        return
    deadline = time.monotonic() + EXIT_WAIT_S
    while tier._waiting and tier.enabled and time.monotonic() < deadline:
        time.sleep(0.01)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
