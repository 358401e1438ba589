"""A tiny Llama GGUF file written with the gguf package the way llama.cpp's converter writes one: HF-layout
tensors, q/k rows permuted to llama.cpp's RoPE pair order, chosen quantization types, and the tokenizer as
metadata (a byte-level BPE trained here, with the ChatML markers as control tokens)."""

import json

import gguf
import numpy as np
from chat_util import CHATML, MARKERS, TEXT
from gguf.quants import quantize

from dantinox.runs.tokenizer import train_tokenizer

DIM, HEADS, KV_HEADS, HEAD, FFN, BLOCKS = 64, 4, 2, 16, 96, 2
WIDE = dict(dim=256, head=64, ffn=512)   # widths that K-quants' 256-value blocks divide
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")   # 256-value blocks (the WIDE widths divide them)
RANDOM_BLOCKS = K_QUANTS + ("IQ4_NL",)   # gguf.quants has no quantizer for these: random valid blocks instead
# byte offsets of a block's float16 scales (ggml-common.h layouts) and their size, which keeps weights of order
# 0.1-1 (IQ4_XS multiplies d by a 6-bit scale and table values up to 127)
K_SCALES = {"Q2_K": ((80, 82), 0.003), "Q3_K": ((108,), 0.003), "Q4_K": ((0, 2), 0.003),
            "Q5_K": ((0, 2), 0.003), "Q6_K": ((208,), 0.003), "IQ4_NL": ((0,), 0.003), "IQ4_XS": ((0,), 0.0002)}


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks of ``qtype`` for a [rows, cols] matrix (uint8 [rows, row bytes]): random bits, with the
    float16 scales set to small finite values (K_SCALES) so the weights stay of order 0.1-1."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = data.reshape(-1, size)
    offsets, magnitude = K_SCALES[qtype.name]
    for offset in offsets:
        scale = (rng.uniform(0.5, 1.5, len(blocks)) * magnitude).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: HF row (h, j, r) (j: which half of the head) goes to (h, r, j)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_tokenizer_meta():
    """(tokens, merges, token types) of a BPE trained on TEXT plus the two ChatML markers (type 3)."""
    hf = train_tokenizer(TEXT, "bpe", 260).hf
    model = json.loads(hf.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + list(MARKERS)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, [1] * (len(tokens) - len(MARKERS)) + [3] * len(MARKERS)


def hf_tensors(vocab: int, seed: int = 0, dim: int = DIM, head: int = HEAD, ffn: int = FFN) -> dict:
    """Random HF Llama tensors ([out, in] layout) for the tiny shape (or the widths given), float32."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(vocab, dim), "model.norm.weight": 1 + w(dim),
           "lm_head.weight": w(vocab, dim)}
    for i in range(BLOCKS):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": 1 + w(dim), p + "post_attention_layernorm.weight": 1 + w(dim),
                    p + "self_attn.q_proj.weight": w(HEADS * head, dim),
                    p + "self_attn.k_proj.weight": w(KV_HEADS * head, dim),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * head, dim),
                    p + "self_attn.o_proj.weight": w(dim, HEADS * head),
                    p + "mlp.gate_proj.weight": w(ffn, dim), p + "mlp.up_proj.weight": w(ffn, dim),
                    p + "mlp.down_proj.weight": w(dim, ffn)})
    return out


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest[: -len('.weight')]]}.weight"


def write_tiny_gguf(path, qtype=gguf.GGMLQuantizationType.F32, arch: str = "llama", raw_override=None,
                    tied: bool = False, wide: bool = False, tensor_types=None) -> dict:
    """Write the tiny model to ``path``; matrices in ``qtype`` (norms stay F32; K-quants and IQ4 as random
    valid blocks; F16 as float16), or the type ``tensor_types`` gives their GGUF name ({"token_embd.weight": Q8_0}).
    raw_override: (GGUF tensor name, raw qtype) whose bytes are written as that type unchanged (zeros), or
    (name, qtype, bytes) written as given. tied: no output.weight (the head is the embedding). wide: the WIDE
    widths. Returns the HF tensors it started from (what F32 / gguf-quantized matrices were made from; K-quant
    blocks are random instead)."""
    tokens, merges, types = tiny_tokenizer_meta()
    dims = WIDE if wide else dict(dim=DIM, head=HEAD, ffn=FFN)
    tensors = hf_tensors(len(tokens), **dims)
    if tied:
        del tensors["lm_head.weight"]
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(BLOCKS)
    w.add_context_length(128)
    w.add_embedding_length(dims["dim"])
    w.add_feed_forward_length(dims["ffn"])
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(dims["head"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_eos_token_id(tokens.index(MARKERS[1]))
    w.add_bos_token_id(tokens.index(MARKERS[0]))
    w.add_chat_template(CHATML)
    for name, array in tensors.items():
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, HEADS)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, KV_HEADS)
        target = gguf_name(name)
        kind = (tensor_types or {}).get(target, qtype)
        if raw_override and raw_override[0] == target:
            block, size = gguf.GGML_QUANT_SIZES[raw_override[1]]
            raw = raw_override[2] if len(raw_override) > 2 else np.zeros(
                (array.shape[0], array.shape[1] // block * size), np.uint8)
            w.add_tensor(target, raw, raw_dtype=raw_override[1])
        elif array.ndim == 2 and kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(target, array.astype(np.float16))
        elif array.ndim == 2 and kind.name in RANDOM_BLOCKS:
            w.add_tensor(target, random_blocks(kind, *array.shape, rng), raw_dtype=kind)
        elif array.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(target, quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(target, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors
