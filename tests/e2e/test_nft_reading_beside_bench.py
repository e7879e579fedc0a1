"""The bench of changes beside a traffic reading keeps working (tiny; timings reported,
never asserted): every reading covers every port, changes were synced while one ran on
its own thread, and the node's tables went with the lab. Needs root."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.nftables.reading_beside import markdown, run
from proxy.agent.main import SWITCH_INTERVAL

pytestmark = pytest.mark.root


def test_nft_reading_beside_bench_runs_small() -> None:
    was = sys.getswitchinterval()
    result = run(services=300, endpoints=3, pace=0.001, rounds=1)
    assert [b["ports"] for b in result["beside"]] == [300, 300]
    assert all(b["changes"] >= 1 for b in result["beside"])
    assert "| back to back |" in markdown(result)
    assert result["switch_interval_s"] == SWITCH_INTERVAL
    assert result["give_way"]  # as the agent reads
    assert sys.getswitchinterval() == was  # the caller's interval given back
    host = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout
    assert "sliceproxy" not in host
