"""Numerics of the quantized weights (the KV cache's codecs live in ``dantinox.kv``) and the cache dtype setting.

  weights.py        bf16 weights and weight-only int8 (one scale per output channel), float32 accumulation
  kv_dtype.py       ``--kv-dtype``: the cache dtype of a loaded model
  block_formats.py  GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K, IQ4_XS): layouts,
                    exact dequantization
  block_kernel.py   x . W^T with W in blocks: the compiled XLA FFI kernel (csrc/) or the pure-JAX path
  block_linear.py   BlockLinear / BlockEmbed, the modules of an imported GGUF's block weights, and their layout
"""

from .block_formats import BLOCK_FORMATS, BlockMatrix
from .block_kernel import block_matmul, kernel_status
from .block_linear import apply_block_layout, block_layout, describe_blocks
from .kv_dtype import KVDtypeError, parse_kv_dtype, with_kv_dtype
from .weights import check_quantize, quantize_weights, weights_setting

__all__ = ["BLOCK_FORMATS", "BlockMatrix", "KVDtypeError", "apply_block_layout", "block_layout", "block_matmul",
           "check_quantize", "describe_blocks", "kernel_status", "parse_kv_dtype",
           "quantize_weights", "weights_setting", "with_kv_dtype"]
