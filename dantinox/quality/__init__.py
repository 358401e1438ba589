"""Is the output right: the cache proved exact, and the quality of a variant measured per data slice.

  verify.py           cached logits against uncached logits at every generated position
  int8_reference.py   verify's reference for the int8 cache (its rounding-boundary flips adopted)
  slices.py           per-slice quality of a variant through the cache path under test (``dantinox eval``)
  gate.py             per-slice thresholds from a YAML file, checked against the measured quality
"""

from .gate import GateError, check_gate, gate_passes, load_gate
from .slices import SliceQuality, slice_quality
from .verify import VerifyReport, verify_cache

__all__ = ["GateError", "SliceQuality", "VerifyReport", "check_gate", "gate_passes", "load_gate",
           "slice_quality", "verify_cache"]
