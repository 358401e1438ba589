"""Generator, streaming, cache verification and the CLI on a tiny run directory written by save_run."""

import json

import jax
import numpy as np
import pytest
from conftest import reference_logits, spiky_model, tiny_config
from run_util import make_run

from dantinox.cli import entrypoint as cli
from dantinox.generation.generator import Generator
from dantinox.model.transformer import build_model
from dantinox.quality.verify import verify_cache


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run") / "tiny", attention="gqa", kv_heads=2)


def test_generator_generate_stream_and_batch(run_dir):
    gen = Generator(run_dir)
    assert gen.warmup.compilations >= 0 and gen.load_seconds > 0
    greedy = gen.generate("Nel mezzo", 20, temperature=0)
    assert isinstance(greedy, str) and len(greedy) > 0
    assert "".join(gen.stream("Nel mezzo", 20, temperature=0, chunk_size=3)) == greedy
    sampled = gen.generate("Nel mezzo", 20, temperature=1.0, seed=5)
    assert "".join(gen.stream("Nel mezzo", 20, temperature=1.0, seed=5, chunk_size=7)) == sampled
    batch = gen.generate(["Nel mezzo", "selva"], 20, temperature=0)
    assert batch[0] == greedy and batch[1] == gen.generate("selva", 20, temperature=0)
    assert gen.generate("Nel mezzo", 20, temperature=0, use_cache=False) == greedy


def test_generator_unknown_characters_and_empty_prompt(run_dir):
    gen = Generator(run_dir, warmup=False)
    with pytest.raises(ValueError, match="Z"):
        gen.generate("Zorro", 5)
    assert isinstance(gen.generate("Zorro", 5, unknown="replace"), str)
    with pytest.raises(ValueError, match="prompt is empty"):
        gen.generate("", 5)
    for text in (None, [], 7):
        with pytest.raises(ValueError, match="text=.* is not allowed"):
            gen.generate(text, 5)


def test_stream_never_splits_a_character(tmp_path):
    gen = Generator(make_run(tmp_path / "bpe", kind="bpe"))
    # A random byte-level model emits invalid byte sequences too (decoded as U+FFFD in both paths); a character
    # split across two pieces would show up as U+FFFD in the stream where the whole text holds the character.
    for seed in range(3):
        pieces = list(gen.stream("ché la", 40, temperature=1.0, seed=seed, chunk_size=1))
        for piece in pieces:
            piece.encode("utf-8")
        assert "".join(pieces) == gen.generate("ché la", 40, temperature=1.0, seed=seed)


def test_verify_passes_and_detects_a_broken_cache(monkeypatch):
    model = spiky_model(tiny_config(attention="gqa", kv_heads=4))
    report = verify_cache(model, [3, 1, 4, 1, 5], 20)
    assert report.passed and report.max_diff.max() <= 1e-4 and len(report.positions) == 5 + 19
    import dantinox.kv.float_codec as float_codec
    from dantinox.kv import decode_kernel as attention_kernel

    real_write = float_codec.write_layer
    monkeypatch.setattr(float_codec, "write_layer", lambda layer, k, v, i: real_write(layer, k * 0.5, v, i))
    jax.clear_caches()  # drop the compiled steps traced with the real write
    broken = verify_cache(model, [3, 1, 4, 1, 5], 20)
    # a short cached call attends in the compiled kernel over the cache it has just written (verify_attention),
    # so there the broken write reaches the prompt's positions too; XLA's attention reads the new keys directly
    monkeypatch.setenv(attention_kernel.ENV, "off")
    jax.clear_caches()
    broken_xla = verify_cache(model, [3, 1, 4, 1, 5], 20)
    monkeypatch.undo()
    jax.clear_caches()
    assert not broken.passed and not broken_xla.passed
    assert broken_xla.max_diff[:5].max() <= 1e-4  # prefill positions do not read the cache on XLA's path
    if attention_kernel.kernel_available():
        assert broken.max_diff[1:5].max() > 1e-3


def test_cli_generate_verify_and_errors(run_dir, capsys):
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--max_new_tokens", "10",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("Nel")
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--max_new_tokens", "10",
                     "--stream", "--seed", "1"]) == 0
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--max_new_tokens", "10",
                     "--no_cache", "--temperature", "0"]) == 0
    assert cli.main(["verify", "--run_dir", run_dir, "--new_tokens", "25"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--max_new_tokens", "100"]) == 2
    assert "max_context=64" in capsys.readouterr().err
    for bad, message in ((["--temperature", "-1"], "--temperature -1.0"), (["--top_p", "0"], "--top_p 0.0"),
                         (["--top_k", "-2"], "--top_k -2"), (["--stream", "--no_cache"], "--stream needs")):
        assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel", "--max_new_tokens", "9"] + bad) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.out == ""
    assert cli.main(["generate", "--run_dir", run_dir + "-missing", "--prompt", "Nel"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_non_finite_weights_are_a_corrupted_run(tmp_path):
    import os

    import safetensors.numpy

    from dantinox.runs.run_dir import RunDirError, load_run

    run = make_run(tmp_path / "nan")
    path = os.path.join(run, "model.safetensors")
    arrays = safetensors.numpy.load_file(path)
    name = sorted(arrays)[0]
    arrays[name] = arrays[name].copy()
    arrays[name].flat[3] = float("nan")
    safetensors.numpy.save_file(arrays, path)
    with pytest.raises(RunDirError, match="model.safetensors: damaged: its sha256"):   # the recorded checksum
        load_run(run)
    summary_path = os.path.join(run, "model_summary.json")
    summary = json.load(open(summary_path))
    del summary["weights_sha256"]            # a run directory with no checksum recorded: the values are checked
    json.dump(summary, open(summary_path, "w"))
    with pytest.raises(RunDirError, match=f"{name} holds 1 non-finite"):
        load_run(run)
    assert cli.main(["generate", "--run_dir", run, "--prompt", "Nel"]) == 2


def test_cli_defaults_fit_the_context_and_flags_are_checked(run_dir, capsys):
    # max_context is 64: the default of 200 new tokens is lowered to what the context leaves
    assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel mezzo", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "55 new tokens" in captured.err
    for bad, message in ((["--seed", "-1"], "--seed -1"), (["--max_new_tokens", "0"], "--max_new_tokens 0"),
                         (["--max_new_tokens", "-3"], "--max_new_tokens -3"),
                         (["--prompt", "Nel mezzo " * 8], "prompt of 80 tokens is too long: max_context=64")):
        assert cli.main(["generate", "--run_dir", run_dir, "--prompt", "Nel"] + bad) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.out == ""
    for bad, message in ((["--new_tokens", "0"], "--new_tokens 0"), (["--tolerance", "-1"], "--tolerance -1"),
                         (["--prompt", ""], "--prompt is empty"), (["--range", "0"], "--range 0"),
                         (["--range", "-3"], "--range -3 is not allowed")):
        assert cli.main(["verify", "--run_dir", run_dir] + bad) == 2
        assert message in capsys.readouterr().err


def test_budget_uses_the_run_cache_dtype(run_dir, capsys):
    assert cli.main(["budget", "--run_dir", run_dir, "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "float32" in out and "bfloat16" not in out
    assert cli.main(["budget", "--run_dir", run_dir, "--context", "64", "--dtype", "fp8"]) == 2
    assert "--dtype 'fp8'" in capsys.readouterr().err


def test_verify_allows_the_larger_of_the_absolute_and_the_relative_tolerance_per_position():
    """The allowed difference at each position is max(tolerance, relative x the largest |logit| there), the
    logits taken from an independent numpy forward of the same tokens."""
    model = build_model(tiny_config(), seed=0)
    prompt = [5, 17, 3, 99]
    report = verify_cache(model, prompt, new_tokens=6, tolerance=1e-4, relative_tolerance=0.5)
    ids = np.asarray([prompt + [int(t) for t in report.tokens[:-1]]])
    largest = np.abs(reference_logits(model, ids)[0]).max(-1)
    assert len(report.tolerance) == ids.shape[1]
    np.testing.assert_allclose(report.tolerance, np.maximum(1e-4, 0.5 * largest), rtol=1e-4)
    assert report.passed
    strict = verify_cache(model, prompt, new_tokens=6, tolerance=0.0, relative_tolerance=0.0)
    assert (strict.tolerance == 0).all() and strict.passed == bool((strict.max_diff == 0).all())
