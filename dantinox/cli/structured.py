"""The structured-output flags of ``dantinox generate`` (with --prompt or --chat): --json-schema FILE,
--regex R, --grammar FILE (at most one), read and compiled before anything is printed.

``constraint_kwargs(args, gen)`` returns the Generator keyword arguments (``json_schema=``, ``regex=`` or
``grammar=``) after compiling the constraint once for the run's tokenizer, so an invalid schema, regex or
grammar, a schema keyword the grammar engine does not implement, or a file that cannot be read exits with
status 2 and one line naming the flag (docs/how-to/structured-outputs.md).
"""

from __future__ import annotations

import argparse

from ..generation.grammar import GrammarError

FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar"}


def add_constraint_arguments(p: argparse.ArgumentParser) -> None:
    """Add the mutually exclusive --json-schema / --regex / --grammar flags."""
    g = p.add_argument_group("structured outputs (autoregressive models; docs/how-to/structured-outputs.md)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", dest="json_schema", metavar="FILE", default=None,
                     help="a JSON schema file: the text is JSON valid for it")
    one.add_argument("--regex", default=None, metavar="R", help="the text matches this regular expression whole")
    one.add_argument("--grammar", default=None, metavar="FILE",
                     help="a grammar file (Lark, or llama.cpp's GBNF): the text is derived from it")


def constraint_kwargs(args, gen) -> dict:
    """{argument: value} for Generator.generate / complete / chat, or {} without a constraint flag. Raises
    ValueError naming the flag (unreadable file, not JSON, invalid or unsupported constraint, --stream,
    --no_cache or a diffusion model with a constraint)."""
    given = {k: getattr(args, k, None) for k in FLAGS if getattr(args, k, None) is not None}
    if not given:
        return {}
    (name, value), = given.items()
    flag = FLAGS[name]
    for other, used in (("--stream", getattr(args, "stream", False)), ("--no_cache", getattr(args, "no_cache", False))):
        if used:
            raise ValueError(f"{other} is not supported with {flag}: constrained decoding runs a host-stepped loop "
                             "through the cache and prints the text when it is done")
    if gen.cfg.paradigm != "ar":
        raise ValueError(f"{flag} needs an autoregressive model; {gen.run_dir} holds a paradigm="
                         f"{gen.cfg.paradigm!r} model")
    kwargs = {name: _read(flag, value) if name != "regex" else value}
    try:
        gen.constraint(**kwargs)
    except GrammarError as err:
        detail = str(err).split(": ", 1)[1] if str(err).startswith(f"{name}: ") else str(err)
        raise ValueError(f"{flag} {value}: {detail}") from None
    return kwargs


def _read(flag: str, path: str):
    """The text of a --grammar file, the JSON of a --json-schema file (``dantinox.runs.input_files``: one
    error naming the flag and the file for a missing, unreadable, non-UTF-8 or non-JSON file)."""
    from ..runs.input_files import read_json, read_text

    return read_json(path, flag) if flag == "--json-schema" else read_text(path, flag)
