"""Tokenizers from GGUF metadata against independent references.

Default tier: a small SentencePiece vocabulary (byte pieces, control and user-defined pieces, scores) encoded by
``tokenizer_from_gguf`` and by a direct implementation of SentencePiece's BPE encoding written here (escape
spaces as U+2581 after the optional prefix, merge the adjacent pair whose concatenation is the highest-scoring
piece, leftmost first, until none is left; a character outside the vocabulary becomes its UTF-8 byte pieces;
a user-defined piece is matched whole in the raw text, the stretches between encoded on their own):
the same ids for every text, and decoding gives the text back (but for the space a user-defined piece adds
after it, as in llama.cpp). Bad input: scores of another length, an unknown id outside the vocabulary.

Slow tier: llama.cpp's tokenizer test vocabularies (``ggml-vocab-NAME.gguf`` with ``.inp`` texts and ``.out``
ids, which llama.cpp records from each model's own Hugging Face tokenizer) from the directory named by
``DANTINOX_LLAMA_CPP_VOCABS`` (llama.cpp's ``models/``), skipped when it is absent: Llama 2 and Phi-3
(SentencePiece), Qwen2 and Llama 3 (byte-level BPE with their own pre-tokenizers)."""

from __future__ import annotations

import os

import pytest

from dantinox.checkpoints.gguf_source import read_metadata
from dantinox.checkpoints.gguf_tokenizer import GGUFTokenizerError, tokenizer_from_gguf, tokenizer_json
from dantinox.runs.tokenizer import TextTokenizer

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
MERGED = ["th", SPACE + "t", SPACE + "th", "he", SPACE + "the", "in", "an", "er", SPACE + "a", "and", SPACE + "and",
          "ing", SPACE + "in", "on", SPACE + "w", "at", "en", "es", SPACE + "s", "ll", "ell", "ello", SPACE + "h",
          SPACE + "hello", SPACE + "o", "or", SPACE + "or", "ld", "rld", "orld", SPACE + "world", SPACE + SPACE,
          SPACE + SPACE + SPACE, "ca", "cat", SPACE + "cat", "ts", "ats"]
TEXTS = ["the cat and the hat", " Hello world", "hello  world   again", "Ünïcödé and 🦙 spaces",
         "tab\there\nnewline", "", " ", "   leading spaces", "cats cats cats", "the theory of the world",
         "inside wxyzw", "a xyz b", "axyzb"]


def spm_meta(prefix: bool = True) -> dict:
    """A SentencePiece vocabulary as llama.cpp's converter stores one: <unk>, <s>, </s>, 256 byte pieces, the
    single characters, MERGED (scores: earlier is higher) and one user-defined piece "xyz"."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    chars = sorted(set("".join(MERGED)) | set("abcdefghijklmnopqrstuvwxyz"))
    for i, piece in enumerate(chars + MERGED):
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(-1000.0 - i if len(piece) == 1 else -float(MERGED.index(piece)))
    tokens.append("xyz")
    types.append(USER_DEFINED)
    scores.append(0.0)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_space_prefix": prefix}


def spm_reference(meta: dict, text: str) -> list[int]:
    """SentencePiece's BPE encoding of ``text`` (module docstring). The user-defined piece is matched whole in
    the raw text first and each stretch between is encoded on its own (with its own space prefix), as llama.cpp
    partitions a text at its special and user-defined tokens."""
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == NORMAL}
    user = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == USER_DEFINED}
    ids = []
    for n, part in enumerate(text.split("xyz")):   # the one user-defined piece
        if n:
            ids.append(user["xyz"])
        if not part:
            continue
        symbols = list((SPACE if meta["tokenizer.ggml.add_space_prefix"] else "") + part.replace(" ", SPACE))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                merged = symbols[i] + symbols[i + 1]
                if merged in normal and (best is None or scores[normal[merged]] > best[0]):
                    best = (scores[normal[merged]], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            ids += [normal[s]] if s in normal else [tokens.index(f"<0x{b:02X}>") for b in s.encode("utf-8")]
    return ids


@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_sentencepiece_encodes_as_sentencepiece_and_decodes_back(prefix):
    meta = spm_meta(prefix)
    hf = tokenizer_from_gguf(meta)
    tokenizer = TextTokenizer.from_json(tokenizer_json(meta))
    assert tokenizer.vocab_size == len(meta["tokenizer.ggml.tokens"])
    for text in TEXTS:
        want = spm_reference(meta, text)
        assert hf.encode(text, add_special_tokens=False).ids == want, text
        assert tokenizer.encode(text) == want
        if "xyz" not in text:   # after a user-defined piece the next stretch has its own prefix (module docstring)
            assert tokenizer.decode(want) == text
    assert tokenizer.encode("<s>the cat</s>")[0] == 1 and tokenizer.encode("<s>the cat</s>")[-1] == 2
    assert {1, 2} <= tokenizer.special_ids


def test_sentencepiece_metadata_that_disagrees_names_the_key():
    meta = spm_meta()
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(GGUFTokenizerError, match="tokenizer.ggml.scores has 324 entries for 325 tokens"):
        tokenizer_from_gguf(meta)
    meta = spm_meta()
    meta["tokenizer.ggml.unknown_token_id"] = 9999
    with pytest.raises(GGUFTokenizerError, match="tokenizer.ggml.unknown_token_id=9999 is not an id"):
        tokenizer_from_gguf(meta)


VOCABS = os.environ.get("DANTINOX_LLAMA_CPP_VOCABS", "")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "qwen2", "llama-bpe"])
def test_real_vocabularies_give_the_hugging_face_ids(name):
    path = os.path.join(VOCABS, f"ggml-vocab-{name}.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is absent (set DANTINOX_LLAMA_CPP_VOCABS to llama.cpp's models/ directory)")
    import gguf

    hf = tokenizer_from_gguf(read_metadata(gguf.GGUFReader(path)))
    with open(path + ".inp", encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")
    with open(path + ".out", encoding="utf-8") as f:
        expected = [[int(i) for i in line.split()] for line in f.read().split("\n")]
    assert len(texts) == len(expected) > 40
    for text, want in zip(texts, expected):
        assert hf.encode(text, add_special_tokens=False).ids == want, repr(text)
