"""The operator's pages hold together: every relative link in README.md, docs/*.md and
the READMEs under deploy/ names a file that exists and, with `#anchor`, a heading that
target has (GitHub's anchors); no page prints a heading twice; the README opens with
its two set-up commands."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "deploy").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def headings(page: Path) -> list[str]:
    return [m.group(1).strip() for line in prose(page)
            if (m := re.match(r"#{1,6}\s+(.*)", line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
    each space a `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for heading in headings(page):
        base = slug(heading)
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def test_slugs_are_githubs() -> None:
    assert slug("kube-proxy's configuration file") == "kube-proxys-configuration-file"
    assert slug("sliceproxy → kube-proxy") == "sliceproxy--kube-proxy"
    assert slug("1. Let Prometheus reach `/metrics`") == "1-let-prometheus-reach-metrics"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{target}: no heading with that anchor")
    assert broken == [], broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_heading_is_printed_twice(page: Path) -> None:
    twice = [h for h, n in Counter(headings(page)).items() if n > 1]
    assert twice == [], twice


def test_the_readme_opens_with_its_two_set_up_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```", 2)[1].strip().splitlines()
    commands = [line.split("#")[0].strip() for line in first_block]
    assert commands == ["sudo ./run demo", "sudo ./run test"], first_block
