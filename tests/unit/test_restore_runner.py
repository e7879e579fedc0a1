"""The runner's own parts: binary names, reading iptables-restore's complaints, and
reading iptables-save's output line by line (through stand-in programs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    RunnerError,
    binary,
    parse_restore_error,
)
from proxy.dataplane.xtables.saved import RestoreText, Table
from proxy.model.types import Family

TEXT = "*nat\n:SPX-X - [0:0]\n-A SPX-X -j NOPE\nCOMMIT\n"


def test_binary_names_match_debian() -> None:
    assert binary(Family.V4, Backend.LEGACY, "restore") == "iptables-legacy-restore"
    assert binary(Family.V6, Backend.NFT, "save") == "ip6tables-nft-save"
    assert binary(Family.V4, Backend.NFT) == "iptables-nft"


def test_parse_error_occurred_at_line() -> None:
    stderr = ("iptables-restore v1.8.9 (legacy): Couldn't load target `NOPE':No such file\n\n"
              "Error occurred at line: 3\nTry `iptables-restore -h' for more information.")
    assert parse_restore_error(stderr, TEXT) == (3, "-A SPX-X -j NOPE")


def test_parse_line_failed() -> None:
    stderr = "iptables-nft-restore: line 4 failed: No chain/target/match by that name."
    assert parse_restore_error(stderr, TEXT) == (4, "COMMIT")


def test_parse_unknown_or_out_of_range() -> None:
    assert parse_restore_error("iptables-restore: unable to initialize table 'nat'", TEXT) == (
        None, None)
    assert parse_restore_error("iptables-restore: line 99 failed", TEXT) == (99, None)


def test_restore_error_names_a_line_of_a_streamed_text() -> None:
    text = RestoreText()
    text.write_chain(Table.NAT, "SPX-A", ["-j RETURN", "-j NOPE"])
    # *nat, one declaration, then the chain's two rules.
    assert parse_restore_error("iptables-restore: line 4 failed", text) == (4, "-A SPX-A -j NOPE")
    assert parse_restore_error("iptables-restore: line 9 failed", text) == (9, None)


def _program(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-save"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_save_lines_gives_each_line_then_the_failure(tmp_path: Path) -> None:
    runner = IptablesRunner(Family.V4, Backend.LEGACY)
    runner.save_cmd = _program(tmp_path, "printf '*nat\\n:SPX-A - [0:0]\\nCOMMIT\\n'")
    assert list(runner.save_lines()) == ["*nat", ":SPX-A - [0:0]", "COMMIT"]
    runner.save_cmd = _program(tmp_path, "echo '*nat'; echo 'no table' >&2; exit 3")
    lines = runner.save_lines()
    assert next(lines) == "*nat"  # what came before the failure is read as it comes
    with pytest.raises(RunnerError, match="exited 3: no table"):
        next(lines)
    runner.save_cmd = str(tmp_path / "missing")
    with pytest.raises(RunnerError, match="missing"):
        list(runner.save_lines())
