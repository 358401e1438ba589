"""Bad input gets a clear error naming the field, the value and what is allowed (issue 2)."""

import numpy as np
import pytest
from conftest import forward, tiny_config

import dantinox as dx


@pytest.fixture(scope="module")
def model():
    return dx.build_model(tiny_config())


@pytest.mark.parametrize("prompt, match", [
    ([], "empty"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[]], "prompt 0 is empty"),
    ([1, 2, 128], r"token id 128 outside \[0, vocab_size=128\)"),
    ([[1, -3]], r"token id -3 outside"),
    ([1.5, 2.0], "non-integer"),
    ("Nel mezzo", "not text"),
])
def test_bad_prompts(model, prompt, match):
    with pytest.raises(ValueError, match=match):
        dx.generate(model, prompt, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), r"temperature=-1.0 .*in \[0, 3.4028e\+38\]"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e39), r"temperature=1e\+39 is not allowed: a finite number in \[0, 3.4028e\+38\] \(float32"),
    (dict(top_p=0.0), r"top_p=0.0 .*\(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5"),
    (dict(top_k=-1), r"top_k=-1 .*>= 0"),
    (dict(top_k=2.5), r"top_k=2.5"),
    (dict(temperature=[0.5, 0.5, 0.5]), "3 values for a batch of 1"),
    (dict(seed=-1), r"seed=-1"),
    (dict(eos_id=128), r"eos_id=128"),
])
def test_bad_sampling_settings(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dx.generate(model, [1, 2, 3], 3, **kwargs)


@pytest.mark.parametrize("n", [0, -5, 2.0, True])
def test_bad_max_new_tokens(model, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        dx.generate(model, [1, 2, 3], n)


def test_capacity_errors_name_both_numbers(model):
    with pytest.raises(dx.CapacityError, match=r"prompt of 20 tokens \+ max_new_tokens=13 = 33 exceeds "
                                                r"max_context=32; use at most 12"):
        dx.generate(model, list(range(20)), 13)
    with pytest.raises(dx.CapacityError):
        dx.generate(model, [[1], list(range(20))], 13, use_cache=False)


@pytest.mark.parametrize("fields, match", [
    (dict(attention="gqa", kv_heads=3), r"kv_heads=3 .*divisor of n_heads=8.*\[1, 2, 4, 8\]"),
    (dict(attention="mha", kv_heads=2), r"kv_heads=2 .*equal to n_heads=8"),
    (dict(attention="mqa", kv_heads=2), r"kv_heads=2 .*1 for attention='mqa'"),
    (dict(attention="sparse"), r"attention='sparse'"),
    (dict(dim=0), r"dim=0 .*positive integer"),  # dim need not equal n_heads * head_size (Qwen3)
    (dict(num_blocks=0), r"num_blocks=0 .*positive integer"),
    (dict(compute_dtype="float16"), r"compute_dtype='float16'"),
    (dict(cache_dtype="int4"), r"cache_dtype='int4' .*'int8'"),
    (dict(compute_dtype="int8"), r"compute_dtype='int8'"),
    (dict(sliding_window=0), r"sliding_window=0"),
    (dict(paradigm="encoder"), r"paradigm='encoder'"),
])
def test_bad_config_fields(fields, match):
    with pytest.raises(dx.ConfigError, match=match):
        tiny_config(**fields)


def test_unknown_config_field_and_preset():
    with pytest.raises(dx.ConfigError, match="unknown ModelConfig field"):
        dx.ModelConfig.from_dict({"dimension": 3})
    with pytest.raises(dx.ConfigError, match="unknown preset 'huge'"):
        dx.ModelConfig.from_preset("huge")


def test_model_call_errors(model):
    cfg = model.cfg
    with pytest.raises(ValueError, match="needs kv_caches"):
        model(np.array([[1, 2]]), use_cache=True)
    with pytest.raises(ValueError, match="do not match"):
        model(np.array([[1, 2]]), use_cache=True, kv_caches=dx.init_cache(cfg, 2), cache_index=0)
    with pytest.raises(ValueError, match=r"vocab_size=128"):
        model(np.array([[1, 500]]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(np.array([1, 2]))
    with pytest.raises(ValueError, match="batch_size"):
        dx.init_cache(cfg, 0)


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_sliding_window_masks_old_positions():
    """With a window of 4 and one layer, logits depend only on the last 4 tokens; cached == uncached."""
    cfg = tiny_config(sliding_window=4, num_blocks=1)
    model = dx.build_model(cfg, 3)
    a = np.array([[1, 2, 3, 9, 8, 7, 6]], np.int32)
    b = np.array([[5, 5, 5, 9, 8, 7, 6]], np.int32)
    la, lb = np.asarray(forward(model, a)[0]), np.asarray(forward(model, b)[0])
    assert np.abs(la[0, -1] - lb[0, -1]).max() < 1e-6  # positions 3..6 are identical
    assert np.abs(la[0, 2] - lb[0, 2]).max() > 1e-4
    out_on = dx.generate(model, a[0].tolist(), 10)
    out_off = dx.generate(model, a[0].tolist(), 10, use_cache=False)
    np.testing.assert_array_equal(out_on, out_off)


def test_one_field_switches_the_attention_kind(tmp_path):
    """Changing `attention` alone resets the old kind's kv_heads / MLA sizes, in the constructor, presets,
    replace, YAML configs and --set overrides; MLA still needs its latent sizes (named in the error)."""
    from dantinox.cli.train import resolve_cli_config as resolve_config

    assert [dx.ModelConfig(attention=a).kv_heads for a in ("mha", "gqa", "mqa")] == [8, 2, 1]
    gqa = dx.ModelConfig.from_preset("reference")
    assert gqa.replace(attention="mha").kv_heads == 8 and gqa.replace(attention="mqa").kv_heads == 1
    assert dx.ModelConfig.from_preset("reference", attention="mha").kv_heads == 8
    mla = dx.ModelConfig.from_preset("reference-mla")
    back = mla.replace(attention="gqa")
    assert (back.kv_heads, back.kv_latent_dim, back.rope_head_dim, back.q_latent_dim) == (2, None, None, None)
    assert gqa.replace(attention="gqa", kv_heads=4).kv_heads == 4
    with pytest.raises(dx.ConfigError, match="kv_latent_dim=None .*attention='mla'"):
        gqa.replace(attention="mla")
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("preset: reference\nattention: mqa\n")
    assert resolve_config(None, str(yaml_file), [])[0].kv_heads == 1
    assert resolve_config("tiny-mla", None, ["attention=gqa"])[0].kv_heads == 2


def test_prompt_longer_than_the_context_says_the_prompt_is_too_long(model):
    for n in (32,):  # longer prompts: "prompt 0 has 40 tokens, more than max_context=32"
        with pytest.raises(dx.CapacityError, match=rf"prompt of {n} tokens is too long: max_context=32 holds at "
                                                    r"most 31 prompt tokens"):
            dx.generate(model, list(range(n)), 1)
