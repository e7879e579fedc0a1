"""The log lines docs/logging.md promises an operator can alert on are the code's: each
is logged (read from the source, every call of every module) with exactly that message,
at that level, with no formatting inside the message, and with at least those keys.
And the JSON format (--logging-format json) is one object per line with Kubernetes'
keys."""

from __future__ import annotations

import ast
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

from proxy.agent import logs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "logging.md"
LEVELS = {"warning": "warning", "error": "error", "exception": "error", "info": "info"}


def documented() -> list[tuple[str, str, set[str]]]:
    rows = []
    section = DOC.read_text().split("## Lines to alert on", 1)[1]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            keys = {k.strip() for k in cells[2].split(",") if k.strip()}
            rows.append((cells[0].strip("`"), cells[1], keys))
    return rows


def _dict_keys(node: ast.AST, local_dicts: dict[str, set[str]]) -> set[str]:
    """The constant keys of a dict display, following `**name` into a dict assigned to
    that name in the same function."""
    if not isinstance(node, ast.Dict):
        return set()
    keys: set[str] = set()
    for k, v in zip(node.keys, node.values, strict=True):
        if k is None and isinstance(v, ast.Name):
            keys |= local_dicts.get(v.id, set())
        elif isinstance(k, ast.Constant) and isinstance(k.value, str):
            keys.add(k.value)
    return keys


def logged() -> dict[str, list[tuple[str, int, set[str]]]]:
    """message -> [(level, positional arguments after it, keys of `extra`)] of every
    `log.<level>("...")` call in proxy/."""
    out: dict[str, list[tuple[str, int, set[str]]]] = {}
    for path in sorted((ROOT / "proxy").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            local_dicts: dict[str, set[str]] = {}
            for node in ast.walk(func):
                target = None
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target, value = node.targets[0], node.value
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    target, value = node.target, node.value
                if isinstance(target, ast.Name):
                    local_dicts[target.id] = _dict_keys(value, {})
            for node in ast.walk(func):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in LEVELS and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)):
                    continue
                extra: set[str] = set()
                for kw in node.keywords:
                    if kw.arg == "extra":
                        extra = (local_dicts.get(kw.value.id, set())
                                 if isinstance(kw.value, ast.Name)
                                 else _dict_keys(kw.value, local_dicts))
                out.setdefault(node.args[0].value, []).append(
                    (LEVELS[node.func.attr], len(node.args) - 1, extra))
    return out


def test_every_documented_line_is_logged_as_documented() -> None:
    rows = documented()
    assert len(rows) >= 15, rows  # the table was read
    calls = logged()
    for message, level, keys in rows:
        assert "%" not in message, message
        assert message in calls, f"no log call with the message {message!r}"
        assert any(lvl == level and args == 0 and keys <= extra
                   for lvl, args, extra in calls[message]), (message, calls[message])


def test_json_lines_carry_kubernetes_keys_and_every_field() -> None:
    stream = io.StringIO()
    logs.setup(2, stream, fmt="json")
    try:
        log = logging.getLogger("proxy.test")
        log.info("sync done", extra={"service": "demo/web", "full": False, "lines": 3})
        log.log(logs.V(2), "shown at -v 2")
        log.log(logs.V(3), "hidden at -v 2")
        try:
            raise ValueError("the kernel said no")
        except ValueError:
            log.exception("the agent failed", extra={"msg_id": 7})
    finally:
        logs.setup(0, sys.stderr)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()
             if line.startswith("{")]
    assert [line["msg"] for line in lines] == ["sync done", "shown at -v 2", "the agent failed"]
    first, verbose, failed = lines
    assert isinstance(first["ts"], float) and first["level"] == "info" and first["v"] == 0
    assert (first["service"], first["full"], first["lines"]) == ("demo/web", False, 3)
    assert verbose["v"] == 2 and verbose["level"] == "v2"
    assert failed["level"] == "error" and "v" not in failed
    assert failed["err"] == "ValueError: the kernel said no"
    assert "Traceback" in failed["stacktrace"] and failed["msg_id"] == 7


def test_the_agent_logs_json_from_its_first_line(tmp_path: Path) -> None:
    """A start that fails at the kubeconfig (a subprocess, both servers off, a recording
    data plane: nothing touched on the host), with --logging-format json."""
    code = ("import sys\n"
            "from proxy.agent.main import run\n"
            "from proxy.config.options import parse_args\n"
            "from tests.integration.agent_harness import FakeDataPlane\n"
            "sys.exit(run(parse_args(sys.argv[1:]), dataplane_factory=FakeDataPlane))\n")
    proc = subprocess.run(
        [sys.executable, "-c", code, "--kubeconfig", str(tmp_path / "missing"),
         "--hostname-override", "n1", "--healthz-bind-address", "127.0.0.1:0",
         "--metrics-bind-address", "127.0.0.1:0", "--logging-format", "json"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines()]  # every line JSON
    assert lines[0]["msg"] == "sliceproxy starting" and lines[0]["node"] == "n1"
    (failed,) = [line for line in lines if line["level"] == "error"]
    assert failed["msg"] == "cannot start" and "missing" in failed["error"]
    assert not re.search(r"\blevel=", proc.stderr)  # no text line slipped through
