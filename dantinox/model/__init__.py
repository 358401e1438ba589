"""The forward and its cache: token ids (+ a static KV cache) -> logits (+ the cache, updated).

  transformer.py   Transformer, build_model: embedding, blocks, final norm, tied output
  attention.py     MHA / GQA / MQA over the static cache (one implementation; K KV heads)
  mla.py           multi-head latent attention over a compressed latent cache (DeepSeek-V2)
  cache.py         the cache pytree: LayerKV / LatentKV (and their int8 forms), init_cache, byte counts
  layers.py        RMSNorm, the gated MLP (SwiGLU / GeGLU), rotary position embeddings
"""

from ..kv.static import CapacityError, KVCache, LatentKV, LayerKV, QuantLatentKV, QuantLayerKV, cache_nbytes
from ..kv.sizes import bytes_per_token_per_layer, sink_bytes_per_layer
from ..kv.cache import init_cache
from .mla import MLAttention
from .transformer import Transformer, build_model

__all__ = ["CapacityError", "KVCache", "LatentKV", "LayerKV", "MLAttention", "QuantLatentKV", "QuantLayerKV",
           "Transformer", "build_model", "bytes_per_token_per_layer", "cache_nbytes", "init_cache",
           "sink_bytes_per_layer"]
