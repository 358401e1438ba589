"""The structured-output fields of a completion or chat request -> one ``Constraint`` (or none).

Accepted, as OpenAI and vLLM name them (at most one of them per request; two give 400 naming the second):
  response_format   {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object), or
                    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                    (JSON valid for the schema; strict or not, the schema is always enforced)
  structured_outputs  vLLM's object with one of "json" (a schema, or its JSON text), "regex", "grammar"
                    (Lark or GBNF), "choice" (a list of strings), "json_object": true; "disable_any_whitespace"
                    and "disable_fallback" are accepted and change nothing (JSON never has free whitespace
                    here, and there is no other backend to fall back to)
  guided_json, guided_regex, guided_grammar, guided_choice   vLLM's older top-level forms of the same
Anything else inside these fields (vLLM's "structural_tag", "whitespace_pattern", an unknown response_format
type) is refused with 400 naming it. An invalid schema, regex or grammar, or a schema keyword the grammar
engine does not implement, is a RequestError naming the field (``response_format.json_schema.schema``,
``structured_outputs.regex``, ``guided_grammar``, ...), which the endpoints answer with HTTP 400.
"""

from __future__ import annotations

import dataclasses

from ..generation.grammar import (Constraint, GrammarError, choice_constraint, grammar_constraint, grammar_vocabulary,
                                  json_object_constraint, json_schema_constraint, regex_constraint)
from .request import RequestError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
                 "guided_choice": "choice"}
STRUCTURED_KINDS = ("json", "regex", "grammar", "choice", "json_object")
STRUCTURED_NO_OPS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def _requested(extra: dict) -> list[tuple[str, str, object]]:
    """[(field, kind, value)] of every constraint the body asks for (kind one of STRUCTURED_KINDS)."""
    out = []
    fmt = extra.get("response_format")
    if fmt is not None:
        out += _response_format(fmt)
    structured = extra.get("structured_outputs")
    if structured is not None:
        out += _structured_outputs(structured)
    for name, kind in GUIDED_FIELDS.items():
        if extra.get(name) is not None:
            out.append((name, kind, extra[name]))
    return out


def _response_format(fmt) -> list:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("response_format", f"response_format={fmt!r} is not allowed: {{'type': 'text'}}, "
                           "{'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name': ..., "
                           "'schema': {...}}}")
    if fmt["type"] == "text":
        return []
    if fmt["type"] == "json_object":
        return [("response_format", "json_object", True)]
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise RequestError("response_format.json_schema", "response_format.json_schema must be an object with "
                           f"'name' and 'schema'; got {spec!r}")
    return [("response_format.json_schema.schema", "json", spec["schema"])]


def _structured_outputs(structured) -> list:
    if not isinstance(structured, dict):
        raise RequestError("structured_outputs", f"structured_outputs={structured!r} is not allowed: an object "
                           f"with one of {list(STRUCTURED_KINDS)}")
    unknown = [k for k in structured if k not in STRUCTURED_KINDS + STRUCTURED_NO_OPS and structured[k] is not None]
    if unknown:
        raise RequestError(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]} is not supported "
                           f"by this server: give one of {list(STRUCTURED_KINDS)}")
    given = [(f"structured_outputs.{k}", k, structured[k]) for k in STRUCTURED_KINDS
             if structured.get(k) not in (None, False)]
    if not given:
        raise RequestError("structured_outputs", f"structured_outputs={structured!r} asks for nothing: give one "
                           f"of {list(STRUCTURED_KINDS)}")
    return given


def request_constraint(extra: dict | None, tokenizer, stop_ids) -> Constraint | None:
    """The Constraint a request body asks for (``extra``: its fields beyond the common ones, pydantic's
    ``model_extra``), compiled for ``tokenizer`` whose end tokens are ``stop_ids``; None when it asks for
    none. Raises RequestError naming the field (see the module docstring)."""
    requested = _requested(extra or {})
    if not requested:
        return None
    if len(requested) > 1:
        raise RequestError(requested[1][0], f"{requested[0][0]} and {requested[1][0]} both constrain the output: "
                           "give at most one")
    field, kind, value = requested[0]
    vocabulary = grammar_vocabulary(tokenizer, stop_ids)
    try:
        if kind == "json_object":
            if value is not True:
                raise GrammarError(field, f"{field}={value!r} is not allowed: true")
            return json_object_constraint(vocabulary, field)
        build = {"json": json_schema_constraint, "regex": regex_constraint, "grammar": grammar_constraint,
                 "choice": choice_constraint}[kind]
        return build(value, vocabulary, field)
    except GrammarError as err:
        raise RequestError(err.field, str(err)) from None


def constrained(options: list, constraint: Constraint | None) -> list:
    """Every choice's SamplingOptions with ``constraint`` (each choice gets its own matcher in the engine)."""
    if constraint is None:
        return options
    return [dataclasses.replace(o, constraint=constraint) for o in options]
