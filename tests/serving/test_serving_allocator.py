"""Block pool and allocator in plain Python: free list, reference counts, prefix caching, copy-on-write,
LRU reuse."""

import pytest

from dantinox.kv.allocator import BlockAllocator, hash_block
from dantinox.kv.block_pool import BlockPool, NoFreeBlocksError


def test_pool_allocate_release_and_double_free():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and pool.num_free == 0 and pool.num_used == 3
    with pytest.raises(NoFreeBlocksError, match="all 3 KV blocks"):
        pool.allocate()
    pool.release(blocks[1])
    assert pool.num_free == 1 and pool.allocate() == blocks[1]
    pool.release(blocks[0])
    with pytest.raises(ValueError, match="double free"):
        pool.release(blocks[0])
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0)


def test_pool_lru_reuses_least_recently_freed_and_keeps_hashes_until_evicted():
    pool = BlockPool(3)
    a, b, c = (pool.allocate() for _ in range(3))
    pool.register(a, b"ha")
    pool.register(b, b"hb")
    pool.release(a)
    pool.release(b)
    assert pool.lookup(b"ha") == a and pool.lookup(b"hb") == b  # freed but still cached
    pool.hold(b)  # revived by a hit: leaves the free queue
    assert pool.ref_counts[b] == 1 and pool.num_free == 1
    assert pool.allocate() == a and pool.lookup(b"ha") is None  # evicted on reuse
    pool.register(c, b"hb")  # a second block with the same content is not indexed
    assert pool.lookup(b"hb") == b


def test_hash_chain_names_the_whole_prefix():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(hash_block(None, [1, 2]), [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])


def test_grow_appends_blocks_all_or_nothing():
    alloc = BlockAllocator(4, block_size=4)
    assert alloc.match_prefix("a", [1, 2, 3]) == 0
    assert alloc.grow("a", 0, 3) == [] and len(alloc.table("a")) == 1
    assert alloc.grow("a", 3, 9) == [] and len(alloc.table("a")) == 3
    assert alloc.grow("b", 0, 8) is None and alloc.table("b") == [] and alloc.num_free == 1
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free == 4 and alloc.num_used == 0
    alloc.free("never-seen")  # no-op


def test_prefix_cache_hit_shares_blocks_and_frees_to_lru():
    alloc = BlockAllocator(8, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    alloc.match_prefix("a", prompt)
    alloc.grow("a", 0, 10)
    alloc.commit("a", prompt, 10)
    assert alloc.pool.num_cached == 2
    assert alloc.match_prefix("b", prompt[:8] + [99, 98, 97]) == 8
    assert alloc.table("b")[:2] == alloc.table("a")[:2]
    assert [alloc.pool.ref_counts[x] for x in alloc.table("a")[:2]] == [2, 2]
    assert alloc.prefix_hits == 2 and alloc.prefix_queries == 3  # a: one miss stops the walk
    assert alloc.match_prefix("c", [0, 1, 2, 7, 4, 5, 6, 7]) == 0  # first block differs
    alloc.free("a")
    alloc.free("b")
    alloc.free("c")
    assert alloc.num_free == 8 and alloc.pool.num_cached == 2
    assert alloc.match_prefix("d", prompt) == 8  # revived from the free queue
    assert alloc.num_free == 6


def test_copy_on_write_when_a_shared_block_is_written():
    alloc = BlockAllocator(6, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    alloc.match_prefix("a", prompt)
    alloc.grow("a", 0, 8)
    alloc.commit("a", prompt, 8)
    assert alloc.match_prefix("b", prompt) == 8  # the whole prompt is cached
    shared = list(alloc.table("b"))
    # b recomputes its last prompt token (position 7) for its logits: block 1 is shared with a -> copy
    copies = alloc.grow("b", 7, 8)
    assert copies == [(shared[1], alloc.table("b")[1])] and alloc.table("b")[1] != shared[1]
    assert alloc.table("b")[0] == shared[0] and alloc.pool.ref_counts[shared[1]] == 1
    assert alloc.cow_copies == 1 and alloc.pool.lookup(alloc.prompt_hashes(prompt)[1]) == shared[1]
    alloc.free("a")
    # a cached block held by one sequence only: written in place, it just leaves the hash index
    assert alloc.match_prefix("c", prompt) == 8
    assert alloc.grow("c", 7, 9) == [] and alloc.pool.num_cached == 1
    for seq in ("b", "c"):
        alloc.free(seq)
    assert alloc.num_free == 6


def test_copy_on_write_needs_a_free_block():
    alloc = BlockAllocator(2, block_size=2)
    alloc.match_prefix("a", [1, 2, 3, 4])
    alloc.grow("a", 0, 4)
    alloc.commit("a", [1, 2, 3, 4], 4)
    assert alloc.match_prefix("b", [1, 2, 3, 4]) == 4
    assert alloc.grow("b", 3, 4) is None  # no block to copy into; nothing changed
    assert alloc.table("b") == alloc.table("a")


def test_prefix_caching_off_and_swap_in_allocation():
    alloc = BlockAllocator(4, block_size=2, enable_prefix_caching=False)
    alloc.match_prefix("a", [1, 2, 3, 4])
    alloc.grow("a", 0, 4)
    alloc.commit("a", [1, 2, 3, 4], 4)
    assert alloc.pool.num_cached == 0 and alloc.match_prefix("b", [1, 2, 3, 4]) == 0
    assert alloc.allocate_blocks("c", 3) is None
    assert len(alloc.allocate_blocks("c", 2)) == 2 and alloc.num_free == 0
    with pytest.raises(ValueError, match="already holds"):
        alloc.allocate_blocks("c", 1)
