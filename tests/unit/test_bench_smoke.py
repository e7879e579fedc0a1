"""The model benchmark keeps working (run tiny; its timings are reported, never asserted)."""

from __future__ import annotations

from bench.model_bench import markdown, run


def test_model_bench_runs_small() -> None:
    result = run(services=40, endpoints=3, repeat=1)
    assert result["total_endpoints"] == 120
    assert result["one_endpoint_change_keys_changed"] == 1  # only the touched port changed
    assert result["model_memory_mib"] > 0
    assert "one endpoint change" in markdown(result)
