"""GGUF import on a tiny Llama file written here with the gguf package: dequantization (F32, F16, BF16, Q8_0,
Q4_0, Q4_1), the q/k rows back in HF order, the tokenizer from metadata, `dantinox import FILE.gguf` equal to
importing the same tensors as a Hugging Face checkpoint, chat from the imported template; and the bad inputs
(truncated or corrupt file, not GGUF, unsupported quantization type, unknown architecture): one line, exit 2,
no run directory left behind."""

import os

import gguf
import numpy as np
import pytest
from chat_util import TEXT, chat_tokenizer
from conftest import forward
from gguf.quants import dequantize, quantize
from gguf_util import write_tiny_gguf

import dantinox as dx
from dantinox.checkpoints import write_run_dir
from dantinox.checkpoints.gguf_source import read_gguf
from dantinox.cli import entrypoint as cli
from dantinox.generation.generator import Generator
from dantinox.runs.tokenizer import TextTokenizer

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_tensors_dequantize_to_hf_layout(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(path, qtype)
    ckpt = read_gguf(path)
    assert set(ckpt.tensors) == set(original)
    for name, array in original.items():
        want = array if array.ndim == 1 or qtype == Q.F32 else dequantize(quantize(array, qtype), qtype)
        assert np.array_equal(ckpt.tensors[name], want), name  # rows un-permuted, values as gguf dequantizes
    assert ckpt.config["num_key_value_heads"] == 2 and ckpt.config["tie_word_embeddings"] is False


def test_tokenizer_from_metadata_encodes_like_the_original(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    ckpt = read_gguf(path)
    ours, original = TextTokenizer.from_json(ckpt.tokenizer_json), chat_tokenizer()
    sample = "<|im_start|>user\n" + TEXT[:120] + " ché, 2024!<|im_end|>"
    assert ours.encode(sample) == original.encode(sample)
    assert ours.decode(ours.encode(sample)) == sample
    assert ckpt.generation == {"bos_token_id": original.hf.token_to_id("<|im_start|>"),
                               "eos_token_id": [original.hf.token_to_id("<|im_end|>")]}  # eos, eot, eom merged
    assert ckpt.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_import_cli_equals_hf_import_and_chats(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(path, Q.F32)
    assert cli.main(["import", str(path), "--out", str(tmp_path / "from-gguf")]) == 0
    assert "chat template yes" in capsys.readouterr().out
    ckpt = read_gguf(path)
    write_run_dir(tmp_path / "from-hf", ckpt.config, original, chat_tokenizer().hf.to_str(), None, None)
    a, b = Generator(tmp_path / "from-gguf", warmup=False), Generator(tmp_path / "from-hf", warmup=False)
    ids = np.asarray([a.encode(TEXT[:40])], np.int32)
    la, lb = (np.asarray(forward(g.model, ids, use_cache=False)[0]) for g in (a, b))
    assert np.abs(la - lb).max() <= 1e-5
    assert a.chat_format.stop_ids == (a.tokenizer.hf.token_to_id("<|im_end|>"),) and b.chat_format is None
    prompt = a.chat_format.prompt_ids([{"role": "user", "content": "Dove?"}], a.tokenizer)
    free = np.asarray(dx.generate(a.model, prompt, 8))
    answer = a.chat("Dove?", 8, temperature=0)
    stops = np.flatnonzero(np.isin(free, a.chat_format.stop_ids))
    assert answer == a.tokenizer.decode(free[: stops[0] if len(stops) else 8].tolist())


def bad_import(tmp_path, capsys, path) -> str:
    out = tmp_path / "run"
    assert cli.main(["import", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".run")]  # no temporary directory left
    return err


def test_truncated_gguf(tmp_path, capsys):
    """A file cut inside its header is corrupt or truncated; one cut inside the tensor data names the first
    tensor that runs past the end, the bytes it needs and the bytes the file has (not numpy's reshape)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.Q8_0)
    data = path.read_bytes()
    tensors = gguf.GGUFReader(str(path)).tensors  # the intact file's table: where each tensor's bytes lie
    reader = gguf.GGUFReader(str(path))
    entries = len(reader.fields) - 3  # the reader lists the header's version and two counts as fields too
    path.write_bytes(data[:40])
    assert (f"truncated or corrupt GGUF file: its header (version 3) declares {entries} metadata entries and "
            f"{len(tensors)} tensors, but their descriptions do not fit or do not parse in its 40 bytes"
            ) in bad_import(tmp_path, capsys, path)
    path.write_bytes(data[:20])
    assert "truncated GGUF file: 20 bytes, shorter than the 24-byte GGUF header" in bad_import(tmp_path, capsys, path)
    for cut in (len(data) // 2, len(data) - 100):
        path.write_bytes(data[:cut])
        first = next(t for t in tensors if t.data_offset + t.n_bytes > cut)
        err = bad_import(tmp_path, capsys, path)
        assert (f"tensor {first.name} ({first.tensor_type.name}, shape {list(reversed(first.shape.tolist()))}) "
                f"needs {first.n_bytes} bytes from offset {first.data_offset}, but the file has "
                f"{cut - first.data_offset} bytes there ({cut} bytes in all): the file is truncated") in err, err
        assert "reshape" not in err


def test_not_gguf_and_corrupt_header(tmp_path, capsys):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    assert "not a GGUF file" in bad_import(tmp_path, capsys, path)
    write_tiny_gguf(path)
    data = bytearray(path.read_bytes())
    data[8:16] = (10**9).to_bytes(8, "little")  # tensor count far beyond the file
    path.write_bytes(bytes(data))
    assert "1000000000 tensors, but their descriptions do not fit" in bad_import(tmp_path, capsys, path)


def test_unsupported_quantization_type(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, raw_override=("blk.1.ffn_up.weight", Q.Q8_1))
    err = bad_import(tmp_path, capsys, path)
    assert "blk.1.ffn_up.weight" in err and "Q8_1" in err


def test_unknown_architecture(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="mamba")
    assert "general.architecture='mamba' is not supported" in bad_import(tmp_path, capsys, path)
