"""The token ids that end generation (end of turn, end of text), read from a run directory.

A chat model ends its turn with a token that its files name in up to three places: generation_config.json
(``eos_token_id``, one id or a list), tokenizer_config.json (``eos_token``, a text) and, in a GGUF file,
``tokenizer.ggml.eos_token_id`` / ``eot_token_id`` / ``eom_token_id``. ``dantinox import`` merges all of them
(``merge_stop_ids``) into the run directory's generation_config.json as ``eos_token_ids`` and keeps the special
token texts in its tokenizer_config.json. :func:`read_stop_ids` reads, in this order and without repeats:

  generation_config.json  ``eos_token_ids`` (the importer's merged list), then ``eos_token_id`` (an int or a
                          list, as Hugging Face writes it)
  tokenizer_config.json   ``eos_token`` (text, or {"content": text}) -> its id, when the tokenizer holds it

so a run imported before the merge existed still stops at its tokenizer's eos_token, and a trained run (none of
these files) has no stop ids: it generates to max_new_tokens. Generation (``Generator``, ``dantinox generate``,
``/v1/completions``, ``/v1/chat/completions``) stops at any of them unless asked to ignore them (``ignore_eos``).
"""

from __future__ import annotations

import json
import os

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def read_json_object(path: str) -> dict:
    """The JSON object in ``path``; {} when the file is absent or holds no object. Raises ValueError naming the
    file when it is not readable JSON."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json gives it (text, or {"content": text}) -> its text, or None."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def id_list(value) -> list:
    """An ``eos_token_id`` value (None, one id, or a list of ids) as a list (anything else as a list of itself,
    for the caller's check to name)."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def merge_stop_ids(vocab_size: int, *groups, where: str = "eos_token_id") -> list[int]:
    """The ids of ``groups`` (each None, one id, or a list of ids) in order, without repeats.

    Raises ValueError naming ``where`` when an id is not an integer in [0, vocab_size)."""
    out = []
    for group in groups:
        for value in id_list(group):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
                raise ValueError(f"{where} {value!r} is not a token id in [0, {vocab_size})")
            out.append(value)
    return list(dict.fromkeys(out))


def read_stop_ids(run_dir: str | os.PathLike, tokenizer) -> tuple[int, ...]:
    """The stop ids of ``run_dir`` (see the module docstring); () when it names none.

    tokenizer: the run's TextTokenizer (V and the id of the eos_token text).
    Raises ValueError naming the file for unreadable JSON or an id outside [0, V).
    """
    run_dir = os.fspath(run_dir)
    path = os.path.join(run_dir, GENERATION_CONFIG)
    generation = read_json_object(path)
    ids = merge_stop_ids(tokenizer.vocab_size, generation.get("eos_token_ids"), generation.get("eos_token_id"),
                         where=f"{path}: eos_token_id")
    eos = token_text(read_json_object(os.path.join(run_dir, TOKENIZER_CONFIG)).get("eos_token"))
    eos_id = tokenizer.hf.token_to_id(eos) if eos is not None else None
    if eos_id is not None and eos_id not in ids:
        ids.append(eos_id)
    return tuple(ids)


def describe_stop_ids(ids, tokenizer) -> str:
    """'2 (<|im_end|>), 0 (<|endoftext|>)' for a log line; 'none' for no ids."""
    return ", ".join(f"{i} ({tokenizer.hf.id_to_token(i)})" for i in ids) or "none"
