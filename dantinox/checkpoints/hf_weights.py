"""Hugging Face tensors (transformers' names and [out, in] layouts) -> the dantinox parameter tree.

Names and layouts on the dantinox side are the run directory's (``blocks.N.attn.qkv.kernel`` ...; nnx.Linear
kernels are [in, out], the transpose of torch's ``weight``). Per block N, with HF prefix ``model.layers.N.``:

  input_layernorm.weight, post_attention_layernorm.weight   -> attn_norm.scale, mlp_norm.scale
  Gemma (cfg.sandwich_norms): input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
                post_feedforward_layernorm                  -> attn_norm, attn_post_norm, mlp_norm, mlp_post_norm
                                                               (.scale); every Gemma norm (these, q_norm, k_norm,
                                                               model.norm) stored as 1 + w (spec.norm_offset)
  mlp.gate_proj / up_proj / down_proj                       -> mlp.gate_up.kernel [E, 2F] (gate columns first),
                                                               mlp.down.kernel [F, E]
  (Phi-3: mlp.gate_up_proj [2F, E], gate rows first)        -> mlp.gate_up.kernel as one matrix
  Llama family and Gemma: self_attn.q_proj, k_proj, v_proj -> attn.qkv.kernel [E, (H + 2K) D] (q | k | v);
                (Qwen2 biases -> attn.qkv.bias), o_proj      -> attn.out.kernel; Qwen3 q_norm, k_norm -> attn.q_norm,
                                                               attn.k_norm (.scale)
  Phi-3:        self_attn.qkv_proj [(H + 2K) D, E] (q | k | v rows) -> attn.qkv.kernel as one matrix
  DeepSeek MLA: q_a_proj + kv_a_proj_with_mqa               -> attn.down.kernel [E, Q + C + R]
                q_a_layernorm, kv_a_layernorm               -> attn.q_norm, attn.kv_norm
                q_b_proj (or q_proj)                        -> attn.q_up.kernel [Q or E, H (D + R)]
                kv_b_proj [H (D + Dv), C]                   -> attn.w_uk [H, D, C], attn.w_uv [H, C, Dv]
                o_proj                                      -> attn.out.kernel [H Dv, E]
  model.embed_tokens, model.norm, lm_head (untied only)     -> embed.embedding, final_norm.scale, lm_head.kernel

Interleaved RoPE (DeepSeek): the checkpoint rotates pairs (2i, 2i + 1); the query's and the RoPE key's rotary
output rows are permuted to [0, 2, 4, ..., 1, 3, 5, ...], after which dantinox's rotate-half RoPE computes the
same rotation (scores are dot products, so the order of the rotary dims does not matter otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..quant.block_formats import BlockMatrix
from .errors import CheckpointError
from .hf_config import ImportSpec

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some old checkpoints saved; recomputed from the config


@dataclass(frozen=True, eq=False)
class BlockParts:
    """A parameter kept as stored blocks (a GGUF import): the matrix W [N, M] of one projection or of the
    embedding as row-wise parts (``BlockMatrix``, "F32" for float rows); ``shape`` is the float parameter's
    shape it stands for ([M, N] for a kernel, [V, E] for the embedding), checked against the model."""

    parts: tuple[BlockMatrix, ...]
    shape: tuple[int, int]

    @property
    def size(self) -> int:
        """Weights the matrix holds (its logical element count, as a float parameter's ``size``)."""
        return int(self.shape[0] * self.shape[1])


def _as_part(array) -> BlockMatrix:
    """A float kernel [M, N] as one "F32" BlockMatrix of rows [N, M]."""
    a = np.ascontiguousarray(np.asarray(array, np.float32).T)
    return BlockMatrix("F32", a, a.shape[0], a.shape[1])


def concat_columns(kernels: list) -> np.ndarray | BlockParts:
    """Kernels [M, N_i] side by side -> [M, sum N_i]; when any is a BlockParts, a BlockParts of all the parts
    (float kernels become "F32" parts) in the same order, neighbouring parts of one format merged into one
    (their rows stacked: one kernel call instead of several)."""
    if not any(isinstance(k, BlockParts) for k in kernels):
        return np.concatenate(kernels, axis=1)
    parts: list[BlockMatrix] = []
    for part in (p for k in kernels for p in (k.parts if isinstance(k, BlockParts) else (_as_part(k),))):
        if parts and parts[-1].fmt == part.fmt:  # neighbours of one format: one matrix (its rows stacked)
            last = parts.pop()
            part = BlockMatrix(part.fmt, np.concatenate([last.data, part.data]), last.n_out + part.n_out, part.n_in)
        parts.append(part)
    return BlockParts(tuple(parts), (kernels[0].shape[0], sum(p.n_out for p in parts)))


class _Tensors:
    """The HF tensors, taken by name with the expected shape checked; remembers what was used."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors, self.used = tensors, set()

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name} is missing (expected shape {list(shape)})")
        found = self.tensors[name]
        found_shape = (found.n_out, found.n_in) if isinstance(found, BlockMatrix) else np.shape(found)
        if tuple(found_shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {list(found_shape)}; the config expects "
                                  f"{list(shape)}")
        self.used.add(name)
        if isinstance(found, BlockMatrix):
            return BlockParts((found,), tuple(shape))
        return np.asarray(found).astype(np.float32)

    def linear(self, name: str, n_out: int, n_in: int) -> np.ndarray | BlockParts:
        """A torch Linear weight [out, in] as an nnx kernel [in, out] (a BlockParts of shape [in, out] when
        the tensor is a BlockMatrix: the blocks keep their [out, in] rows)."""
        weight = self.take(f"{name}.weight", (n_out, n_in))
        if isinstance(weight, BlockParts):
            return BlockParts(weight.parts, (n_in, n_out))
        return np.ascontiguousarray(weight.T)

    def norm(self, name: str, size: int, offset: float) -> np.ndarray:
        """An RMSNorm weight [size] as the scale dantinox multiplies by: the stored w, or offset + w in float32
        (Gemma's 1 + w, the value its RMSNorm computes)."""
        weight = self.take(name, (size,))
        return weight + np.float32(offset) if offset else weight

    def leftover(self) -> list[str]:
        return sorted(n for n in self.tensors if n not in self.used and not n.endswith(IGNORED_SUFFIXES))


def convert_weights(tensors: Mapping[str, np.ndarray], spec: ImportSpec) -> dict[str, np.ndarray]:
    """The dantinox parameter arrays (float32, run-directory names) for ``spec.cfg`` from HF-named tensors.

    tensors: name -> array in any float dtype numpy can cast to float32 (bfloat16 through ml_dtypes), or a
      ``BlockMatrix`` (a GGUF import keeping its blocks): the embedding, the output head and the Llama family's
      projections then become ``BlockParts`` values (fused q | k | v and gate | up as several parts).
    Raises CheckpointError naming the tensor: missing, a shape that disagrees with the config (expected and
    found), a tensor dantinox has no parameter for (for example a mixture-of-experts weight), or an lm_head
    that differs from the embedding in a checkpoint whose config ties them.
    """
    cfg, src = spec.cfg, _Tensors(tensors)
    E, V = cfg.dim, cfg.vocab_size
    out = {"embed.embedding": src.take("model.embed_tokens.weight", (V, E)),
           "final_norm.scale": src.norm("model.norm.weight", E, spec.norm_offset)}
    if not cfg.tie_embeddings:
        out["lm_head.kernel"] = src.linear("lm_head", V, E)
    elif "lm_head.weight" in tensors:
        head, table = tensors["lm_head.weight"], out["embed.embedding"]
        if isinstance(head, BlockMatrix) or isinstance(table, BlockParts):
            first = table.parts[0] if isinstance(table, BlockParts) else None
            same = (isinstance(head, BlockMatrix) and first is not None and head.fmt == first.fmt
                    and np.array_equal(head.data, first.data))
        else:
            same = np.array_equal(np.asarray(head, np.float32), table)
        if not same:
            raise CheckpointError("tensor lm_head.weight differs from model.embed_tokens.weight but config.json "
                                  "has tie_word_embeddings=true")
        src.used.add("lm_head.weight")
    for n in range(cfg.num_blocks):
        p, q = f"model.layers.{n}.", f"blocks.{n}."
        out.update({q + k: v for k, v in _norms(src, p, spec).items()})
        F = cfg.mlp_hidden
        if p + "mlp.gate_up_proj.weight" in tensors:   # Phi-3's fused gate | up rows
            out[q + "mlp.gate_up.kernel"] = src.linear(p + "mlp.gate_up_proj", 2 * F, E)
        else:
            out[q + "mlp.gate_up.kernel"] = concat_columns(
                [src.linear(p + "mlp.gate_proj", F, E), src.linear(p + "mlp.up_proj", F, E)])
        out[q + "mlp.down.kernel"] = src.linear(p + "mlp.down_proj", E, F)
        attention = _mla_block if cfg.attention == "mla" else _gqa_block
        out.update({q + k: v for k, v in attention(src, p + "self_attn.", spec).items()})
    extra = src.leftover()
    if extra:
        raise CheckpointError(f"tensor {extra[0]} has no place in a {spec.architecture} model built from "
                              f"config.json ({len(extra)} such tensor(s)); the config and weights disagree")
    return out


def _norms(src: _Tensors, p: str, spec: ImportSpec) -> dict[str, np.ndarray]:
    """One block's RMSNorm scales: two (pre-attention, pre-MLP), or Gemma's four (module docstring)."""
    E, offset = spec.cfg.dim, spec.norm_offset
    names = ({"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
              "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
             if spec.cfg.sandwich_norms else {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"})
    return {f"{ours}.scale": src.norm(f"{p}{theirs}.weight", E, offset) for ours, theirs in names.items()}


def _gqa_block(src: _Tensors, p: str, spec: ImportSpec) -> dict[str, np.ndarray]:
    """One Llama / Mistral / Qwen2 / Qwen3 / Phi-3 attention: fused qkv (+ bias), out, optional per-head norms."""
    cfg = spec.cfg
    E, H, K, D = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_size
    parts = [("q_proj", H * D), ("k_proj", K * D), ("v_proj", K * D)]
    if p + "qkv_proj.weight" in src.tensors:   # Phi-3: already q | k | v rows
        qkv = src.linear(p + "qkv_proj", (H + 2 * K) * D, E)
    else:
        qkv = concat_columns([src.linear(p + name, w, E) for name, w in parts])
    out = {"attn.qkv.kernel": qkv, "attn.out.kernel": src.linear(p + "o_proj", E, H * D)}
    if cfg.qkv_bias:
        out["attn.qkv.bias"] = np.concatenate([src.take(f"{p}{name}.bias", (w,)) for name, w in parts])
    if cfg.qk_norm:
        out["attn.q_norm.scale"] = src.norm(p + "q_norm.weight", D, spec.norm_offset)
        out["attn.k_norm.scale"] = src.norm(p + "k_norm.weight", D, spec.norm_offset)
    return out


def deinterleave(R: int) -> np.ndarray:
    """Row order that turns interleaved rotary pairs (2i, 2i + 1) into halves (i, i + R/2): [0, 2, .., 1, 3, ..]."""
    return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def _mla_block(src: _Tensors, p: str, spec: ImportSpec) -> dict[str, np.ndarray]:
    """One DeepSeek-V2/V3 multi-head latent attention (see the module docstring for the mapping)."""
    cfg = spec.cfg
    if any(isinstance(t, BlockMatrix) for n, t in src.tensors.items() if n.startswith(p)):
        raise CheckpointError(f"{p}*: block-quantized weights are not supported for multi-head latent attention")
    E, H, D, R, C, Dv = cfg.dim, cfg.n_heads, cfg.head_size, cfg.rope_head_dim, cfg.kv_latent_dim, cfg.value_size
    Q = cfg.q_latent_dim or 0
    order = deinterleave(R) if spec.rope_interleaved else np.arange(R)
    kv_a = src.linear(p + "kv_a_proj_with_mqa", C + R, E)                          # [E, C + R]
    kv_a = np.concatenate([kv_a[:, :C], kv_a[:, C:][:, order]], axis=1)
    out = {"attn.kv_norm.scale": src.take(p + "kv_a_layernorm.weight", (C,))}
    if Q:
        out["attn.down.kernel"] = np.concatenate([src.linear(p + "q_a_proj", Q, E), kv_a], axis=1)
        out["attn.q_norm.scale"] = src.take(p + "q_a_layernorm.weight", (Q,))
        q_up = src.linear(p + "q_b_proj", H * (D + R), Q)
    else:
        out["attn.down.kernel"] = kv_a
        q_up = src.linear(p + "q_proj", H * (D + R), E)
    per_head = np.concatenate([np.arange(D), D + order])                             # within one head's D + R
    cols = (np.arange(H)[:, None] * (D + R) + per_head[None]).reshape(-1)
    out["attn.q_up.kernel"] = np.ascontiguousarray(q_up[:, cols])
    kv_b = src.take(p + "kv_b_proj.weight", (H * (D + Dv), C)).reshape(H, D + Dv, C)
    out["attn.w_uk"] = np.ascontiguousarray(kv_b[:, :D, :])                          # [H, D, C]
    out["attn.w_uv"] = np.ascontiguousarray(kv_b[:, D:, :].transpose(0, 2, 1))      # [H, C, Dv]
    out["attn.out.kernel"] = src.linear(p + "o_proj", E, H * Dv)
    return out
