"""Size limits of docs/architecture.md, checked from the source: no function in proxy/
longer than 80 lines, no class longer than 400. Past those, a unit holds more than one
job and a newcomer has to read all of it to change a part."""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "proxy"
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400


def oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit, kind = MAX_FUNCTION_LINES, "function"
            elif isinstance(node, ast.ClassDef):
                limit, kind = MAX_CLASS_LINES, "class"
            else:
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                where = path.relative_to(root.parent)
                found.append(f"{where}:{node.lineno} {kind} {node.name}: {lines} lines")
    return found


def test_no_function_or_class_past_its_limit() -> None:
    assert oversized(PROXY) == []


def test_the_check_names_a_method_one_line_too_long(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (root / "m.py").write_text(f"class A:\n    def ok(self) -> None:\n{body}\n"
                               f"    def long(self) -> None:\n{body}\n        y = 0\n")
    long_at = 2 + MAX_FUNCTION_LINES  # after "class A:", ok's def line and its body
    assert oversized(root) == [
        f"pkg/m.py:{long_at} function long: {MAX_FUNCTION_LINES + 1} lines"]
