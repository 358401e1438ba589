"""The user documentation reads as documentation (docs/**/*.md and README.md; fast, default tier).

Every page says who it is for (a "For:" line within its first 5 lines), stays under MAX_LINES lines, names no
tracker numbers and says nothing about how the work was organised (BANNED), and every relative link to a .md
page (with its #anchor, if any) lands on an existing page and heading. Files under docs/*-example/ are inputs and
outputs of documented commands, not pages.
"""

from __future__ import annotations

import os
import re

import pytest
from paths import REPO

MAX_LINES = 400
BANNED = [r"\bissue\s+#?\d+", r"\bhelpers?\b", r"\bthis session\b", r"\blent to one session\b"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages(root: str = REPO) -> list[str]:
    """README.md and every .md under docs/, outside docs/*-example/, as paths relative to root."""
    out = ["README.md"]
    for folder, _, names in os.walk(os.path.join(root, "docs")):
        if not folder.endswith("-example"):
            out += [os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(".md")]
    return sorted(out)


def anchors(path: str) -> set[str]:
    """GitHub's anchors of the headings of a page: lower case, punctuation dropped, spaces to dashes."""
    out, fenced = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def problems(page: str, root: str = REPO) -> list[str]:
    """What is wrong with one page (empty when nothing)."""
    path = os.path.join(root, page)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    found = []
    if len(lines) > MAX_LINES:
        found.append(f"{page}: {len(lines)} lines, more than {MAX_LINES}")
    if not any(line.startswith("For:") for line in lines[:5]):
        found.append(f"{page}: no 'For: ...' line within its first 5 lines")
    fenced = False
    for number, line in enumerate(lines, 1):
        for pattern in BANNED:
            if re.search(pattern, line, re.IGNORECASE):
                found.append(f"{page}:{number}: {pattern!r} in {line.strip()[:120]!r}")
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file))
            if not os.path.exists(resolved):
                found.append(f"{page}:{number}: link {target} -> {os.path.relpath(resolved, root)} does not exist")
            elif anchor and file.endswith(".md") and anchor not in anchors(resolved):
                found.append(f"{page}:{number}: link {target}: no heading #{anchor} there")
    return found


@pytest.mark.parametrize("page", pages())
def test_page_reads_as_documentation(page):
    assert not problems(page), "\n".join(problems(page))


def test_the_check_fails_on_a_bad_page(tmp_path):
    (tmp_path / "docs" / "how-to").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# x\n\nFor: everyone.\n")
    bad = ["# A page", "", "As issue 23 says, this session's helper measured it: [x](../missing.md)."]
    (tmp_path / "docs" / "how-to" / "bad.md").write_text("\n".join(bad + ["line"] * 400) + "\n")
    assert pages(str(tmp_path)) == ["README.md", os.path.join("docs", "how-to", "bad.md")]
    found = problems(os.path.join("docs", "how-to", "bad.md"), str(tmp_path))
    text = "\n".join(found)
    assert "more than 400" in text and "no 'For: ...' line" in text, text
    assert "issue" in text and "helper" in text and "this session" in text and "missing.md" in text, text
    assert not problems("README.md", str(tmp_path))
