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


def test_the_int8_default_is_per_channel_keys_in_groups_of_64_except_for_mla():
    """Issue 19 item 3: eval on SmolLM2's slices put per-channel keys (G = 64) ahead of per-token keys with sinks
    (docs/explanation/quantization.md), so an int8 MHA / GQA / MQA cache uses them unless kv_keys="token" is given;
    MLA's latent cache stays per token (with its float32 sinks)."""
    cfg = ModelConfig()
    assert (cfg.kv_keys, cfg.kv_key_group, cfg.kv_sink_tokens) == ("channel", 64, 4)
    for attention in ("mha", "gqa", "mqa"):
        assert ModelConfig(attention=attention, cache_dtype="int8").channel_keys, attention
    assert not ModelConfig(cache_dtype="int8", kv_keys="token").channel_keys
    mla = ModelConfig(attention="mla", kv_latent_dim=64, cache_dtype="int8")
    assert not mla.channel_keys and mla.sink_slots == 4


@pytest.mark.parametrize("group, context, used", [(64, 512, 64), (64, 32, 32), (8, 32, 8), (100, 100, 100)])
def test_the_cache_uses_the_group_clipped_to_the_context(group, context, used):
    """key_group = min(kv_key_group, max_context): a context shorter than G completes no group either way; the
    field itself is kept, so a longer context gets the group back."""
    cfg = ModelConfig(cache_dtype="int8", kv_key_group=group, max_context=context)
    assert cfg.key_group == used and cfg.kv_key_group == group
    assert cfg.replace(max_context=4096).key_group == group
