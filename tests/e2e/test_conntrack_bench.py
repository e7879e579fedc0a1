"""bench/conntrack.py kept working, at a tiny size (figures printed, never asserted): it
makes and deletes its own network namespace."""

from __future__ import annotations

import subprocess

import pytest

from bench.conntrack import markdown, measure

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
