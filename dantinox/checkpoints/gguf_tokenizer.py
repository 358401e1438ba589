"""GGUF tokenizer metadata -> a Hugging Face ``tokenizers`` tokenizer (the tokenizer.json of a run directory).

A GGUF file carries its tokenizer as metadata (llama.cpp's GGUF specification, "Tokenizer" keys):
  tokenizer.ggml.model        "gpt2" for byte-level BPE, "llama" for SentencePiece (``gguf_sentencepiece``);
                              another kind ("bert", "t5", "rwkv", ...) is refused naming the key
  tokenizer.ggml.tokens       the vocabulary, token i at index i
  tokenizer.ggml.merges       BPE merges, "left right" in priority order
  tokenizer.ggml.token_type   1 normal, 2 unknown, 3 control (special), 4 user-defined, 5 unused, 6 byte
  tokenizer.ggml.pre          the pre-tokenizer llama.cpp applies before BPE (how text is split into words)
  tokenizer.ggml.bos_token_id / eos_token_id / unknown_token_id / padding_token_id
  tokenizer.chat_template     the Jinja chat template (the same text as tokenizer_config.json's)

For "gpt2" the result is a BPE model over the same vocabulary and merges with the ByteLevel decoder, the
pre-tokenizer that ``tokenizer.ggml.pre`` names (PRE_TOKENIZERS: the split each model's own tokenizer.json
applies before the byte-level BPE; the regular expressions are the ones those files publish), and every
control token (type 3) as a special added token, so a chat template's markers (``<|im_start|>``) encode to one
id each, as in the model's original tokenizer.json.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .errors import CheckpointError
from .gguf_sentencepiece import SentencePieceError, sentencepiece_tokenizer

CONTROL, USER_DEFINED = 3, 4
KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}   # tokenizer.ggml.model values read here
# Word splits published in the models' tokenizer.json files: Qwen2 / Qwen2.5 / Qwen3 (one digit per word) and
# Llama 3 (up to three digits per word).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _digits_then_bytelevel():
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _bytelevel():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytelevel(pattern: str):
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> pre-tokenizer. "smollm": every digit alone, then GPT-2's word regex (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_SMOLLM; the same as SmolLM2's own tokenizer.json). "gpt-2" / "default": GPT-2's regex.
# "qwen2" (Qwen2, Qwen2.5, Qwen3, DeepSeek-R1's Qwen distills) and "llama-bpe" / "llama3" / "llama-v3"
# (Llama 3.x): their tokenizer.json's Split, then byte-level without a regex.
PRE_TOKENIZERS = {"smollm": _digits_then_bytelevel, "gpt-2": _bytelevel, "default": _bytelevel,
                  "qwen2": _split_then_bytelevel(QWEN2_SPLIT), "deepseek-r1-qwen": _split_then_bytelevel(QWEN2_SPLIT),
                  "llama-bpe": _split_then_bytelevel(LLAMA3_SPLIT), "llama3": _split_then_bytelevel(LLAMA3_SPLIT),
                  "llama-v3": _split_then_bytelevel(LLAMA3_SPLIT)}
NFC_PRE = ("qwen2", "deepseek-r1-qwen")   # Qwen's tokenizer.json normalizes to NFC first
WHOLE_WORDS = ("llama-bpe", "llama3", "llama-v3")   # Llama 3's BPE takes a word in the vocabulary whole
                                                    # (its tokenizer.json's ignore_merges)


class GGUFTokenizerError(CheckpointError):
    """The GGUF tokenizer metadata is missing, inconsistent, or of a kind this converter does not read."""


def check_tokenizer_kind(kind) -> None:
    """GGUFTokenizerError naming tokenizer.ggml.model unless ``kind`` is one of KINDS."""
    if kind not in KINDS:
        allowed = ", ".join(f"{k!r} ({v})" for k, v in KINDS.items())
        raise GGUFTokenizerError(f"tokenizer.ggml.model={kind!r} is not supported: {allowed}")


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    """Build the tokenizer a GGUF file describes.

    meta: the file's metadata as plain Python values (key -> str / int / list), from
      ``dantinox.checkpoints.gguf_source.read_metadata``.
    Returns a ``tokenizers.Tokenizer`` (byte-level BPE, or SentencePiece's BPE with byte fallback) with
    V = len(tokenizer.ggml.tokens) ids.
    Raises GGUFTokenizerError naming the key: no tokenizer, a tokenizer.ggml.model other than KINDS, an
      unknown tokenizer.ggml.pre, merges that are not "left right" pairs, token_type or scores of another length.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise GGUFTokenizerError("the GGUF file has no tokenizer (no tokenizer.ggml.model key)")
    check_tokenizer_kind(kind)
    if kind == "llama":
        try:
            return sentencepiece_tokenizer(meta)
        except SentencePieceError as err:
            raise GGUFTokenizerError(str(err)) from None
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(f"tokenizer.ggml.pre={pre!r} is not supported: one of {sorted(PRE_TOKENIZERS)}")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFTokenizerError("tokenizer.ggml.tokens is missing or empty")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    merges = []
    for i, merge in enumerate(meta.get("tokenizer.ggml.merges") or []):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise GGUFTokenizerError(f"tokenizer.ggml.merges[{i}]={merge!r} is not a 'left right' pair")
        merges.append((pair[0], pair[1]))
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                              ignore_merges=pre in WHOLE_WORDS))
    hf.pre_tokenizer = PRE_TOKENIZERS[pre]()
    if pre in NFC_PRE:
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, kind_ in zip(tokens, types) if kind_ == CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED])
    return hf


def tokenizer_json(meta: dict) -> str:
    """The tokenizer.json text of :func:`tokenizer_from_gguf` (pretty-printed, round-trips through
    ``tokenizers.Tokenizer.from_str``)."""
    return json.dumps(json.loads(tokenizer_from_gguf(meta).to_str()), indent=2, ensure_ascii=False)
