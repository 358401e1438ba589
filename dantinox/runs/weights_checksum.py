"""The weights' checksum: SHA-256 of model.safetensors, recorded when a run directory is written and checked
when it is loaded, so a damaged file (truncated by a full disk or an interrupted copy, a flipped bit) is refused
naming the file instead of loading as weights that give wrong answers.

The writer (``save_run``, the importer) hashes the bytes it is about to write and records the hex digest in
model_summary.json under ``weights_sha256``, after the weights file is in place (both writes atomic), so the
figure is the one ``sha256sum model.safetensors`` prints. ``load_run`` hashes the file in a background thread
while it reads the config, the tokenizer and the tensors (hashlib releases the GIL on large buffers, so the
hash runs beside the loading on a second core), and compares at the end: a mismatch raises RunDirError, one
line naming the file and both digests. A run directory without the key (written before it existed) loads
unchecked. ``DANTINOX_VERIFY_WEIGHTS=0`` in the environment skips the check (``load_run(verify=False)`` too).

Cost (docs/reference/run-directory.md): SHA-256 reads the file at 0.5-0.8 GB/s on a 2-core CPU host, about
0.2 s for SmolLM2-135M's 97 MB GGUF-block run (hidden behind the loading) and 1.1 s for a 538 MB float32 one
(+0.9 s on a 1.8 s load, the host loaded).
"""

from __future__ import annotations

import hashlib
import os
import threading

KEY = "weights_sha256"          # the model_summary.json entry
ENV = "DANTINOX_VERIFY_WEIGHTS"  # "0" / "false" / "no" / "off": do not check


def sha256_hex(data: bytes) -> str:
    """Hex SHA-256 of ``data`` (the bytes a writer is about to put in model.safetensors)."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str) -> str:
    """Hex SHA-256 of the file at ``path``, read in pieces. OSError from the file system."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_enabled() -> bool:
    """False when the environment variable DANTINOX_VERIFY_WEIGHTS says 0, false, no or off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class WeightsCheck:
    """The SHA-256 of one weights file, computed in a daemon thread from construction on; ``mismatch()`` waits
    for it and returns the message of a damaged file, or None when the digest is the expected one.

    path: the model.safetensors file; expected: the recorded hex digest."""

    def __init__(self, path: str, expected: str) -> None:
        self.path, self.expected = path, expected
        self._digest: str | None = None
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="weights-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._digest = file_sha256(self.path)
        except OSError as err:
            self._error = err

    def mismatch(self) -> str | None:
        """None if the file's digest is the expected one; else "PATH: damaged ..." (one line)."""
        self._thread.join()
        if self._error is not None:
            return f"{self.path}: cannot read it to check its sha256 ({self._error.strerror or self._error})"
        if self._digest == self.expected:
            return None
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        return (f"{self.path}: damaged: its sha256 is {self._digest}, not the {self.expected} recorded in "
                f"model_summary.json when the run was saved ({size:,} bytes now; truncated, changed or replaced "
                f"since): restore the file, or set {ENV}=0 to load it anyway")
