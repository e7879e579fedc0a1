"""The nftables mode's change-cost benchmark per balancing algorithm keeps working (tiny;
timings reported, never asserted): every kind of port changes by a partial sync. Needs
root."""

from __future__ import annotations

import subprocess

import pytest

from bench.nftables.balancing_cost import KINDS, markdown, run

pytestmark = pytest.mark.root


def test_nft_balancing_cost_bench_runs_small() -> None:
    result = run(services=9, endpoints=10, changes=2)
    assert set(result["change"]) == set(KINDS)
    assert all(c["n"] == 2 and c["operations"] > 0 for c in result["change"].values())
    assert result["table_size"] == 4093
    assert "| maglev |" in markdown(result)
    host = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout
    assert "sliceproxy" not in host
