"""The per-connection cost benchmark of the nftables shards keeps working (tiny;
timings reported, never asserted), and leaves nothing in the host. Needs root."""

from __future__ import annotations

import subprocess

import pytest

from bench.nftables.conn_cost import markdown, run

pytestmark = pytest.mark.root


def test_nft_conn_cost_bench_runs_small() -> None:
    result = run(services=20, connections=10, rounds=1)
    configs = result["configs"]
    assert set(configs) == {"no rules", "sharded", "one table"}
    assert configs["one table"]["shards"] == 1 and configs["no rules"]["shards"] == 0
    # Every connect was answered (a refused or timed-out one raises), on every path.
    assert configs["sharded"]["service"]["n"] == 10
    assert configs["no rules"]["no service"]["n"] == 10 and "service" not in configs["no rules"]
    assert "| sharded |" in markdown(result)
    host = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout
    assert "sliceproxy" not in host
