"""No shell, ever: the agent runs programs with argument lists, never a command line a
shell would parse, so no string from the API server can become a command
(docs/security.md, "Programs the agent runs"). A source scan of proxy/, as a guard.

Also a guard on the one text format the agent feeds to a program that API strings reach:
iptables-restore input, whose rule comments name the service port.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.iptables.render import render_port
from proxy.model.types import Family
from tests.unit import builders
from tests.unit.builders import ep, eps_slice, model_of, service

PROXY = Path(__file__).resolve().parents[2] / "proxy"

# Calls that hand a string to /bin/sh.
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"),
               ("subprocess", "getstatusoutput"), ("asyncio", "create_subprocess_shell"),
               ("pty", "spawn")}


def _dotted(node: ast.expr) -> tuple[str, ...]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return tuple(reversed(parts))


def shell_uses(source: str, name: str = "<source>") -> list[str]:
    """Every place in `source` that would run a shell: `shell=` anything but a literal
    False, or a call of one of SHELL_CALLS (however it was imported)."""
    tree = ast.parse(source, name)
    aliases: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (node.module, alias.name) in SHELL_CALLS:
                    aliases[alias.asname or alias.name] = (node.module, alias.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        where = f"{name}:{node.lineno}"
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                          and kw.value.value is False):
                found.append(f"{where}: shell={ast.unparse(kw.value)}")
        dotted = _dotted(node.func)
        if dotted[-2:] in SHELL_CALLS or (len(dotted) == 1 and dotted[0] in aliases):
            found.append(f"{where}: {'.'.join(dotted)}()")
    return found


def sources() -> list[Path]:
    files = sorted(PROXY.rglob("*.py"))
    assert len(files) > 50, "the scan must see the whole package"
    return files


def test_no_shell_anywhere_in_the_agent() -> None:
    found = [use for path in sources()
             for use in shell_uses(path.read_text(encoding="utf-8"),
                                   str(path.relative_to(PROXY.parent)))]
    assert found == []


def test_programs_are_run_with_argument_lists() -> None:
    """The scan sees the real calls (it is not vacuous); none passes one command string
    (`create_subprocess_exec` takes the program and its arguments one by one)."""
    calls = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _dotted(node.func) in (
                    ("subprocess", "run"), ("subprocess", "Popen"),
                    ("asyncio", "create_subprocess_exec")):
                calls.append((path.name, node))
    assert {name for name, _ in calls} >= {"restore_runner.py", "kernel.py", "nodeports.py"}
    for name, call in calls:
        if _dotted(call.func)[-1] == "create_subprocess_exec":
            continue
        first = call.args[0] if call.args else None
        assert not isinstance(first, ast.Constant | ast.JoinedStr), \
            f"{name}:{call.lineno} passes a command string"


@pytest.mark.parametrize("snippet", [
    "import os\nos.system('ls')",
    "import subprocess\nsubprocess.run('ls', shell=True)",
    "import subprocess\nsubprocess.check_output(['ls'], shell=flag)",
    "from subprocess import getoutput as go\ngo('ls')",
    "import asyncio\nasyncio.create_subprocess_shell('ls')",
    "import os\nos.popen('ls')",
])
def test_the_scan_catches_each_way_of_running_a_shell(snippet: str) -> None:
    assert len(shell_uses(snippet)) == 1


def test_the_scan_lets_argument_lists_through() -> None:
    assert shell_uses("import subprocess\nsubprocess.run(['ls'], shell=False)") == []
    assert shell_uses("import subprocess\nsubprocess.run(['ls'], check=True)") == []


# A name a real API server refuses (names are DNS-1123, port names IANA service names)
# but a hostile or broken one could send: a line break would end the rule's line in the
# iptables-restore input and start another rule of the server's choosing.
HOSTILE_PORT_NAME = 'x\n-I PREROUTING -p tcp --dport 22 -j DNAT --to-destination 203.0.113.9\n#'


def test_api_strings_cannot_add_lines_to_iptables_restore_input() -> None:
    port = {"name": HOSTILE_PORT_NAME, "port": 80}
    model = model_of(builders.node(), service(ports=(port,)),
                     eps_slice("s1", [ep("198.18.1.10")],
                               ports=({"name": HOSTILE_PORT_NAME, "port": 8080},)))
    ctx = RenderContext(Family.V4)
    for rsp in model.resolve():
        for line in render_port(rsp, ctx).lines():
            assert not any(ch in line for ch in "\n\r\0"), line
