"""The traffic-counting cost benchmark of the nftables mode keeps working (tiny; timings
reported, never asserted): every connection answered in every configuration, and the
scrape reads one series per port (and per endpoint when counted so). Needs root."""

from __future__ import annotations

import subprocess

import pytest

from bench.nftables.traffic_cost import CONFIGS, markdown, run

pytestmark = pytest.mark.root


def test_nft_traffic_cost_bench_runs_small() -> None:
    result = run(services=20, endpoints=3, connections=10, rounds=1)
    assert set(result["connect"]) == set(CONFIGS)
    assert all(c["n"] == 10 for c in result["connect"].values())
    # 20 ports; per endpoint: svc-0's one endpoint and 3 for each of the 19 others.
    assert result["scrape"]["per port"]["series"] == 20
    assert result["scrape"]["per endpoint"]["series"] == 20 + 1 + 19 * 3
    assert "| per endpoint |" in markdown(result)
    host = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout
    assert "sliceproxy" not in host
