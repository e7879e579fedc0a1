"""expire_nodest_conn is 0 exactly while real servers are moved (ipvs/moves.py), and
put back after, whatever happens inside; untouched when nothing moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.dataplane.ipvs.moves import connections_kept


def test_zero_while_moving_then_put_back(tmp_path: Path) -> None:
    sysctl = tmp_path / "expire_nodest_conn"
    sysctl.write_text("1\n")
    with connections_kept(3, sysctl):
        assert sysctl.read_text() == "0"
    assert sysctl.read_text() == "1"
    with pytest.raises(RuntimeError), connections_kept(1, sysctl):
        raise RuntimeError("the exchange failed")
    assert sysctl.read_text() == "1"


def test_untouched_when_nothing_moves_or_already_zero(tmp_path: Path) -> None:
    sysctl = tmp_path / "expire_nodest_conn"
    sysctl.write_text("1\n")
    with connections_kept(0, sysctl):
        assert sysctl.read_text() == "1\n"
    sysctl.write_text("0\n")
    with connections_kept(2, sysctl):
        assert sysctl.read_text() == "0\n"
    assert sysctl.read_text() == "0\n"
    with connections_kept(2, tmp_path / "absent"):  # no IPVS sysctl: nothing to do
        pass
    assert not (tmp_path / "absent").exists()
