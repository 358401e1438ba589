"""The KV cache: per-layer cache specs, their codecs, the static cache and the paged pool, one place for bytes.

  spec.py            LayerSpec: a layer's kind (full / sliding window / latent), codec and sizes; its shapes,
                     bytes and attend-and-write for both storage forms; layer_specs(cfg), one per layer
  codec.py           the Codec interface and its Field list (what a layer stores; bytes derive from it)
  float_codec.py     float32 / bfloat16 rows
  int8_codec.py      int8 rows with float32 scales and attention sinks
  channel_codec.py   per-channel int8 keys (KIVI) with a float32 residual ring
  sizes.py           the bytes of a model's cache, summed over its layer specs (the only byte formulas)
  cache.py           init_cache: the whole static cache, allocated up front
  static.py          the static layer types (LayerKV, LatentKV, QuantLayerKV, QuantLatentKV), writes, capacity
  attend.py          softmax attention over [sinks ; old slots ; new keys] and its masks (the shape legend)
  scores.py          the two batched matmuls of grouped-query attention
  decode_kernel.py   decode and verify attention in the compiled CPU kernel, over the filled slots only
  int8_rows.py       absmax int8 per row (the int8 codecs' numerics)
  sinks.py           the int8 cache's attention sinks (the first tokens also in float32)
  channel_keys.py    per-channel key groups: quantization, the read rule, the --kv-keys setting
  channel_layout.py / channel_attention.py / channel_paged.py   the per-channel key layout: static and paged
  paged.py           the pool's layer types, BlockTables, and the attention views over block tables
  pool.py            init_pool: the whole paged pool, allocated up front
  block_pool.py / allocator.py   block ids, reference counts, prefix caching, copy-on-write (plain Python)
  sink_slots.py / residual_slots.py   per-sequence slots of the int8 sinks and the per-channel residual rings
  block_moves.py     compiled copy-on-write, swap and slot moves over the pool
  manager.py         CacheManager: the pool and all its bookkeeping, behind one interface for the engine
  tiers.py           KV tiers under the prefix cache: TierConfig, KVTiers (host memory, then disk)
  host_tier.py / disk_tier.py   the host-memory tier (an LRU in bytes) and the disk tier (block files, restarts)
  tier_block.py      one block outside the pool (TierBlock) and the layout key that says which pools read it
  tier_moves.py      blocks on their way between the pool and the tiers, moved before the pool is next written
  block_file.py      the file format of block files and sessions: header, arrays, checksum; atomic writes
  sessions.py        one sequence's cache with its tokens in a file: a server's prefix blocks, a static cache
  zero_pages.py      zeros whose pages the OS provides (a cache or pool allocated without writing it)
"""

from .allocator import BlockAllocator
from .block_pool import BlockPool, NoFreeBlocksError
from .cache import init_cache
from .codec import Codec, Field
from .manager import CacheManager
from .paged import BlockTables
from .pool import init_pool
from .spec import LayerSpec, codec_for, layer_specs, register_codec
from .static import CapacityError, KVCache, LatentKV, LayerKV, QuantLatentKV, QuantLayerKV
from .tiers import KVTiers, TierConfig

__all__ = ["BlockAllocator", "BlockPool", "BlockTables", "CacheManager", "CapacityError", "Codec", "Field",
           "KVCache", "LatentKV", "LayerKV", "LayerSpec", "NoFreeBlocksError", "QuantLatentKV", "QuantLayerKV",
           "KVTiers", "TierConfig", "codec_for", "init_cache", "init_pool", "layer_specs", "register_codec"]
