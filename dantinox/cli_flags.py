"""Library errors spelled in the caller's language: ``name=value`` in a message becomes ``--flag value``.

The library raises ValueError naming its Python arguments (``max_new_tokens=1000 is not allowed: ...``), which
is right for a Python caller. A command-line user typed flags, so ``dantinox.cli.main`` passes every error
message of a subcommand through ``in_flags`` with that subcommand's parser: each ``name=`` whose name is the
destination of one of its options (and not part of a longer name or a dotted ``ModelConfig.name``) is
rewritten to the option as typed, e.g. ``--max_new_tokens 1000`` or ``--reserve-fraction 1.5``. The HTTP
server does the same job by naming the JSON field in every 400 (``dantinox.serving.request.RequestError``).
"""

from __future__ import annotations

import argparse
import re


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{destination: the option as typed} for the options of ``parser`` that take a value,
    e.g. {"max_new_tokens": "--max_new_tokens", "reserve_fraction": "--reserve-fraction"}."""
    out = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.nargs != 0:
            out[action.dest] = longs[0]
    return out


def in_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` with each ``name=value`` for a name in ``flags`` rewritten as ``--flag value`` (a quoted
    value without spaces loses its quotes: ``unknown='replace'`` -> ``--unknown replace``), and a message
    that begins with such a name (``prompt is empty``) beginning with the flag instead."""
    if not flags:
        return message
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.\-])({names})=('[^'\s]*'|\"[^\"\s]*\"|)")

    def rewrite(match: re.Match) -> str:
        value = match.group(2)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        return f"{flags[match.group(1)]} {value}" if value else f"{flags[match.group(1)]} "

    message = pattern.sub(rewrite, message)
    first = message.split(" ", 1)[0]
    return flags[first] + message[len(first):] if first in flags else message


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``command`` of ``parser`` (None if there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None
