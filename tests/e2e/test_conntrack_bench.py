"""bench/conntrack.py kept working, at a tiny size (figures printed, never asserted): it
makes and deletes its own network namespace."""

from __future__ import annotations

import subprocess

import pytest

from bench.conntrack import markdown, measure, reconcile_cost

pytestmark = pytest.mark.root


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          check=True).stdout


def test_conntrack_bench_runs_small() -> None:
    before = namespaces()
    result = measure(udp=500, tcp=200, delete=100, runs=1)
    for key in ("ours_filtered", "ours_unfiltered", "pyroute2_dump", "ours_delete",
                "pyroute2_delete"):
        assert result[key]["median"] > 0, key
    assert "500 + 200" in markdown([result])
    assert namespaces() == before


def test_reconcile_bench_runs_small_and_deletes_exactly_the_stale_flows() -> None:
    before = namespaces()
    # 600 flows over 60 services, 10 each, spread over each service's three endpoints;
    # every tenth service lost its first endpoint: the 20 flows DNATed to those go.
    result = reconcile_cost(udp=600, services=60, gone_every=10, runs=1)
    assert result["reconcile"]["median"] > 0
    assert result["deleted"] == sum(1 for n in range(600) if n % 60 % 10 == 0 and n % 3 == 0)
    assert namespaces() == before
