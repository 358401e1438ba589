"""Which chat template an imported run gets: a file given with ``--chat-template``, else the checkpoint's own,
else the built-in turn format of its architecture (Gemma's), else none. ``dantinox import`` prints one line
naming the choice (``TemplateChoice.line``) and model_summary.json records it.

Gemma's turn format (Gemma 2 / 3; Google's "Gemma formatting and system instructions" documentation): the
conversation starts with ``<bos>``; each turn is ``<start_of_turn>ROLE\\n`` + text + ``<end_of_turn>\\n`` with
ROLE ``user`` or ``model`` (the assistant); a system message has no role of its own and goes before the first
user turn's text, followed by a blank line; the answer is generated after ``<start_of_turn>model\\n`` and ends
with ``<end_of_turn>``, which therefore becomes a stop token of the run. Message contents are inserted
verbatim. A template given with ``--chat-template`` or read from the checkpoint is checked before anything is
written: it must parse and render a one-message conversation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..runs.chat_template import ChatTemplate, ChatTemplateError
from .errors import CheckpointError

GEMMA_TURNS = (
    "{%- if bos_token -%}{{ bos_token }}{%- endif -%}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set preamble = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set preamble = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] not in ('user', 'assistant') -%}"
    "{{ raise_exception(\"Gemma's turn format has the roles user and assistant (and system first); got \" + "
    "message['role']) }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' }}"
    "{%- if loop.first -%}{{ preamble }}{%- endif -%}"
    "{{ message['content'] }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# architecture -> (name, template, stop token texts) for checkpoints that carry no template
BUILT_IN = {"Gemma3ForCausalLM": ("Gemma's turn format", GEMMA_TURNS, ("<end_of_turn>",)),
            "Gemma2ForCausalLM": ("Gemma's turn format", GEMMA_TURNS, ("<end_of_turn>",))}
SAMPLE = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class TemplateChoice:
    """text: the template the run gets (None: the run cannot chat); origin: where it came from, as the import
    line says it; stop_tokens: token texts that end a turn in this template (added to the run's stop ids when
    the tokenizer holds them)."""

    text: str | None
    origin: str
    stop_tokens: tuple[str, ...] = ()

    @property
    def line(self) -> str:
        """The one line ``dantinox import`` prints."""
        return f"chat template: {self.origin}"


def choose_template(checkpoint_template: str | None, architecture: str, override: str | None = None,
                    special_tokens: dict | None = None) -> TemplateChoice:
    """The chat template of an import (module docstring). override: a path given with --chat-template;
    special_tokens: the checkpoint's bos / eos texts, for the render check.

    Raises CheckpointError naming --chat-template (or the checkpoint's template): a file that cannot be read,
    or a template that does not parse or fails to render a one-message conversation."""
    if override is not None:
        try:
            with open(override, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"--chat-template {override}: cannot be read ({err})") from None
        check_template(text, f"--chat-template {override}", special_tokens)
        return TemplateChoice(text, f"{os.path.abspath(override)} (--chat-template)")
    if checkpoint_template:
        check_template(checkpoint_template, "the checkpoint's chat template", special_tokens)
        return TemplateChoice(checkpoint_template, "the checkpoint's own")
    if architecture in BUILT_IN:
        name, text, stops = BUILT_IN[architecture]
        return TemplateChoice(text, f"{name} (built in: the checkpoint carries none; --chat-template FILE "
                                    "overrides it)", stops)
    return TemplateChoice(None, "none (the checkpoint carries none: the run completes text but cannot chat; "
                                "--chat-template FILE gives it one)")


def check_template(text: str, where: str, special_tokens: dict | None = None) -> None:
    """CheckpointError naming ``where`` unless ``text`` parses and renders a one-message conversation."""
    try:
        ChatTemplate(text, dict(special_tokens or {})).render(SAMPLE)
    except ChatTemplateError as err:
        raise CheckpointError(f"{where} fails to render a one-message conversation ({err}); give a working "
                              "template with --chat-template FILE") from None
