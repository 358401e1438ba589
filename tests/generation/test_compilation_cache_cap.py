"""The persistent compilation cache is capped (``dantinox.xla``): the cap is set at import (1 GiB unless
DANTINOX_XLA_CACHE_MAX_SIZE says otherwise), the variable is parsed with errors naming it, and entries written
without a cap get an access-time stamp so JAX's eviction can run over them."""

import os

import jax
import pytest
from jax._src.lru_cache import LRUCache

from dantinox import xla


def test_the_cap_is_set_at_import():
    want = xla.compilation_cache_max_bytes()
    assert want == (xla.DEFAULT_CACHE_MAX_BYTES if "DANTINOX_XLA_CACHE_MAX_SIZE" not in os.environ else want)
    assert jax.config.jax_compilation_cache_max_size == (-1 if want is None else want)


@pytest.mark.parametrize("text, want", [("1GiB", 2**30), ("500MB", 500 * 10**6), ("2000000", 2_000_000),
                                        ("1.5 GiB", 3 * 2**29), ("unlimited", None)])
def test_sizes_parse(text, want):
    assert xla.compilation_cache_max_bytes(text) == want


@pytest.mark.parametrize("text", ["0", "lots", "1G", "-5MB", ""])
def test_bad_sizes_name_the_variable(text):
    with pytest.raises(ValueError, match="DANTINOX_XLA_CACHE_MAX_SIZE=.* is not allowed: a positive size"):
        xla.compilation_cache_max_bytes(text)


def test_unstamped_entries_are_stamped_and_evicted_oldest_first(tmp_path):
    for i, key in enumerate(["old", "mid", "new"]):   # written by an uncapped cache: no -atime files
        entry = tmp_path / f"{key}-cache"
        entry.write_bytes(b"x" * 100)
        os.utime(entry, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    assert xla.stamp_unstamped_entries(str(tmp_path)) == 3
    assert xla.stamp_unstamped_entries(str(tmp_path)) == 0   # stamped once
    LRUCache(str(tmp_path), max_size=250).put("newest", b"y" * 100)   # 400 bytes > 250: the two oldest go
    assert sorted(p.name for p in tmp_path.glob("*-cache")) == ["new-cache", "newest-cache"]
