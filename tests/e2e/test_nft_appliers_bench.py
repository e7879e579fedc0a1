"""The nf_tables applier benchmark keeps working (tiny; timings reported, never asserted),
and writes only into the namespaces it makes. Needs root, like the e2e tests."""

from __future__ import annotations

import subprocess

import pytest

from bench.nftables.appliers import APPLIERS, TABLE, markdown, run_one

pytestmark = pytest.mark.root


def host_tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("applier", APPLIERS)
def test_nft_appliers_bench_runs_small(applier: str) -> None:
    result = run_one(applier, services=12, changes=2)
    assert result["chains_made"] == 12
    if applier != "pyroute2":
        # The last change (service 7, generation 2) is what the kernel holds now.
        assert "198.19.2.8 . 8080" in result["last_change"], result["last_change"]
        assert "198.19.0.8" not in result["last_change"]
    assert applier in markdown([result])
    assert f"table ip {TABLE}" not in host_tables()
