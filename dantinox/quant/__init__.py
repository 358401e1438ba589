"""Numerics of the quantized path: the int8 rows of the KV cache, low-precision weights, the cache dtype.

  kv_rows.py    symmetric absmax int8 per cache row (one float32 scale per token and KV head)
  kv_sinks.py   the int8 cache's attention sinks: the first tokens of each sequence also kept in float32
  weights.py    bf16 weights and weight-only int8 (one scale per output channel), float32 accumulation
  kv_dtype.py   ``--kv-dtype``: the cache dtype of a loaded model
"""

from .kv_dtype import KVDtypeError, parse_kv_dtype, with_kv_dtype
from .kv_rows import dequantize_rows, quantize_rows
from .weights import check_quantize, quantize_weights, weights_setting

__all__ = ["KVDtypeError", "check_quantize", "dequantize_rows", "parse_kv_dtype", "quantize_rows",
           "quantize_weights", "weights_setting", "with_kv_dtype"]
