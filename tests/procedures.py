"""The operator's procedures as the docs show them: the shell blocks of a page, by step,
for tests that run them as written (tests/nodes/test_migration.py with the cluster's
kubectl, tests/unit/test_kubeadm_procedures.py with a stand-in) instead of a copy that
could drift from the page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def doc_block(page: str, heading: str, holding: str = "") -> str:
    """The first shell block under `heading` (a whole heading line) of docs/`page`,
    or the first there with a line starting with `holding`."""
    text = (DOCS / page).read_text()
    section = text[text.index(f"\n{heading}\n") + len(heading) + 1:]
    for block in re.findall(r"\n```\n(.*?)\n```\n", section, re.DOTALL):
        if any(line.startswith(holding) for line in block.splitlines()):
            return str(block)
    raise AssertionError(f"docs/{page}, {heading}: no shell block holding {holding!r}")


def steps(block: str) -> dict[str, str]:
    """A procedure's lines by step: a comment `# N. ...` starts step N."""
    out: dict[str, str] = {}
    step = ""
    for line in block.splitlines():
        if m := re.match(r"# (\d+)\. ", line):
            step = m.group(1)
        out[step] = out.get(step, "") + line + "\n"
    return out


def uncommented(lines: str, command: str) -> str:
    """`lines` with the commented-out `command` (`# <command>...`) made live."""
    assert f"# {command}" in lines, f"no commented-out {command!r} in:\n{lines}"
    return lines.replace(f"# {command}", command)


def without(lines: str, command: str) -> str:
    """`lines` without those starting with `command`: a step the lab cannot take."""
    kept = [ln for ln in lines.splitlines() if not ln.startswith(command)]
    assert len(kept) < len(lines.splitlines()), f"no {command!r} in:\n{lines}"
    return "\n".join(kept) + "\n"
