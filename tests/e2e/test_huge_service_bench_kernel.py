"""The one-service-many-endpoints benchmark on the kernel planes (tiny; timings reported,
never asserted): the iptables and nftables runs build a network namespace of their own
and leave nothing in the host's. The planes that need no kernel:
tests/unit/test_huge_service_bench.py."""

from __future__ import annotations

import subprocess

import pytest

from bench.huge_service import markdown, run_plane

pytestmark = pytest.mark.root


def host_tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("plane", ["iptables", "nftables"])
def test_kernel_planes_run_small(plane: str) -> None:
    before = host_tables()
    result = run_plane(plane, 250, 4)
    if plane == "iptables":
        assert result["full_sync_lines"] > 250
        # The service chain is rewritten whole (every endpoint of the service): about
        # one line per ready endpoint, not the table.
        assert 240 < result["lines"]["p50"] < 300, result["lines"]
    else:
        # A slot map (250 endpoints): a change is the rule holding n and a few elements.
        assert result["full_sync_lines"] > 10
        assert 2 <= result["lines"]["p50"] <= 8, result["lines"]
    assert result["apply_ms"]["p50"] > 0 and result["render_ms"]["p99"] > 0
    assert plane in markdown([result])
    assert host_tables() == before
