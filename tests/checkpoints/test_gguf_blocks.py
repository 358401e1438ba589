"""GGUF weights kept in their block formats (`dantinox import FILE.gguf` without --dtype, issue 23): the run
stores the file's blocks byte for byte with their layout, and decodes the same greedy tokens as the float32 run
of the dequantized weights (`--dtype float32`, today's import) for every format (the twelve the kernel runs),
tied and untied heads, mixed formats inside one fused projection; one decode program, as for float weights;
the pure-JAX fallback gives the same tokens; verify and eval name the weight format. Bad input: a block format
the kernel lacks (refused, or dequantized with one warning line under --dtype float32), a NaN scale,
--quantize on blocks."""

import json

import gguf
import jax
import numpy as np
import pytest
import safetensors
from gguf.quants import quantize
from gguf_util import DIM, FFN, KV_HEADS, HEAD, HEADS, K_QUANTS, hf_tensors, tiny_tokenizer_meta, write_tiny_gguf

from serving_util import drain, make_engine, solo
from serving_util import greedy as sampling

import dantinox as dx
from dantinox.cli import entrypoint as cli
from dantinox.parallel.mesh import make_mesh
from dantinox.parallel.sharding import shard_model
from dantinox.quant.block_linear import LAYOUT_KEY, BlockEmbed, BlockLinear
from dantinox.quant.weights import describe_weights, quantize_weights
from dantinox.runs.run_dir import load_run

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 60, 3, 9], [100, 2], [44, 45, 46, 47, 48, 49, 50, 51, 52]]


def import_both(tmp_path, capsys, qtype=Q.Q8_0, **gguf_options):
    """The GGUF file imported twice: blocks kept (default) and dequantized (--dtype float32)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype, wide=qtype.name in K_QUANTS, **gguf_options)
    blocks, floats = tmp_path / "blocks", tmp_path / "float"
    assert cli.main(["import", str(path), "--out", str(blocks)]) == 0
    assert cli.main(["import", str(path), "--out", str(floats), "--dtype", "float32"]) == 0
    return path, blocks, floats, capsys.readouterr().out


def greedy(model, prompts, n=10):
    return np.asarray(dx.generate(model, prompts, n))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                                   Q.Q6_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_block_run_stores_the_blocks_and_decodes_the_float32_tokens(tmp_path, capsys, qtype):
    path, blocks, floats, out = import_both(tmp_path, capsys, qtype)
    assert f"weights GGUF blocks {qtype.name}" in out and "weights float32" in out
    with safetensors.safe_open(str(blocks / "model.safetensors"), "np") as f:
        layout = json.loads(f.metadata()[LAYOUT_KEY])
        down = f.get_tensor("blocks.1.mlp.down.parts.0.data")
    width = 64 if qtype.name in K_QUANTS else HEAD
    in_width = 256 if qtype.name in K_QUANTS else DIM
    assert layout["blocks.0.attn.qkv"] == [[qtype.name, (HEADS + 2 * KV_HEADS) * width, in_width]]  # one part
    stored = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down.weight")
    assert down.dtype == np.uint8 and np.array_equal(down.reshape(-1), np.asarray(stored.data).reshape(-1))
    block_model, float_model = load_run(blocks)[0], load_run(floats)[0]
    assert isinstance(block_model.embed, BlockEmbed) and isinstance(block_model.lm_head, BlockLinear)
    assert describe_weights(block_model).startswith(f"GGUF blocks {qtype.name}, ")
    assert np.array_equal(greedy(block_model, PROMPTS), greedy(float_model, PROMPTS))  # B = 3


@pytest.mark.slow  # kept out of the default tier (its 10-minute budget)
def test_tied_mixed_formats_one_decode_program_and_the_fallback(tmp_path, capsys, monkeypatch):
    """SmolLM2's shape in miniature: Q4_1 matrices, a Q8_0 embedding that is also the head; plus a fused
    q | k | v of three formats (Q4_1, F16 widened to an F32 part, Q8_0) and a gate | up of two."""
    types = {"token_embd.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.F16, "blk.0.attn_v.weight": Q.Q8_0,
             "blk.1.ffn_up.weight": Q.Q4_0}
    _, blocks, floats, _ = import_both(tmp_path, capsys, Q.Q4_1, tied=True, tensor_types=types)
    block_model, float_model = load_run(blocks)[0], load_run(floats)[0]
    assert block_model.lm_head is None and isinstance(block_model.embed, BlockEmbed)
    assert [p.fmt for p in block_model.blocks[0].attn.qkv.parts] == ["Q4_1", "F32", "Q8_0"]
    assert [p.fmt for p in block_model.blocks[1].mlp.gate_up.parts] == ["Q4_1", "Q4_0"]
    assert describe_weights(block_model).startswith("GGUF blocks Q4_0+Q4_1+Q8_0, ")
    jax.clear_caches()  # count every program each model needs (compiled, or loaded from the persistent cache)
    with dx.CompileCounter() as float_first:
        want = greedy(float_model, PROMPTS)
    jax.clear_caches()
    with dx.CompileCounter() as block_first:
        got = greedy(block_model, PROMPTS)
    assert np.array_equal(got, want)
    assert block_first.compilations == float_first.compilations >= 2, (block_first, float_first)
    assert np.array_equal(greedy(block_model, PROMPTS[:1]), greedy(float_model, PROMPTS[:1]))  # B = 1
    with dx.CompileCounter() as warm:
        greedy(block_model, [[7, 8, 9], [1], [2, 3]], 14)  # other lengths, same bucket and batch size
    assert warm.compilations == 0, warm
    monkeypatch.setenv("DANTINOX_BLOCK_KERNEL", "off")
    jax.clear_caches()  # a new trace: the pure-JAX path
    assert np.array_equal(greedy(load_run(blocks)[0], PROMPTS), want)


def test_serving_engine_decodes_the_float32_tokens(tmp_path, capsys):
    """The paged engine's step functions (decode rows of 1-4 through the kernel, chunked prefill) on blocks."""
    _, blocks, floats, _ = import_both(tmp_path, capsys, Q.Q4_1, tied=True)
    engine = make_engine(load_run(blocks)[0])
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, sampling(8), request_id=str(i))
    done, float_model = drain(engine), load_run(floats)[0]
    for i, prompt in enumerate(PROMPTS):
        tokens = done[str(i)][0]
        assert tokens and tokens == solo(float_model, prompt, 8)[: len(tokens)], i


def test_verify_and_eval_name_the_weight_format(tmp_path, capsys):
    _, blocks, _, _ = import_both(tmp_path, capsys, Q.Q8_0)
    assert cli.main(["verify", "--run_dir", str(blocks), "--prompt", "la vita", "--new_tokens", "6"]) == 0
    assert "weights=GGUF blocks Q8_0, " in capsys.readouterr().out
    text = tmp_path / "slice.txt"
    text.write_text("Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura. " * 8, encoding="utf-8")
    assert cli.main(["eval", "--run_dir", str(blocks), "--slice", f"dante={text}", "--prompts", "2",
                     "--prompt-tokens", "8", "--continuation", "8"]) == 0
    assert "(weights GGUF blocks Q8_0, " in capsys.readouterr().out


def bad_import(tmp_path, capsys, path, *flags) -> tuple[int, str]:
    out = tmp_path / "run"
    rc = cli.main(["import", str(path), "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert (rc == 2) == (not out.exists())
    return rc, err


def test_a_format_the_kernel_lacks_is_refused_or_dequantized_with_a_warning(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.Q8_0, tensor_types={"blk.1.ffn_up.weight": Q.MXFP4})
    rc, err = bad_import(tmp_path, capsys, path)
    assert rc == 2 and err.count("\n") == 1
    assert "tensor blk.1.ffn_up.weight is in block format MXFP4" in err and "--dtype float32" in err
    rc, err = bad_import(tmp_path, capsys, path, "--dtype", "float32")
    assert rc == 0 and err.count("\n") == 1 and "MXFP4" in err and err.startswith("warning: ")


def test_a_nan_scale_is_refused_naming_the_tensor(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    vocab = len(tiny_tokenizer_meta()[0])
    raw = quantize(hf_tensors(vocab)["model.layers.1.mlp.up_proj.weight"], Q.Q8_0)
    raw[3, 34:36] = np.array([np.nan], np.float16).view(np.uint8)  # the scale of row 3's second block
    assert raw.shape == (FFN, DIM // 32 * 34)
    write_tiny_gguf(path, Q.Q8_0, raw_override=("blk.1.ffn_up.weight", Q.Q8_0, raw))
    rc, err = bad_import(tmp_path, capsys, path)
    assert rc == 2 and "tensor blk.1.ffn_up.weight (Q8_0) has 1 block(s) whose scale is NaN or inf" in err


def test_quantize_is_refused_on_blocks_and_a_mesh_accepts_them(tmp_path, capsys):
    """Blocks on a mesh (rows over model, the kernel in a shard_map) are tested with 8 forced devices in
    tests/parallel/multidevice/test_mesh_blocks.py; here a one-device mesh places them."""
    _, blocks, _, _ = import_both(tmp_path, capsys, Q.Q4_0)
    model = load_run(blocks)[0]
    shard_model(model, make_mesh(1, 1, jax.devices()[:1]))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(model, "int8")
