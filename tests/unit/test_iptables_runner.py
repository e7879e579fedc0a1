"""The runner's pure parts: binary names and reading iptables-restore's complaints."""

from __future__ import annotations

from proxy.dataplane.iptables.runner import Backend, binary, parse_restore_error
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
