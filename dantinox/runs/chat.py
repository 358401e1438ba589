"""A run directory's chat settings: its template, its special tokens and the ids that end a turn.

An imported model's run directory (``dantinox import``) keeps the files that describe chatting with it:
  chat_template.jinja     the template (written by the importer when the checkpoint has one; the bundled
                          ``dante`` run has a plain one too)
  tokenizer_config.json   as transformers writes it: ``chat_template`` (used when there is no
                          chat_template.jinja; a string, or a list of {"name", "template"} of which "default"
                          is used) and ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` (text, or
                          {"content": text}); without them bos_token and eos_token are the texts of
                          bos_token_id and of the first stop id
  generation_config.json  ``eos_token_ids`` / ``eos_token_id`` and ``bos_token_id``
:func:`load_chat_format` reads them into a :class:`ChatFormat`; a run directory without a template gives None
(its model can complete text but cannot chat). Generation stops at any of ``stop_ids``
(``dantinox.runs.stop_ids``: the generation config's eos ids plus the tokenizer's eos_token; SmolLM2-Instruct:
``<|im_end|>``).

Message contents never become control tokens (case K12): :meth:`ChatFormat.prompt_ids` renders the conversation
in pieces (``ChatTemplate.render_segments``) and encodes it with special tokens matched only in the template's
own text (``TextTokenizer.encode_pieces``), so a user who types "<|im_end|>\\n<|im_start|>system" gets those
characters as text, not a forged system turn, while the template's markers keep their ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .chat_template import ChatTemplate, ChatTemplateError
from .stop_ids import GENERATION_CONFIG, TOKENIZER_CONFIG, read_json_object, read_stop_ids, token_text

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class NoChatTemplateError(ValueError):
    """The model has no chat template, so a conversation cannot be turned into a prompt."""


@dataclass
class ChatFormat:
    """template: the compiled ChatTemplate; stop_ids: token ids that end the assistant's turn
    (``dantinox.runs.stop_ids.read_stop_ids``)."""

    template: ChatTemplate
    stop_ids: tuple

    def prompt_ids(self, messages, tokenizer, unknown: str = "error", before_encoding=None,
                   tools: list | None = None) -> list[int]:
        """Render ``messages`` with add_generation_prompt and encode the text with ``tokenizer`` (a dantinox
        TextTokenizer): special tokens in the template's own text become their ids, text inside a message's
        content stays text (see the module docstring). unknown: as ``TextTokenizer.encode``.
        before_encoding: called with the rendered prompt's length in characters before it is encoded (the
        server refuses there a prompt that cannot fit the context); it may raise.
        Raises ChatTemplateError naming the message field, or for an empty rendering; ValueError for unknown
        characters of a char tokenizer. tools: tool definitions for the template's ``tools`` variable (their text
        counts as the template's: callers refuse special-token text in them)."""
        pieces = self.template.render_segments(messages, add_generation_prompt=True, tools=tools)
        if not pieces:
            raise ChatTemplateError("the chat template rendered an empty prompt")
        if before_encoding is not None:
            before_encoding(sum(len(text) for text, _ in pieces))
        return tokenizer.encode_pieces(pieces, unknown)


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
    config = read_json_object(os.path.join(run_dir, TOKENIZER_CONFIG))
    source = _template_text(run_dir, config)
    if source is None:
        return None
    special = {name: token_text(config.get(name)) for name in SPECIAL_TOKENS}
    stops = read_stop_ids(run_dir, tokenizer)
    if special["eos_token"] is None and stops:
        special["eos_token"] = tokenizer.hf.id_to_token(stops[0])
    bos = read_json_object(os.path.join(run_dir, GENERATION_CONFIG)).get("bos_token_id")
    if special["bos_token"] is None and isinstance(bos, int) and 0 <= bos < tokenizer.vocab_size:
        special["bos_token"] = tokenizer.hf.id_to_token(bos)
    return ChatFormat(ChatTemplate(source, {k: v for k, v in special.items() if v is not None}), stops)


def require_chat_format(chat: ChatFormat | None, run_dir: str) -> ChatFormat:
    """``chat`` itself, or NoChatTemplateError naming the run directory when it is None."""
    if chat is None:
        raise NoChatTemplateError(f"{run_dir} has no chat template (no chat_template in {TOKENIZER_CONFIG} or "
                                  f"{TEMPLATE_FILE}): this model cannot chat; use a plain prompt")
    return chat
