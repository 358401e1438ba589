"""OpenAI tool calling for ``/v1/chat/completions``: the request's tools, how a model's output becomes
``tool_calls``, and the grammar that forces a call.

  1. ``parse_tool_request`` checks ``tools`` (function definitions: name, description, parameters as a JSON
     schema), ``tool_choice`` ("none", "auto", "required" or {"type": "function", "function": {"name"}})
     and ``parallel_tool_calls`` (default true) and raises RequestError naming the field otherwise.
  2. "auto": the tools are rendered through the chat template (its ``tools`` variable, as transformers
     passes them), the model writes freely, and a ``ToolParser`` finds the calls in its text. The parser is
     chosen from the template: "hermes" (Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}
     </tool_call>``, any number of them after some content) when the template writes ``<tool_call>``,
     "llama3_json" (Llama 3.1+: the whole answer is ``{"name": ..., "parameters": {...}}``, optionally after
     ``<|python_tag|>``, several separated by ";") when it writes ``<|python_tag|>`` or ``ipython``; the
     server's ``--tool-call-parser`` names it when the template says neither. A template that does not read
     ``tools`` cannot show them to the model: "auto" then runs with the generic tool prompt
     (``dantinox.serving.generic_tools``: the tools and the hermes syntax in the system message).
  3. "required" and a named function are enforced with a grammar (``tool_constraint``), as vLLM does: the
     answer must be a JSON array of 1 (or, with parallel_tool_calls, more) {"name": ..., "parameters": {...}}
     objects whose parameters are valid for that tool's schema, or for a named function its arguments object
     alone. Those work with any template (the "grammar-only mode": the tools are rendered when the template
     can, and the grammar does the rest).
  4. "none": the tools are not rendered and the answer is plain content.
Each call's ``arguments`` is the model's own text of the arguments object (checked with ``json.loads``, not
rewritten), so the streamed argument pieces (``ToolParser.partial``, ``partial_forced``: the ``PartialCall``s
the text so far shows) add up to exactly the whole answer's. Tool-call ids are "call_" and 24 hex digits. The
text of tools, tool calls and tool results the template writes counts as template text, so a request whose
tools or tool-call arguments hold a special-token text ("<|im_end|>") is refused with 400 (case K12).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from ..generation.grammar import Constraint, GrammarError, json_schema_constraint
from .partial_json import PartialObject, scan_objects
from .request import RequestError

TOOL_PARSERS = ("hermes", "llama3_json")
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """tools: the checked definitions [{"type": "function", "function": {"name", "description"?,
    "parameters"}}]; choice: "none", "auto", "required" or a function name; parallel: parallel_tool_calls."""

    tools: tuple
    choice: str
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        """True when a grammar forces the answer to be a call ("required" or a named function)."""
        return self.choice not in ("none", "auto")

    def parameters(self, name: str) -> dict:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == name)


def parse_tool_request(extra: dict | None) -> ToolRequest | None:
    """The tools of a chat request body (``extra``: pydantic's model_extra), or None when it has none (or
    only tool_choice "none" without tools). Raises RequestError naming the field."""
    extra = extra or {}
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    parallel = extra.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls", f"parallel_tool_calls={parallel!r} is not allowed: true or false")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError("tool_choice", f"tool_choice={choice!r} needs tools: give 'tools' or drop "
                               "'tool_choice'")
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", f"tools={tools!r} is not allowed: a list of {{'type': 'function', 'function': "
                           "{...}} definitions")
    checked = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise RequestError("tools", f"tools: function names must be distinct; got {names}")
    return ToolRequest(checked, _choice(choice, names), parallel)


def _tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RequestError(f"{where}.type", f"{where}={tool!r} is not allowed: {{'type': 'function', "
                           "'function': {'name': ..., 'parameters': {...}}}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{where}.function", f"{where}.function must be an object with 'name'; got {fn!r}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise RequestError(f"{where}.function.name", f"{where}.function.name={name!r} is not allowed: 1 to 64 "
                           "letters, digits, '_', '.' or '-'")
    parameters = fn.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise RequestError(f"{where}.function.parameters", f"{where}.function.parameters={parameters!r} is not "
                           "allowed: a JSON schema object")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{where}.function.description", f"{where}.function.description must be a string")
    out = {"name": name, "parameters": parameters}
    if description is not None:
        out["description"] = description
    return {"type": "function", "function": out}


def _choice(choice, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise RequestError("tool_choice", f"tool_choice={choice!r} is not allowed: 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise RequestError("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools "
                           f"{names}")
    return name


def check_no_special_text(tools: ToolRequest | None, messages, special_texts) -> None:
    """Raise RequestError when a special-token text (``<|im_end|>``) appears in the tool definitions or in the
    messages' tool calls or tool-result names: the template writes those as its own text (K12)."""
    specials = [t for t in special_texts if t]
    parts = [("tools", json.dumps(list(tools.tools), ensure_ascii=False))] if tools is not None else []
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict):
            for key in ("tool_calls", "tool_call_id", "name"):
                if m.get(key) is not None:
                    parts.append((f"messages[{i}].{key}", json.dumps(m[key], ensure_ascii=False)))
    for field, text in parts:
        hit = next((t for t in specials if t in text), None)
        if hit is not None:
            raise RequestError(field, f"{field} holds the special token text {hit!r}, which the chat template "
                               "would turn into a control token: remove it")


def tool_constraint(tools: ToolRequest, vocabulary, field: str = "tools") -> Constraint | None:
    """The grammar of a forced answer (None for "auto" and "none"): for "required" a JSON array of
    {"name", "parameters"} calls (1 item, or 1 or more with parallel_tool_calls), for a named function its
    arguments object. Raises RequestError naming the tool whose parameters are not a usable schema."""
    if not tools.forced:
        return None
    if tools.choice != "required":
        schema, where = tools.parameters(tools.choice), _where(tools, tools.choice)
    else:
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": n}, "parameters": tools.parameters(n)}} for n in tools.names]
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": item, "minItems": 1, **({} if tools.parallel else {"maxItems": 1})}
        where = field
    try:
        return json_schema_constraint(schema, vocabulary, where)
    except GrammarError as err:
        raise RequestError(where if where != field else field, str(err)) from None


def _where(tools: ToolRequest, name: str) -> str:
    return f"tools[{tools.names.index(name)}].function.parameters"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def call_body(name: str, arguments, call_id: str | None = None) -> dict:
    """One OpenAI tool call: {"id", "type": "function", "function": {"name", "arguments": JSON text}}."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


@dataclass(frozen=True)
class PartialCall:
    """One tool call as far as the text shows it: name (None until its string is finished), arguments (the raw
    text of the arguments value so far, None until it starts), done (the arguments value is finished)."""

    name: str | None
    arguments: str | None
    done: bool

    def body(self) -> dict:
        """The OpenAI call of a finished call (arguments "{}" when the model wrote none)."""
        return call_body(self.name, self.arguments if self.arguments is not None else "{}")


def _partial(obj: PartialObject, text: str, keys: tuple) -> PartialCall:
    """The PartialCall of a scanned call object whose arguments are under the first of ``keys`` it has."""
    name = None
    if obj.done("name"):
        try:
            value = json.loads(obj.raw(text, "name"))
        except json.JSONDecodeError:
            value = None
        name = value if isinstance(value, str) else None
    key = next((k for k in keys if k in obj.fields), None)
    done = obj.done(key) if key is not None else obj.closed
    return PartialCall(name, obj.raw(text, key) if key is not None else None, done)


def partial_forced(text: str, tools: ToolRequest) -> list[PartialCall]:
    """The calls a grammar-forced answer shows so far: a named function's answer is its arguments object, a
    "required" answer a JSON array of {"name", "parameters"} objects (``tool_constraint``)."""
    if tools.choice != "required":
        body = text.lstrip()
        objects = scan_objects(body, limit=1)
        return [PartialCall(tools.choice, body or None, bool(objects) and objects[0].closed)]
    start = text.find("[")
    if start < 0:
        return []
    return [_partial(obj, text, ("parameters",)) for obj in scan_objects(text, start + 1)]


def parse_forced(text: str, tools: ToolRequest) -> list[dict]:
    """The calls of a grammar-forced answer (see ``tool_constraint``); [] when the text is not complete JSON
    (the answer was cut by max_tokens)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return []
    return [call.body() for call in partial_forced(text, tools)]


class ToolParser:
    """Finds tool calls in a model's free text. ``name``: one of TOOL_PARSERS."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content or None, [call bodies]); with no call found the content is the whole text."""
        raise NotImplementedError

    def content_end(self, text: str, final: bool) -> int:
        """How many leading characters of ``text`` (the answer so far) are surely content, for streaming: text
        that is or may become a tool call is held back until the answer ends (final)."""
        raise NotImplementedError

    def partial(self, text: str) -> list[PartialCall]:
        """The calls the answer so far shows, the last possibly unfinished (for streaming)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after optional content (Hermes 2 Pro,
    Qwen 2.5 / 3 templates)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        for block in self.BLOCK.findall(text[start:]):
            try:
                value = json.loads(block)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return text, []
        content = text[:start]
        return (content if content.strip() else None), [call.body() for call in self.partial(text)]

    def partial(self, text: str) -> list[PartialCall]:
        calls, at = [], text.find(self.START)
        while at >= 0:
            objects = scan_objects(text, at + len(self.START), limit=1)
            if not objects:
                break
            calls.append(_partial(objects[0], text, ("arguments", "parameters")))
            at = text.find(self.START, at + len(self.START))
        return calls

    def content_end(self, text: str, final: bool) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        if final:
            return len(text)
        keep = next((n for n in range(min(len(self.START) - 1, len(text)), 0, -1)
                     if text.endswith(self.START[:n])), 0)
        return len(text) - keep


class Llama3JsonParser(ToolParser):
    """Llama 3.1+ JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}`` (or "arguments"),
    optionally after ``<|python_tag|>``, several separated by ";"."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        decoder, at = json.JSONDecoder(), 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return text, []
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                return text, []
            at = len(body) - len(rest) + (1 if rest else 0)
            while at < len(body) and body[at].isspace():
                at += 1
        return None, [call.body() for call in self.partial(text)]

    def partial(self, text: str) -> list[PartialCall]:
        at = len(text) - len(text.lstrip())
        if text.startswith(self.TAG, at):
            at += len(self.TAG)
            at += len(text[at:]) - len(text[at:].lstrip())
        if not text.startswith("{", at):
            return []
        return [_partial(obj, text, ("parameters", "arguments")) for obj in scan_objects(text, at)]

    def content_end(self, text: str, final: bool) -> int:
        head = text.lstrip()
        if final:
            return len(text)
        if head == "" or head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
            return 0
        return len(text)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for(template_source: str, name: str | None = None) -> ToolParser | None:
    """The ToolParser named ``name`` (one of TOOL_PARSERS), else the one the template's text points to, else
    None. Raises ValueError for an unknown name."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"tool_call_parser={name!r} is not allowed: one of {list(TOOL_PARSERS)}")
        return PARSERS[name]()
    if "<tool_call>" in template_source:
        return HermesParser()
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return Llama3JsonParser()
    return None
