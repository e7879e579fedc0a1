"""docs/tests.md's map from each module under proxy/ to the tests that exercise it stays
true: every module has a row, no row names a module that is gone, and every test a row
names exists and imports that module (or, for a module run as a process, names it).

The map is made from the tests' own imports: `python -m tests.unit.test_module_map`
writes it between its markers in docs/tests.md again (run it after adding a module or
moving one)."""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tests.md"
BEGIN, END = "<!-- module map: begin -->", "<!-- module map: end -->"
SHOWN = 6  # tests named per row; the rest counted


def modules() -> dict[str, Path]:
    """Every module under proxy/, dotted (`proxy.kube.decode`; a package by its name)."""
    out = {}
    for path in sorted((ROOT / "proxy").rglob("*.py")):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[dotted.removesuffix(".__init__")] = path
    return out


def imported(source: Path) -> set[str]:
    """Dotted names a file imports (`from a.b import c` counts `a.b` and `a.b.c`), and
    those it runs as `-m NAME` or names in a string."""
    text = source.read_text()
    names = set(re.findall(r"[\"' ](proxy(?:\.\w+)+)[\"' ]", text))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def every_test_file() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if p.is_file())


def short(test: Path) -> str:
    return str(test.relative_to(ROOT / "tests").with_suffix(""))


def users() -> dict[str, list[Path]]:
    """For each module, the test files that import it, those named for it first."""
    mods = modules()
    found: dict[str, list[Path]] = defaultdict(list)
    for test in every_test_file():
        for name in imported(test) & set(mods):
            found[name].append(test)
    for name, tests in found.items():
        last = name.rsplit(".", 1)[-1]
        tests.sort(key=lambda t: (last not in t.stem, short(t)))
    return found


def through(module: str, mods: dict[str, Path]) -> list[str]:
    """The modules under proxy/ that import `module`: how tests reach one none imports."""
    return sorted(other for other, path in mods.items()
                  if other != module and module in imported(path))


def rows() -> list[str]:
    mods, found = modules(), users()
    out = ["| module | tests that import it (`tests/...`) |", "|---|---|"]
    for name in mods:
        tests = found.get(name, [])
        if tests:
            cell = ", ".join(f"`{short(t)}`" for t in tests[:SHOWN])
            cell += f" and {len(tests) - SHOWN} more" if len(tests) > SHOWN else ""
        else:
            via = through(name, mods)
            cell = ("none directly; reached through " + ", ".join(f"`{v}`" for v in via[:3])
                    if via else "none")
        out.append(f"| `{name}` | {cell} |")
    return out


def documented() -> dict[str, list[str]]:
    text = PAGE.read_text()
    assert BEGIN in text and END in text, f"docs/tests.md lacks {BEGIN} ... {END}"
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    out = {}
    for line in section.splitlines():
        if m := re.match(r"\| `(proxy[\w.]*)` \| (.*) \|$", line):
            tests = [] if m.group(2).startswith("none") else re.findall(r"`([^`]+)`",
                                                                         m.group(2))
            out[m.group(1)] = tests
    return out


def test_every_module_under_proxy_has_a_row() -> None:
    mods, doc = modules(), documented()
    assert sorted(set(mods) - set(doc)) == [], \
        "not in docs/tests.md's map: run python -m tests.unit.test_module_map"
    assert sorted(set(doc) - set(mods)) == [], "docs/tests.md maps modules that are gone"


def test_every_test_the_map_names_exists_and_reaches_its_module() -> None:
    false = []
    for module, tests in documented().items():
        for test in tests:
            path = ROOT / "tests" / f"{test}.py"
            if not path.is_file() or module not in imported(path):
                false.append(f"{module}: {test}")
    assert false == [], false


def write(lines: Iterable[str]) -> None:
    text = PAGE.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    PAGE.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


if __name__ == "__main__":
    write(rows())
    sys.exit(0)
