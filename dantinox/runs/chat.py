"""A run directory's chat settings: its template, its special tokens and the ids that end a turn.

An imported model's run directory (``dantinox import``) keeps the files that describe chatting with it:
  chat_template.jinja     the template (written by the importer when the checkpoint has one)
  generation_config.json  ``eos_token_ids`` (the importer's list) and/or ``eos_token_id`` (one id or a list, as
                          Hugging Face writes it): every id that ends the assistant's turn; ``bos_token_id``
  tokenizer_config.json   optional, as transformers writes it: ``chat_template`` (used when there is no
                          chat_template.jinja; a string, or a list of {"name", "template"} of which "default"
                          is used) and ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` (text, or
                          {"content": text}); without them bos_token and eos_token are the texts of
                          bos_token_id and of the first eos id
:func:`load_chat_format` reads them into a :class:`ChatFormat`; a run directory without a template gives None
(its model can complete text but cannot chat). Generation stops at any of ``stop_ids``: the generation
config's eos ids plus the tokenizer's eos_token (SmolLM2-Instruct: ``<|im_end|>``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .chat_template import ChatTemplate, ChatTemplateError

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class NoChatTemplateError(ValueError):
    """The model has no chat template, so a conversation cannot be turned into a prompt."""


@dataclass
class ChatFormat:
    """template: the compiled ChatTemplate; stop_ids: token ids that end the assistant's turn (first the
    generation config's, in order, then the eos_token's)."""

    template: ChatTemplate
    stop_ids: tuple

    def prompt_ids(self, messages, tokenizer) -> list[int]:
        """Render ``messages`` with add_generation_prompt and encode the text with ``tokenizer`` (a dantinox
        TextTokenizer; special tokens in the text become their ids). Raises ChatTemplateError naming the
        message field, or ValueError for an empty rendering."""
        text = self.template.render(messages, add_generation_prompt=True)
        if not text:
            raise ChatTemplateError("the chat template rendered an empty prompt")
        return tokenizer.encode(text)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value):
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_text(run_dir: str, config: dict):
    path = os.path.join(run_dir, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def load_chat_format(run_dir: str | os.PathLike, tokenizer) -> ChatFormat | None:
    """The chat settings of ``run_dir`` (see the module docstring), or None when it has no chat template.

    tokenizer: the run's TextTokenizer (to turn the eos_token text into its id).
    Raises ValueError naming the file for unreadable JSON, ChatTemplateError for a template that does not
    parse, and ValueError for an eos_token_id outside [0, V).
    """
    run_dir = os.fspath(run_dir)
    config = _read_json(os.path.join(run_dir, TOKENIZER_CONFIG))
    source = _template_text(run_dir, config)
    if source is None:
        return None
    special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
    generation = _read_json(os.path.join(run_dir, GENERATION_CONFIG))
    stops = []
    for key in ("eos_token_ids", "eos_token_id"):
        eos = generation.get(key)
        for value in ([] if eos is None else [eos] if isinstance(eos, int) else list(eos)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < tokenizer.vocab_size:
                raise ValueError(f"{os.path.join(run_dir, GENERATION_CONFIG)}: {key} {value!r} is not a token id "
                                 f"in [0, {tokenizer.vocab_size})")
            stops.append(value)
    if special["eos_token"] is not None and tokenizer.hf.token_to_id(special["eos_token"]) is not None:
        stops.append(tokenizer.hf.token_to_id(special["eos_token"]))
    if special["eos_token"] is None and stops:
        special["eos_token"] = tokenizer.hf.id_to_token(stops[0])
    bos = generation.get("bos_token_id")
    if special["bos_token"] is None and isinstance(bos, int) and 0 <= bos < tokenizer.vocab_size:
        special["bos_token"] = tokenizer.hf.id_to_token(bos)
    return ChatFormat(ChatTemplate(source, {k: v for k, v in special.items() if v is not None}),
                      tuple(dict.fromkeys(stops)))


def require_chat_format(chat: ChatFormat | None, run_dir: str) -> ChatFormat:
    """``chat`` itself, or NoChatTemplateError naming the run directory when it is None."""
    if chat is None:
        raise NoChatTemplateError(f"{run_dir} has no chat template (no chat_template in {TOKENIZER_CONFIG} or "
                                  f"{TEMPLATE_FILE}): this model cannot chat; use a plain prompt")
    return chat
