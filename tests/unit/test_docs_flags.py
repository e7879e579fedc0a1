"""The flag tables in docs/ are the commands' own: every option a parser has is documented,
no documented option is missing from the parser, and the defaults the tables give are the
code's.

Each parser is caught as the command builds it (`python -m proxy`, `python -m proxy
explain`, `python -m proxy dump`, `python -m proxy.sim`, run in this process up to their
`parse_args`), so the test follows the commands wherever their modules live."""

from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"

# (command as run, the page, the first header cell of its table)
COMMANDS = [
    (("proxy",), "flags.md", "flag"),
    (("proxy", "explain"), "explain.md", "`explain` flag"),
    (("proxy", "dump"), "explain.md", "`dump` flag"),
    (("proxy.sim",), "simulator.md", "flag"),
]


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(module: str, *argv: str) -> argparse.ArgumentParser:
    """The parser `python -m MODULE ARGV...` builds, taken at its parse_args."""

    def catch(self: argparse.ArgumentParser, *_: Any, **__: Any) -> NoReturn:
        raise _Caught(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_known_args", catch)
        mp.setattr(sys, "argv", [module, *argv])
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        except _Caught as caught:
            return caught.parser
    raise AssertionError(f"python -m {module} {' '.join(argv)} parsed no arguments")


def table(page: str, first_header: str) -> dict[str, list[str]]:
    """The table on `page` whose header starts with `first_header`: each row's cells, keyed
    by every option (`-x`, `--xy`) or positional (`FILE`) its first cell names."""
    rows: dict[str, list[str]] = {}
    found = False
    for line in (DOCS / page).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            if found and rows:
                break
            continue
        if cells[0] == first_header:
            found = True
            continue
        if not found or set(cells[0]) <= set("-: "):
            continue
        for item in re.findall(r"`([^`]+)`", cells[0]):
            name = item.split()[0]
            assert name not in rows, f"{page}: {name} documented twice"
            rows[name] = cells
    assert found and rows, f"{page}: no table headed {first_header!r}"
    return rows


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = action.option_strings or [str(action.metavar or action.dest.upper())]
        out.update(dict.fromkeys(names, action))
    return out


def shown(value: Any) -> str | None:
    """A default as the docs write it, or None where the table need not give it."""
    if value is None or value is False or value in ("", [], argparse.SUPPRESS):
        return None
    if value is True:
        return "true"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        return f"{value[0]}:{value[1]}"  # host, port
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@pytest.mark.parametrize(("command", "page", "header"), COMMANDS,
                         ids=[" ".join(c[0]) for c in COMMANDS])
def test_the_docs_list_exactly_the_parsers_flags(command: tuple[str, ...], page: str,
                                                 header: str) -> None:
    parser = parser_of(*command)
    have = options(parser)
    documented = table(page, header)
    assert sorted(set(have) - set(documented)) == [], \
        f"docs/{page} lacks what `python -m {' '.join(command)} --help` lists"
    assert sorted(set(documented) - set(have)) == [], \
        f"docs/{page} lists what `python -m {' '.join(command)}` does not take"
    for name, action in have.items():  # defaults kept in the parser itself
        default = shown(action.default)
        if default is not None:
            assert f"`{default}`" in documented[name][1], (page, name, default)


def _config_defaults() -> dict[str, Any]:
    """The agent's defaults, from the Config dataclass (its flags default to None so that
    the config file can fill them), keyed by flag."""
    parser_of("proxy")  # imports the configuration module, wherever it lives
    for name, module in sorted(sys.modules.items()):
        config: Any = getattr(module, "Config", None)
        if name.startswith("proxy.") and hasattr(config, "as_dict") \
                and hasattr(config, "proxy_mode"):
            values = config().as_dict()
            values["v"] = values.pop("verbosity")
            return {("-v" if key == "v" else f"--{key}"): value
                    for key, value in values.items()}
    raise AssertionError("no Config with as_dict among proxy's modules")


def test_the_agents_defaults_are_the_codes() -> None:
    documented = table("flags.md", "flag")
    flags = options(parser_of("proxy"))
    checked = 0
    for flag, value in _config_defaults().items():
        if flag not in flags or value == "0s":  # 0s: derived (--healthz-threshold)
            continue
        default = "off" if value is False else shown(value)
        if default is None:
            continue
        assert flag in documented, f"docs/flags.md lacks {flag}"
        cell = documented[flag][1]
        assert (default in cell) if default == "off" else (f"`{default}`" in cell), \
            (flag, value, cell)
        checked += 1
    assert checked >= 10
    # switches that default to off
    for flag in ("--masquerade-all", "--cleanup", "--no-uvloop"):
        assert documented[flag][1] == "off", flag
