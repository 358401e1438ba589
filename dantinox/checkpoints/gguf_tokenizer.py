"""GGUF tokenizer metadata -> a Hugging Face ``tokenizers`` tokenizer (the tokenizer.json of a run directory).

A GGUF file carries its tokenizer as metadata (llama.cpp's GGUF specification, "Tokenizer" keys):
  tokenizer.ggml.model        "gpt2" for byte-level BPE (the only kind read here; "llama" is SentencePiece)
  tokenizer.ggml.tokens       the vocabulary, token i at index i
  tokenizer.ggml.merges       BPE merges, "left right" in priority order
  tokenizer.ggml.token_type   1 normal, 2 unknown, 3 control (special), 4 user-defined, 5 unused, 6 byte
  tokenizer.ggml.pre          the pre-tokenizer llama.cpp applies before BPE (how text is split into words)
  tokenizer.ggml.bos_token_id / eos_token_id / unknown_token_id / padding_token_id
  tokenizer.chat_template     the Jinja chat template (the same text as tokenizer_config.json's)

The result is a BPE model over the same vocabulary and merges with the ByteLevel decoder, the pre-tokenizer
that ``tokenizer.ggml.pre`` names, and every control token (type 3) as a special added token, so a chat
template's markers (``<|im_start|>``) encode to one id each, as in the model's original tokenizer.json.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4


def _digits_then_bytelevel():
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _bytelevel():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> pre-tokenizer. "smollm": every digit alone, then GPT-2's word regex (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_SMOLLM; the same as SmolLM2's own tokenizer.json). "gpt-2" / "default": GPT-2's regex.
PRE_TOKENIZERS = {"smollm": _digits_then_bytelevel, "gpt-2": _bytelevel, "default": _bytelevel}


class GGUFTokenizerError(CheckpointError):
    """The GGUF tokenizer metadata is missing, inconsistent, or of a kind this converter does not read."""


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    """Build the tokenizer a GGUF file describes.

    meta: the file's metadata as plain Python values (key -> str / int / list), from
      ``dantinox.checkpoints.gguf_source.read_metadata``.
    Returns a ``tokenizers.Tokenizer`` (byte-level BPE) with V = len(tokenizer.ggml.tokens) ids.
    Raises GGUFTokenizerError naming the key: no tokenizer, a tokenizer.ggml.model other than "gpt2", an
      unknown tokenizer.ggml.pre, merges that are not "left right" pairs, token_type of another length.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise GGUFTokenizerError("the GGUF file has no tokenizer (no tokenizer.ggml.model key)")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"tokenizer.ggml.model={kind!r} is not supported: only 'gpt2' (byte-level BPE)")
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
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = PRE_TOKENIZERS[pre]()
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
