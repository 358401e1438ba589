"""The draft model of the engine's draft speculation, kept beside the target in one module and one pool.

Design (as vLLM's draft-model speculation): the draft has its own paged KV pool with the SAME block tables as
the target, the same block ids, in arrays shaped for the draft's layers, KV heads and head size. The engine's
pool is one tuple, the target's L layers then the draft's L' layers, so every block operation that works per
layer (copy-on-write ``runner.copy_blocks``, swap out / in ``read_blocks`` / ``write_blocks``, zeroing on a
failed step) moves the draft's blocks with the target's, and the allocator's sharing, prefix-cache hits and
freeing cover both without knowing of the draft.

``TargetWithDraft`` is a module that runs both models over the same new tokens at the same positions and
returns the target's logits; the engine compiles its ordinary calls (``runner.forward_step`` prefill chunks and
decode rows, ``runner.decode_steps`` multi-step decoding) over it unchanged. So wherever the target writes keys
and values for a request, the draft writes its own for the same tokens in the same call: its cache always
holds exactly the positions the target's holds (the one exception, a verify call that accepts all k
proposals, is closed inside that call: ``draft_verify``). A prefix-cache hit therefore finds the draft's rows
in the shared blocks too, and a preempted request's recompute refills both.

The draft's pool is float: the draft run's cache dtype when float32 or bfloat16, else float32 (an int8 draft
pool would need sink and residual slots of its own; the target keeps its int8 pool, sinks and per-channel keys
and their exactness). Its bytes count in the engine's pool sizing: a block costs the target's
``paged_cache.block_bytes`` plus the draft's (``pair_block_bytes``).
"""

from __future__ import annotations

from flax import nnx

from ..config import ModelConfig
from ..generation.speculative_generate import check_draft
from ..quant.kv_dtype import with_kv_dtype
from ..kv.paged import PagedPool
from ..kv.sizes import page_bytes
from ..kv.pool import init_pool


def float_draft(draft):
    """``draft`` with a float cache dtype: itself when float32 / bfloat16, else a float32 twin sharing its
    parameters (``quant.kv_dtype.with_kv_dtype``)."""
    return with_kv_dtype(draft, "float32") if draft.cfg.cache_dtype == "int8" else draft


class TargetWithDraft(nnx.Module):
    """target and draft run over the same tokens: kv_caches holds the target's L layer caches then the draft's.

    Called as a Transformer (``ids`` [B, T] int32, use_cache, kv_caches, cache_index [B] int32, logits_at);
    returns (the target's logits, the target's caches + the draft's, the target's aux). The draft's logits are
    not returned (XLA drops their projection when unused). Raises ValueError as ``check_draft`` for a draft
    that cannot propose for the target (paradigm, vocab_size, max_context)."""

    def __init__(self, target, draft):
        check_draft(target, draft)
        self.target, self.draft = target, float_draft(draft)
        self.cfg = target.cfg

    @property
    def target_layers(self) -> int:
        """L, the target's layers: the pool's first L entries are the target's."""
        return self.target.cfg.num_blocks

    def __call__(self, ids, use_cache: bool = False, kv_caches=None, cache_index=0, logits_at=None, **kwargs):
        L = self.target_layers
        logits, target_caches, aux = self.target(ids, use_cache=use_cache, kv_caches=kv_caches[:L],
                                                 cache_index=cache_index, logits_at=logits_at, **kwargs)
        _, draft_caches, _ = self.draft(ids, use_cache=use_cache, kv_caches=kv_caches[L:], cache_index=cache_index,
                                        logits_at=logits_at, **kwargs)
        return logits, tuple(target_caches) + tuple(draft_caches), aux


def pair_block_bytes(cfg: ModelConfig, draft_cfg: ModelConfig, block_size: int) -> int:
    """Bytes one block takes over the target's layers (``paged_cache.block_bytes``) and the draft's float
    layers (draft_cfg's cache dtype, a float one)."""
    return page_bytes(cfg, block_size) + page_bytes(draft_cfg, block_size)


def init_draft_pool(draft_cfg: ModelConfig, num_blocks: int, block_size: int) -> PagedPool:
    """The draft's zero pool: per draft layer PagedLayerKV [N, P, K', D'] (or PagedLatentKV for an MLA draft)
    in its float cache dtype; no sink or residual slots."""
    return init_pool(draft_cfg, num_blocks, block_size)
