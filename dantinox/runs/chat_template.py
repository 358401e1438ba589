"""Chat templates: a conversation (a list of messages) -> the prompt text a chat model was trained on.

A model's chat template is a Jinja2 template (tokenizer_config.json's ``chat_template``, or the GGUF key
``tokenizer.chat_template``), rendered the way Hugging Face transformers' ``apply_chat_template`` does:
  - a sandboxed, immutable Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks`` on and the
    ``loopcontrols`` extension ({% break %}, {% continue %});
  - the context holds ``messages`` (a list of {"role", "content"} dicts; an assistant turn may carry
    ``tool_calls`` with its arguments as a dict, a tool turn ``tool_call_id`` and ``name``),
    ``add_generation_prompt``, the special tokens as text (``bos_token``, ``eos_token``, ``unk_token``,
    ``pad_token``), ``tools`` (the request's tool definitions, or None) and ``documents`` (None here);
  - helpers ``raise_exception(message)`` (raises :class:`ChatTemplateError`), ``strftime_now(format)``, and a
    ``tojson`` filter that keeps non-ASCII text (``ensure_ascii=False``).
Messages are checked before rendering: every role must be one of ROLES and every content a string (or a list
of OpenAI text parts, joined), so a bad conversation gets one error naming ``messages[i].role`` or
``messages[i].content`` instead of a template failure.

Which text came from a message (K12). :meth:`ChatTemplate.render_segments` returns the rendering cut into
pieces that say whether each came from the template or from a message's content, so the tokenizer can match
special tokens (``<|im_start|>``) in the template's text only (``dantinox.runs.chat``). It renders the
conversation once more with every content replaced by a placeholder that no text holds (a random number between
two private-use characters, which trim, upper and lower leave alone): the template's text is what lies around
the placeholders. When putting the contents back where the placeholders are gives the real rendering, the
template inserts contents verbatim (ChatML, SmolLM2). Otherwise (a template that changes a content, e.g.
Llama 3's ``| trim``) each content's rendered form is found by rendering with that one content real and the
others as placeholders: whatever differs from the placeholder rendering there counts as that content's text,
and the pieces must again add up to the real rendering exactly. So text whose presence depends on a message's
content counts as that content (it can never yield a control id), and a template for which that region cannot
be told apart (the text before or after it changes too, or a changed content rendered twice) is refused with
ChatTemplateError rather than guessed at.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime

from .tokenizer import check_unicode

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
        content = message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        if content is None and calls:  # an assistant turn that only called tools
            content = ""
        checked = {"role": role, "content": _content_text(content, f"{where}.content")}
        if calls:
            checked["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        for key in ("tool_call_id", "name") if role == "tool" else ():
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise ChatTemplateError(f"{where}.{key}={message[key]!r} is not allowed: a string",
                                            f"{where}.{key}")
                checked[key] = message[key]
        out.append(checked)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates read them (transformers' convention):
    [{"id", "type": "function", "function": {"name", "arguments": a dict}}], the arguments JSON text parsed."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}={calls!r} is not allowed: a list of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"{where}[{j}]={call!r} is not allowed: {{'type': 'function', 'function': "
                                    "{'name': ..., 'arguments': ...}}", f"{where}[{j}]")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise ChatTemplateError(f"{where}[{j}].function.arguments is not valid JSON: {err}",
                                        f"{where}[{j}].function.arguments") from None
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _content_text(content, where: str) -> str:
    """A message's content as one string; ChatTemplateError naming ``where`` for another type or for text that
    is not valid Unicode (a lone surrogate, ``tokenizer.check_unicode``)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if isinstance(content, str):
        try:
            check_unicode(content, where)
        except ValueError as err:
            raise ChatTemplateError(str(err), where) from None
        return content
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

    def render(self, messages, add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The prompt text of ``messages`` (see :func:`normalize_messages`); with add_generation_prompt the
        text ends where the assistant's answer begins (for ChatML: "<|im_start|>assistant\\n"). tools: the
        OpenAI tool definitions ([{"type": "function", "function": {...}}]) the template's ``tools`` variable
        gets (None: no tools).

        Raises ChatTemplateError for bad messages or a template error (message included).
        """
        return self._render(normalize_messages(messages), add_generation_prompt, tools)

    @property
    def supports_tools(self) -> bool:
        """True when the template reads the ``tools`` variable (it can show tool definitions to the model)."""
        from jinja2 import meta

        return "tools" in meta.find_undeclared_variables(self._template.environment.parse(self.source))

    def render_segments(self, messages, add_generation_prompt: bool = True,
                        tools: list | None = None) -> list[tuple[str, bool]]:
        """The rendering of ``messages`` as pieces [(text, from_content)] whose texts joined equal
        :meth:`render`'s; from_content is True for the template's rendering of a message's content (see the
        module docstring for how the pieces are found, exactly). Empty pieces are left out.

        Raises ChatTemplateError as :meth:`render`, and when the template's text around the contents depends on
        the contents (naming the message).
        """
        checked = normalize_messages(messages)
        real = self._render(checked, add_generation_prompt, tools)
        nonce = secrets.randbelow(10**12)
        while any(f"\ue000{nonce}:" in text for text in [self.source] + [m["content"] for m in checked]):
            nonce = secrets.randbelow(10**12)  # a placeholder must be a text that nothing else holds
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(checked))]
        masked = self._render([dict(m, content=mark) for m, mark in zip(checked, marks)], add_generation_prompt,
                              tools)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", masked)  # template text, message index, template text...
        pieces = [p if n % 2 == 0 else int(p) for n, p in enumerate(parts)]
        segments = _assemble(pieces, [m["content"] for m in checked])
        if "".join(text for text, _ in segments) == real:  # the template inserts contents verbatim
            return segments
        rendered = {}
        for i in sorted({p for p in pieces if isinstance(p, int)}):
            rendered[i] = self._rendered_content(checked, marks, i, masked, add_generation_prompt, tools)
        segments = _assemble(pieces, rendered)
        if "".join(text for text, _ in segments) != real:
            raise ChatTemplateError("the chat template's text around the message contents depends on the "
                                    "contents, so text in a message cannot be kept apart from the template's "
                                    "special tokens; this template is not supported")
        return segments

    def _rendered_content(self, checked: list, marks: list, i: int, masked: str, add_generation_prompt,
                          tools: list | None = None) -> str:
        """What the template makes of message i's content: the rendering with that content real and the others
        as placeholders, less the template text around placeholder i (ChatTemplateError when that text is not
        there, or the content is rendered more than once)."""
        where = f"messages[{i}].content"
        if masked.count(marks[i]) != 1:
            raise ChatTemplateError(f"{where}: the chat template renders this content {masked.count(marks[i])} "
                                    "times and changes it, so its text cannot be kept apart from the template's "
                                    "special tokens; this template is not supported", where)
        before, after = masked.split(marks[i])
        one = self._render([m if j == i else dict(m, content=marks[j]) for j, m in enumerate(checked)],
                           add_generation_prompt, tools)
        if not (one.startswith(before) and one.endswith(after) and len(one) >= len(before) + len(after)):
            raise ChatTemplateError(f"{where}: the chat template's text around this content depends on the "
                                    "content, so text in a message cannot be kept apart from the template's "
                                    "special tokens; this template is not supported", where)
        return one[len(before):len(one) - len(after)]

    def _render(self, checked: list, add_generation_prompt: bool, tools: list | None = None) -> str:
        from jinja2 import TemplateError

        context = {"bos_token": None, "eos_token": None, "unk_token": None, "pad_token": None,
                   **self.special_tokens}
        try:
            return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **context)
        except ChatTemplateError:
            raise
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None


def _assemble(pieces: list, contents) -> list[tuple[str, bool]]:
    """[(text, from_content)] of pieces (template text str, or a message index into ``contents``), empty
    texts left out."""
    out = [(contents[p], True) if isinstance(p, int) else (p, False) for p in pieces]
    return [(text, from_content) for text, from_content in out if text]
