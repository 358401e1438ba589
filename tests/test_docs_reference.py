"""docs/reference/cli.md lists every subcommand and every flag of the ``dantinox`` parser, and no flag the parser
does not have (fast, default tier)."""

from __future__ import annotations

import argparse
import os
import re

from paths import REPO

from dantinox.cli import entrypoint as cli

PAGE = os.path.join(REPO, "docs", "reference", "cli.md")


def parsers(parser: argparse.ArgumentParser, name: str = "dantinox") -> dict[str, argparse.ArgumentParser]:
    """{"dantinox generate": parser, "dantinox plan trace": parser, ...}: every (nested) subcommand's parser."""
    out = {name: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                out.update(parsers(sub, f"{name} {word}"))
    return out


def sections() -> dict[str, str]:
    """{"dantinox generate": the text under its heading, up to the next heading of a subcommand}."""
    text = open(PAGE, encoding="utf-8").read()
    parts = re.split(r"^#+ `(dantinox[\w -]*)`\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}   # every parser has them


def test_every_subcommand_and_flag_is_documented_and_nothing_else():
    found, documented = parsers(cli.build_parser()), sections()
    subcommands = {name for name in found if name != "dantinox"}
    assert subcommands <= documented.keys(), f"subcommands without a section: {subcommands - documented.keys()}"
    assert documented.keys() <= set(found), f"sections of no subcommand: {documented.keys() - set(found)}"
    problems = []
    for name, text in documented.items():
        known = options(found[name])
        written = set(re.findall(r"`(--?[A-Za-z][\w-]*)`", text)) - {"-h", "--help"}
        problems += [f"{name}: {flag} is not documented" for flag in sorted(known - written)]
        problems += [f"{name}: {flag} is documented but unknown to the parser" for flag in sorted(written - known)]
    assert not problems, "\n".join(problems)
