"""A memory size given on a command line (--device-memory, --kv-memory, --max-request-bytes, a config file's
key): parsed by ``dantinox.budget.memory.parse_memory_size``, refused with one message that names the flag, the
value as typed and what is allowed, e.g.

  --device-memory -1GB is not allowed: the size is negative; allowed: a positive number with an optional unit
  (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 40GB
  --kv-memory 2G is not allowed: unit 'G' is ambiguous; write GB (powers of 1000) or GiB (powers of 1024)
"""

from __future__ import annotations

from .memory import parse_memory_size


def parse_size_flag(flag: str, text) -> int:
    """Bytes (int >= 1) of the memory size ``text`` given with ``flag``. Raises ValueError "FLAG VALUE is not
    allowed: REASON" for anything ``parse_memory_size`` refuses (no number, zero, negative, above 2^60 bytes,
    an unknown or ambiguous unit)."""
    try:
        return parse_memory_size(text)
    except ValueError as err:
        reason = str(err)
    for prefix in (f"memory size {text!r} is not allowed: ", f"memory size {text!r}: ", f"memory size {text!r} "):
        if reason.startswith(prefix):
            reason = reason[len(prefix):]
            break
    if isinstance(text, str) and text.strip().startswith("-"):
        reason = f"the size is negative; allowed: {reason}"
    shown = text if isinstance(text, str) and text and text.strip() == text else repr(text)
    raise ValueError(f"{flag} {shown} is not allowed: {reason}") from None
