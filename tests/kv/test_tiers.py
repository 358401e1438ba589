"""KV tiers under the pool (dantinox.kv.tiers): a prefix whose blocks left the pool comes back from host memory
or from disk, bit for bit, and the requests that use it generate what the same engine without a prefix cache
generates, for every cache kind (float rows, int8 rows with their sinks, int8 per-channel keys, MLA latents);
a new engine over the same disk directory finds the blocks; a damaged block file is refused, removed and
recomputed; another model or layout never finds them; bad sizes and directories are refused naming the
argument; a disk that stops taking writes turns the disk tier off without failing a request."""

import errno
import logging
import os

import jax
import numpy as np
import pytest
from conftest import tiered, tiny_config
from serving_util import drain, greedy, lively_mla_model, lively_model, make_engine

import dantinox as dx
from dantinox.kv import disk_tier
from dantinox.kv.allocator import hash_block
from dantinox.kv.block_file import read_record
from dantinox.kv.block_moves import read_sinks
from dantinox.kv.disk_tier import DiskTier
from dantinox.kv.host_tier import HostTier
from dantinox.kv.tier_block import TierBlock, tier_layout
from dantinox.kv.tiers import TierConfig
from dantinox.programs.store import clear_programs

GQA = dict(attention="gqa", kv_heads=2, max_context=64)
KINDS = {"float": GQA,
         "int8-rows": dict(GQA, cache_dtype="int8", kv_keys="token"),
         "int8-channel": dict(GQA, cache_dtype="int8", kv_keys="channel", kv_key_group=4),
         "mla": dict(max_context=64),
         "mla-int8": dict(max_context=64, cache_dtype="int8")}
PROMPT_LEN, NEW = 13, 6   # three full blocks of P = 4 and one token


def kind_model(kind: str):
    if kind.startswith("mla"):
        return lively_mla_model(dx.ModelConfig.from_preset("tiny-mla", **KINDS[kind]))
    return lively_model(tiny_config(**KINDS[kind]))


@pytest.fixture(scope="module", params=tiered(KINDS, slow=["mla-int8"]))
def kind(request):
    return request.param, kind_model(request.param)


def prompts(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 128, PROMPT_LEN).tolist() for _ in range(n)]


def run(engine, prompt, capture: bool = False):
    """Greedy NEW tokens of ``prompt``; with capture, also the contents of its three full prompt blocks and its
    sink rows (int8; else None) as the prefix cache holds them once it finished (``cached_contents``)."""
    rid = engine.add_request(prompt, greedy(NEW))
    tokens = drain(engine)[rid][0]
    return (tokens, *cached_contents(engine, prompt)) if capture else tokens


def prompt_hashes(prompt) -> list:
    hashes, parent = [], None
    for i in range(len(prompt) // 4):
        parent = hash_block(parent, prompt[4 * i:4 * (i + 1)])
        hashes.append(parent)
    return hashes


def cached_contents(engine, prompt) -> tuple:
    """(the pool's contents of ``prompt``'s cached full blocks, the sink rows of its first block or None)."""
    blocks = [engine.allocator.pool.lookup(h) for h in prompt_hashes(prompt)]
    assert None not in blocks, "the prompt's blocks are not all in the prefix cache"
    sinks = None
    if engine.sinks is not None:
        slot = engine.sinks.of_block[blocks[0]]
        sinks = jax.device_get(read_sinks(engine.pool, np.int32(slot)))
    return engine.cache.read_host(blocks), sinks


def reference(model, prompt) -> list:
    """The same engine's tokens with no prefix cache (every prompt token computed)."""
    return run(make_engine(model, num_blocks=16, enable_prefix_caching=False), prompt)


def assert_same_arrays(a, b) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    la, lb = [np.asarray(x) for x in _leaves(a)], [np.asarray(x) for x in _leaves(b)]
    assert len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))


def _leaves(tree):
    if isinstance(tree, (tuple, list)):
        return [leaf for part in tree for leaf in _leaves(part)]
    return [tree]


def evict(engine, prompt, seed: int = 7) -> None:
    """Run three other prompts through a 10-block pool until ``prompt``'s cached blocks have been taken."""
    for other in prompts(3, seed):
        run(engine, other)
    first = hash_block(None, prompt[:4])
    assert engine.allocator.pool.lookup(first) is None, "the prompt's first block is still in the pool"


def test_a_prefix_evicted_to_host_memory_comes_back_bit_for_bit(kind):
    name, model = kind
    prompt = prompts(1, 3)[0]
    engine = make_engine(model, num_blocks=10, kv_tiers=TierConfig(host_bytes=1 << 20))
    tokens, blocks, sinks = run(engine, prompt, capture=True)
    evict(engine, prompt)
    again, blocks2, sinks2 = run(engine, prompt, capture=True)
    host = engine.stats()["kv_tiers"]["host"]
    assert host["promotions"] == 3 and host["hits"] == 3
    assert engine.finished[-1].num_cached_tokens == 12
    assert_same_arrays(blocks, blocks2)
    assert_same_arrays(sinks, sinks2)
    assert (sinks is not None) == (KINDS[name].get("cache_dtype") == "int8")   # int8: the sinks came back too
    assert tokens == again == reference(model, prompt)


def test_a_new_engine_over_the_same_disk_directory_finds_the_prefix(kind, tmp_path):
    name, model = kind
    prompt = prompts(1, 4)[0]
    first = make_engine(model, num_blocks=10, kv_tiers=TierConfig(disk_dir=str(tmp_path)))
    tokens, blocks, sinks = run(first, prompt, capture=True)
    first.cache.tiers.flush()
    assert len(list(tmp_path.glob("*/*.kvb"))) == 3
    second = make_engine(model, num_blocks=10, kv_tiers=TierConfig(disk_dir=str(tmp_path)))
    again, blocks2, sinks2 = run(second, prompt, capture=True)
    disk = second.stats()["kv_tiers"]["disk"]
    assert disk["promotions"] == 3 and disk["refused"] == 0
    assert second.finished[-1].num_cached_tokens == 12
    assert_same_arrays(blocks, blocks2)
    assert_same_arrays(sinks, sinks2)
    assert tokens == again == reference(model, prompt)


@pytest.fixture(scope="module")
def float_model():
    return kind_model("float")


def _block_files(tmp_path, prompt):
    """The disk tier's files of ``prompt``'s three full blocks, in prefix order."""
    hashes = prompt_hashes(prompt)
    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    return [folder / (h.hex() + ".kvb") for h in hashes]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_block_file_is_refused_removed_and_recomputed(float_model, tmp_path, caplog, damage):
    prompt = prompts(1, 5)[0]
    first = make_engine(float_model, num_blocks=10, kv_tiers=TierConfig(disk_dir=str(tmp_path)))
    want = run(first, prompt)
    first.cache.tiers.flush()
    files = _block_files(tmp_path, prompt)
    data = files[1].read_bytes()
    if damage == "flip":
        data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0x40]) + data[len(data) // 2 + 1:]
    data = data[:len(data) // 3] if damage == "truncate" else b"" if damage == "empty" else data
    files[1].write_bytes(data)
    second = make_engine(float_model, num_blocks=10, kv_tiers=TierConfig(disk_dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, "dantinox.kv"):
        got = run(second, prompt)
    disk = second.stats()["kv_tiers"]["disk"]
    assert got == want == reference(float_model, prompt)
    assert disk["refused"] == 1 and disk["promotions"] == 1   # the first block; the chain stops at the damage
    assert second.finished[-1].num_cached_tokens == 4
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and str(files[1]) in refusals[0]
    second.cache.tiers.flush()   # recomputed, so written again, whole
    assert files[1].read_bytes() != data and read_record(str(files[1]))[0]["hash"] == files[1].stem


def test_blocks_are_never_found_under_another_model_or_layout(float_model, tmp_path):
    prompt = prompts(1, 6)[0]
    tiers = TierConfig(disk_dir=str(tmp_path))
    first = make_engine(float_model, num_blocks=10, kv_tiers=tiers)
    run(first, prompt)
    first.cache.tiers.flush()
    others = [make_engine(lively_model(tiny_config(**GQA), seed=4), num_blocks=10, kv_tiers=tiers),
              make_engine(float_model, num_blocks=10, block_size=8, chunk_buckets=(8, 16), kv_tiers=tiers),
              make_engine(kind_model("int8-rows"), num_blocks=10, kv_tiers=tiers)]
    for engine in others:
        run(engine, prompt)
        assert engine.stats()["kv_tiers"]["disk"]["hits"] == 0
        assert engine.finished[-1].num_cached_tokens == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 4   # one folder per model and layout


def test_tier_sizes_below_one_block_and_unwritable_directories_are_refused(float_model, tmp_path):
    with pytest.raises(ValueError, match=r"kv_host_bytes=100 holds no block: one block takes \d+ bytes"):
        make_engine(float_model, kv_tiers=TierConfig(host_bytes=100))
    with pytest.raises(ValueError, match=r"kv_disk_bytes=100 holds no block"):
        make_engine(float_model, kv_tiers=TierConfig(disk_dir=str(tmp_path), disk_bytes=100))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"kv_disk_dir='.*a-file/sub' is not a writable directory"):
        make_engine(float_model, kv_tiers=TierConfig(disk_dir=str(blocker / "sub")))


def test_a_disk_that_stops_taking_writes_turns_the_tier_off_with_one_warning(float_model, tmp_path, caplog,
                                                                            monkeypatch):
    engine = make_engine(float_model, num_blocks=10, kv_tiers=TierConfig(disk_dir=str(tmp_path),
                                                                          host_bytes=1 << 20))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "write_record", full)
    a, b = prompts(2, 8)
    with caplog.at_level(logging.WARNING, "dantinox.kv"):
        got = [run(engine, a), run(engine, b)]
        engine.cache.tiers.flush()
    assert got == [reference(float_model, a), reference(float_model, b)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "KV disk tier off" in warnings[0] and "No space left" in warnings[0]
    stats = engine.stats()["kv_tiers"]
    assert stats["disk"]["enabled"] is False and stats["host"]["stores"] >= 3   # host memory still works
    assert not list(tmp_path.glob("*/*.kvb"))


# The tiers themselves, in plain Python -----------------------------------------------------------------------
def _layout():
    return tier_layout(tiny_config(**GQA), 4, "test-model")


def _block(layout, value: float) -> TierBlock:
    return TierBlock(tuple(tuple(np.full(s, value, d) for s, d in layer) for layer in layout.blocks))


def test_the_host_tier_drops_its_least_recently_used_blocks_at_its_bound():
    layout = _layout()
    size = layout.block_bytes()
    host = HostTier(3 * size, size)
    for i in range(3):
        host.put(bytes([i]), _block(layout, i))
    assert host.get(bytes([0])) is not None          # 0 is now the most recently used
    host.put(bytes([3]), _block(layout, 3))          # over the bound: 1 goes
    assert [host.has(bytes([i])) for i in range(4)] == [True, False, True, True]
    assert host.bytes == 3 * size and host.evictions == 1


def test_the_disk_tier_keeps_its_bound_and_its_order_across_a_restart(tmp_path):
    layout = _layout()
    probe = DiskTier(str(tmp_path / "probe"), 1 << 20, layout)
    probe.put(b"x" * 16, _block(layout, 0))
    probe.flush()
    size = probe.bytes   # one file: the payload, its header and checksum
    assert layout.block_bytes() < size < layout.block_bytes() + 1024
    disk = DiskTier(str(tmp_path), 3 * size, layout)
    for i in range(3):
        disk.put(bytes([i]) * 16, _block(layout, i))
        disk.flush()
    assert disk.get(bytes([0]) * 16) is not None      # touched: most recently used, also after a restart
    reopened = DiskTier(str(tmp_path), 3 * size, layout)
    reopened.put(bytes([3]) * 16, _block(layout, 3))
    reopened.flush()
    assert [reopened.has(bytes([i]) * 16) for i in range(4)] == [True, False, True, True]
    got = reopened.get(bytes([2]) * 16)
    assert all(np.all(a == 2) for a in got.arrays())
    leftover = tmp_path / layout.key / ("ab" * 16 + ".kvb.123.deadbeef.tmp")   # a writer killed mid-write
    leftover.write_bytes(b"half a block")
    DiskTier(str(tmp_path), 3 * size, layout)
    assert not leftover.exists()
    assert os.path.exists(tmp_path / layout.key / "layout.json") and reopened.bytes == 3 * size


def test_the_warm_up_compiles_every_move_between_the_pool_and_the_tiers(tmp_path):
    """As case K14 for the tiers: after the engine's warm-up, evicting a prefix to host memory and disk and
    restoring it (an int8 pool: its sink rows too) compiles nothing."""
    jax.clear_caches()
    clear_programs()
    model = kind_model("int8-rows")
    engine = make_engine(model, num_blocks=10, kv_tiers=TierConfig(host_bytes=1 << 20, disk_dir=str(tmp_path)))
    engine.warmup()
    prompt = prompts(1, 9)[0]
    with dx.CompileCounter() as counted:
        run(engine, prompt)
        evict(engine, prompt)
        run(engine, prompt)
    assert engine.stats()["kv_tiers"]["host"]["promotions"] == 3
    assert counted.compilations == 0 and counted.cache_hits == 0, counted
