"""Run directories record the SHA-256 of model.safetensors (model_summary.json ``weights_sha256``) when they are
written, and loading refuses a damaged weights file (truncated, one bit flipped) with one line naming it;
run directories written without the entry still load, and DANTINOX_VERIFY_WEIGHTS=0 loads anyway. A bit flip in
a float32 weight still gives finite values, so before the checksum such a file loaded and answered wrongly."""

import hashlib
import json
import os
import struct

import numpy as np
import pytest
from cli_util import run_main
from conftest import tiny_config
from paths import FIXTURES

import dantinox as dx
from dantinox.runs.bundled import bundled_names, bundled_run_dir
from dantinox.runs.run_dir import RunDirError, load_run, save_run
from dantinox.runs.tokenizer import train_tokenizer


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def run_dir(tmp_path):
    tok = train_tokenizer("abcdefgh " * 20, "char")
    cfg = tiny_config(vocab_size=tok.vocab_size)
    out = tmp_path / "run"
    save_run(out, dx.build_model(cfg), cfg, tok, {"steps": 1})
    return out


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "model_summary.json").read_text())


def _flip_a_weight_bit(path) -> None:
    """XOR 0x01 into the last byte of the tensor data (the top byte of the last float32, little-endian: the
    second bit of its exponent, so the value is multiplied or divided by 4 and stays finite)."""
    raw = bytearray(open(path, "rb").read())
    header = struct.unpack("<Q", raw[:8])[0]
    assert len(raw) > 8 + header
    raw[-1] ^= 0x01
    open(path, "wb").write(bytes(raw))


def test_save_run_records_the_sha256_of_the_file_it_wrote(run_dir):
    assert _summary(run_dir)["weights_sha256"] == _sha256(run_dir / "model.safetensors")
    load_run(run_dir)   # and it loads


@pytest.mark.parametrize("damage", ["bit-flip", "truncated", "truncated-header"])
def test_a_damaged_weights_file_is_refused_naming_it(run_dir, capsys, damage):
    path = run_dir / "model.safetensors"
    if damage == "bit-flip":
        _flip_a_weight_bit(path)
    else:
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[:len(raw) // 2] if damage == "truncated" else raw[:5])
    with pytest.raises(RunDirError) as info:
        load_run(run_dir)
    message = str(info.value)
    assert message.startswith(f"{path}: damaged: its sha256 is {_sha256(path)}, not the "
                              f"{_summary(run_dir)['weights_sha256']} recorded in model_summary.json")
    assert "\n" not in message
    status, out, err = run_main(["generate", "--run_dir", str(run_dir), "--prompt", "abc"], capsys)
    assert status == 2 and out == "" and err == f"dantinox generate: error: {message}\n"


def test_a_bit_flip_loads_with_the_check_turned_off_and_changes_the_weights(run_dir, monkeypatch):
    good, _, _, _ = load_run(run_dir)
    _flip_a_weight_bit(run_dir / "model.safetensors")
    monkeypatch.setenv("DANTINOX_VERIFY_WEIGHTS", "0")
    bad, _, _, _ = load_run(run_dir)
    changed = [np.any(np.asarray(a) != np.asarray(b)) for a, b in
               zip(jax_leaves(good), jax_leaves(bad))]
    assert sum(changed) == 1          # one weight changed: what the checksum exists to catch
    monkeypatch.delenv("DANTINOX_VERIFY_WEIGHTS")
    with pytest.raises(RunDirError, match="damaged"):
        load_run(run_dir)
    load_run(run_dir, verify=False)


def jax_leaves(model):
    from flax import nnx

    return [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def test_a_run_directory_without_a_checksum_still_loads(run_dir):
    summary = _summary(run_dir)
    del summary["weights_sha256"]
    (run_dir / "model_summary.json").write_text(json.dumps(summary))
    _flip_a_weight_bit(run_dir / "model.safetensors")   # nothing to check it against: loads as before
    load_run(run_dir)


def test_the_bundled_runs_carry_the_checksum_of_their_weights():
    for name in bundled_names():
        path = bundled_run_dir(name)
        with open(os.path.join(path, "model_summary.json")) as f:
            assert json.load(f)["weights_sha256"] == _sha256(os.path.join(path, "model.safetensors")), name


def test_an_imported_run_records_its_checksum(tmp_path, capsys):
    source = os.path.join(FIXTURES, "parity", "qwen2")
    status, _, err = run_main(["import", source, "--out", str(tmp_path / "imp")], capsys)
    assert status == 0, err
    assert _summary(tmp_path / "imp")["weights_sha256"] == _sha256(tmp_path / "imp" / "model.safetensors")
    _flip_a_weight_bit(tmp_path / "imp" / "model.safetensors")
    with pytest.raises(RunDirError, match="damaged"):
        load_run(tmp_path / "imp")


def test_a_damaged_training_checkpoint_is_refused_naming_it(tmp_path):
    from dantinox.train import checkpoint as ckpt

    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) + 1}
    path = ckpt.save_checkpoint(tmp_path, state, {"step": 1})
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["arrays_sha256"] == _sha256(path)
    _flip_a_weight_bit(path)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(tmp_path, state)
    assert str(info.value).startswith(f"{path}: damaged: its sha256 is {_sha256(path)}, not the "
                                      f"{meta['arrays_sha256']} recorded in meta.json")
    del meta["arrays_sha256"]          # a checkpoint written before the entry existed resumes unchecked
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    restored, _ = ckpt.load_checkpoint(tmp_path, state)
    assert np.asarray(restored["w"])[1, 2] == 24.0   # 6.0 with that bit flipped: finite, and wrong
