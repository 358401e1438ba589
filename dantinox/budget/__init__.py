"""Bytes and capacity, without a device: what each sequence costs and how many fit.

  memory.py       KV bytes per token and per sequence, weights, the largest batch, capacity for a request mix
  per_device.py   the same per device on a (data, model) mesh, replication counted
  size_flags.py   a memory size typed on a command line ("40GB"), refused naming the flag and the value
"""

from .memory import (CapacityPlan, MemorySplit, kv_bytes_per_token, kv_cache_bytes, kv_channel_key_cache_bytes,
                     kv_sink_bytes, max_batch_size, memory_split, param_bytes, parse_memory_size, plan_capacity)
from .per_device import DevicePlan, plan_mesh

__all__ = ["CapacityPlan", "DevicePlan", "MemorySplit", "kv_bytes_per_token", "kv_cache_bytes",
           "kv_channel_key_cache_bytes", "kv_sink_bytes",
           "max_batch_size", "memory_split", "param_bytes", "parse_memory_size", "plan_capacity", "plan_mesh"]
