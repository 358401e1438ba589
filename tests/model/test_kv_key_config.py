"""ModelConfig's int8 key layout fields: kv_keys and kv_key_group are validated and round-trip through to_dict."""

import pytest

from dantinox.config import ConfigError, ModelConfig


def test_kv_keys_rejects_unknown_layout_naming_the_field():
    with pytest.raises(ConfigError, match="kv_keys"):
        ModelConfig(kv_keys="row")


@pytest.mark.parametrize("group", [0, -4, 2.5, True])
def test_kv_key_group_must_be_a_positive_integer(group):
    with pytest.raises(ConfigError, match="kv_key_group"):
        ModelConfig(kv_key_group=group)


def test_channel_keys_only_for_int8_non_latent_caches():
    assert ModelConfig(cache_dtype="int8", kv_keys="channel").channel_keys
    assert not ModelConfig(cache_dtype="float32", kv_keys="channel").channel_keys
    assert not ModelConfig(cache_dtype="int8", kv_keys="token").channel_keys
    mla = ModelConfig(attention="mla", kv_latent_dim=64, cache_dtype="int8", kv_keys="channel")
    assert not mla.channel_keys


def test_key_layout_round_trips_through_the_dict():
    cfg = ModelConfig(cache_dtype="int8", kv_keys="channel", kv_key_group=32)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
