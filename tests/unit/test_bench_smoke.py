"""The in-process benchmarks keep working (run tiny; their timings are reported, never
asserted)."""

from __future__ import annotations

import gc

import pytest

from bench import start_budget
from bench.model_bench import markdown, run
from bench.nftables import encode_bench


def test_model_bench_runs_small() -> None:
    result = run(services=40, endpoints=3, repeat=1)
    assert result["total_endpoints"] == 120
    assert result["one_endpoint_change_keys_changed"] == 1  # only the touched port changed
    assert result["model_memory_mib"] > 0
    assert "one endpoint change" in markdown(result)


def test_start_budget_runs_small() -> None:
    result = start_budget.run(services=30, endpoints=3, runs=1)
    us = result["us_per_endpoint"]
    assert set(us) == set(start_budget.STEPS) and all(v >= 0 for v in us.values())
    assert result["start_us_per_endpoint"] > 0
    assert "the start" in start_budget.markdown(result)


@pytest.mark.usefixtures("collector_restored")
def test_encode_bench_runs_small() -> None:
    result = encode_bench.run(services=30, endpoints=3, changes=1)
    assert result["cold_messages"] > 0 and result["changes"] == 1
    assert result["resync_held_cpu_s"] > 0 and result["resync_cpu_s"] > 0
    assert gc.isenabled()  # the held resync gave the collector back
