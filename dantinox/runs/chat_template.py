"""Chat templates: a conversation (a list of messages) -> the prompt text a chat model was trained on.

A model's chat template is a Jinja2 template (tokenizer_config.json's ``chat_template``, or the GGUF key
``tokenizer.chat_template``), rendered the way Hugging Face transformers' ``apply_chat_template`` does:
  - a sandboxed, immutable Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks`` on and the
    ``loopcontrols`` extension ({% break %}, {% continue %});
  - the context holds ``messages`` (a list of {"role", "content"} dicts), ``add_generation_prompt``, the
    special tokens as text (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``), ``tools`` and
    ``documents`` (None here);
  - helpers ``raise_exception(message)`` (raises :class:`ChatTemplateError`), ``strftime_now(format)``, and a
    ``tojson`` filter that keeps non-ASCII text (``ensure_ascii=False``).
Messages are checked before rendering: every role must be one of ROLES and every content a string (or a list
of OpenAI text parts, joined), so a bad conversation gets one error naming ``messages[i].role`` or
``messages[i].content`` instead of a template failure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A conversation the template cannot render (bad messages, or the template's own raise_exception).

    field: the offending input as a request names it ("messages[1].role"), or "messages" when the template
    itself refused or failed."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


def normalize_messages(messages, field_name: str = "messages") -> list[dict]:
    """Check a conversation and return it as [{"role": str, "content": str}, ...].

    messages: a non-empty list of dicts with "role" in ROLES and "content" a string or a list of
      {"type": "text", "text": str} parts (joined without separator).
    Raises ChatTemplateError naming the field (``messages[2].role``), the value and what is allowed.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"{field_name} must be a non-empty list of {{'role', 'content'}} messages; got "
                                f"{messages!r}", field_name)
    out = []
    for i, message in enumerate(messages):
        where = f"{field_name}[{i}]"
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'; got {message!r}", where)
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role={role!r} is not allowed: one of {list(ROLES)}", f"{where}.role")
        out.append({"role": role, "content": _content_text(message.get("content"), f"{where}.content")})
    return out


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ChatTemplateError(f"{where}={content!r} is not allowed: a string or a list of "
                            "{'type': 'text', 'text': ...} parts", where)


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass
class ChatTemplate:
    """A compiled chat template with the special tokens its context needs.

    Attributes: source (the Jinja text), special_tokens (name -> token text, e.g. {"eos_token": "<|im_end|>"}).
    Raises ChatTemplateError at construction when the template does not parse.
    """

    source: str
    special_tokens: dict = field(default_factory=dict)

    def __post_init__(self):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template does not parse: {err}") from None

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (see :func:`normalize_messages`); with add_generation_prompt the
        text ends where the assistant's answer begins (for ChatML: "<|im_start|>assistant\\n").

        Raises ChatTemplateError for bad messages or a template error (message included).
        """
        from jinja2 import TemplateError

        checked = normalize_messages(messages)
        context = {"bos_token": None, "eos_token": None, "unk_token": None, "pad_token": None,
                   **self.special_tokens}
        try:
            return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **context)
        except ChatTemplateError:
            raise
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None
