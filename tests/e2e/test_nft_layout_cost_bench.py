"""The rule layout benchmark (bench/nftables/layout_cost.py) keeps working (tiny; timings
reported, never asserted): both layouts load into a lab node and take both changes, each
batch timed. Needs root."""

from __future__ import annotations

import subprocess

import pytest

from bench.nftables.layout_cost import CHANGES, LAYOUTS, markdown, run

pytestmark = pytest.mark.root


def test_nft_layout_cost_bench_runs_small() -> None:
    result = run(services=70, endpoints=3, changes=2, pick_max=8)
    assert [r["layout"] for r in result["layouts"]] == list(LAYOUTS)
    for r in result["layouts"]:
        assert r["lines"] > 70 and r["load"]["wall_s"] > 0
        assert all(r[kind]["max_ms"] >= r[kind]["median_ms"] > 0 for kind in CHANGES)
    assert "| maps |" in markdown(result)
    host = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout
    assert "bench-" not in host


def test_an_endpoint_count_past_the_pick_chains_is_refused() -> None:
    with pytest.raises(ValueError, match="--pick-max"):
        run(services=1, endpoints=8, changes=1, pick_max=8)
