"""Build the tiny random Hugging Face checkpoints of tests/fixtures/parity/ and record transformers' logits.

Runs in its own virtual environment with torch (CPU) and transformers; dantinox does not need either:

    python3 -m venv /tmp/venv-ref && /tmp/venv-ref/bin/pip install torch transformers safetensors
    /tmp/venv-ref/bin/python tools/make_parity_fixtures.py [--out tests/fixtures/parity] [--only llama3 ...]

For each architecture it builds a 2-layer model with transformers, draws every parameter at random (norm
weights around 1, biases nonzero, so a mapping mistake shows), saves it with ``save_pretrained`` (safetensors,
float32) together with a byte-level BPE tokenizer (256 byte tokens plus two chat specials) and a ChatML chat
template, then records, in float32 with the eager attention:

  reference.json         prompt ids, the 20 greedy tokens (argmax of the uncached forward, one token at a time),
                         transformers and torch versions, the fixture's features
  reference_logits.npy   [T, V]: the uncached forward over prompt + the first 19 greedy tokens (the
                         positions whose argmax gave the greedy tokens), float32

tests/checkpoints/test_parity_fixtures.py imports each directory with ``dantinox import`` and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PROMPT = "The capital of France is"
NEW_TOKENS = 20
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COMMON = dict(num_hidden_layers=2, max_position_embeddings=64, attn_implementation="eager")

# name -> (config class, kwargs, what the fixture exercises)
FIXTURES = {
    "llama": ("LlamaConfig", dict(vocab_size=258, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                  num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                  rope_theta=10000.0),
              "MHA, tied embeddings, plain RoPE"),
    "llama3": ("LlamaConfig", dict(vocab_size=258, hidden_size=48, head_dim=16, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=32)),
               "GQA 4/2, head_dim 16 != 48/4, untied head, rope_scaling llama3"),
    "qwen2": ("Qwen2Config", dict(vocab_size=264, hidden_size=64, intermediate_size=112, num_attention_heads=4,
                                  num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  rope_theta=1000000.0),
              "bias on q, k, v; GQA 4/2; embedding rows beyond the tokenizer (264 > 258)"),
    "mistral": ("MistralConfig", dict(vocab_size=258, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, sliding_window=8, rope_theta=10000.0),
                "sliding window 8 < sequence 43, MQA"),
    "qwen3": ("Qwen3Config", dict(vocab_size=258, hidden_size=48, head_dim=24, intermediate_size=96,
                                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                  tie_word_embeddings=True, rope_theta=1000000.0,
                                  rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                    original_max_position_embeddings=16)),
              "RMSNorm on q and k per head, head_dim 24 != 48/4, tied, rope_scaling yarn"),
    "gemma3": ("Gemma3TextConfig", dict(vocab_size=258, hidden_size=32, head_dim=8, intermediate_size=48,
                                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True, query_pre_attn_scalar=24, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"],
                                        final_logit_softcapping=2.0,
                                        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                                                rope_theta=1000000.0),
                                                         "sliding_attention": dict(rope_type="default",
                                                                                   rope_theta=10000.0)}),
               "Gemma 3: sliding window 8 < sequence 43 on layer 0, global layer 1 with linear rope scaling and "
               "its own base, QK norm, four (1 + w) norms, GeGLU, scaled embeddings, query scalar 24 != head_dim "
               "8, final-logit soft-capping 2, tied"),
    "deepseek_v2": ("DeepseekV2Config", dict(vocab_size=258, hidden_size=64, intermediate_size=96,
                                             moe_intermediate_size=32, num_attention_heads=4,
                                             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                             first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
                                             rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                                             rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                               original_max_position_embeddings=16, mscale=1.0,
                                                               mscale_all_dim=0.5, beta_fast=32, beta_slow=1)),
                    "MLA without query compression, interleaved RoPE (complex form), yarn with mscale_all_dim"),
    "deepseek_v3": ("DeepseekV3Config", dict(vocab_size=258, hidden_size=64, intermediate_size=96,
                                             moe_intermediate_size=32, num_attention_heads=4,
                                             num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                             first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
                                             rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
                                             rope_interleave=True),
                    "MLA with q_lora_rank, v_head_dim 12 != qk_nope 16, rms_norm_eps 1e-5 (latent norms 1e-6)"),
}


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE with the 256 byte symbols and no merges, plus <|im_start|> (256) and <|im_end|> (257)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML
    return fast


# fixtures whose embeddings are drawn smaller (Gemma multiplies them by sqrt(hidden_size) = 5.7 here: at 0.3 the tied
# model echoes its last token)
EMBED_STD = {"gemma3": 0.05}


def randomize(model: torch.nn.Module, seed: int, embed_std: float = 0.3) -> None:
    """Every parameter drawn anew: norm weights 1 + N(0, 0.2), biases N(0, 0.1), embeddings and head
    N(0, embed_std), other matrices N(0, 1/fan_in) (a small embedding keeps a tied model from echoing its last
    token)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                p.copy_(embed_std * noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)


def build(name: str, out_dir: str, seed: int) -> dict:
    cls_name, kwargs, features = FIXTURES[name]
    tokenizer = byte_tokenizer()
    config = getattr(transformers, cls_name)(**COMMON, **kwargs, bos_token_id=None, eos_token_id=257,
                                             pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed, EMBED_STD.get(name, 0.3))
    path = os.path.join(out_dir, name)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    prompt = tokenizer(PROMPT)["input_ids"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
        full = model(torch.tensor([ids[:-1]])).logits[0].float().contiguous()
    np.save(os.path.join(path, "reference_logits.npy"), full.numpy())
    ref = {"prompt": PROMPT, "prompt_ids": prompt, "greedy_tokens": ids[len(prompt):],
           "architecture": model.config.architectures[0], "features": features,
           "transformers": transformers.__version__, "torch": torch.__version__, "seed": seed}
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(ref, f, indent=2)
    return ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("tests", "fixtures", "parity"))
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(FIXTURES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.only or FIXTURES:
        ref = build(name, args.out, seed=list(FIXTURES).index(name))
        size = sum(os.path.getsize(os.path.join(args.out, name, f)) for f in os.listdir(os.path.join(args.out, name)))
        print(f"{name:12s} {ref['architecture']:24s} {size / 1e3:7.1f} kB  greedy {ref['greedy_tokens'][:8]}...")


if __name__ == "__main__":
    main()
