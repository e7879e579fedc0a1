"""The fleet benchmark (bench/reflector_fleet/) keeps working against the simulator,
run tiny: it completes and its results are sane and non-empty. Never timing."""

from __future__ import annotations

from bench.reflector_fleet import markdown, run_cli, settings_for


def test_fleet_bench_on_the_simulator() -> None:
    settings = settings_for("small", server="sim", agents=(3,), services=4, endpoints=2,
                            changes=3, rate=20.0, first_lists=("cache", "consistent"),
                            deadline=60.0)
    result = run_cli(settings)
    assert [(r["first_list"], r["agents"]) for r in result["runs"]] == [
        ("cache", 3), ("consistent", 3)]
    for r in result["runs"]:
        start, churn = r["start"], r["churn"]
        # Every agent holds the preloaded objects: 4 slices, its own node, the services
        # (the simulator may add its own, `kubernetes`).
        assert start["objects_per_agent"]["EndpointSlice"] == 4
        assert start["objects_per_agent"]["Node"] == 1
        assert start["objects_per_agent"]["Service"] >= 4
        assert start["bytes_per_agent"] > 0
        assert start["all_synced_s"] >= start["median_synced_s"] >= 0
        assert start["apiserver"]["peak_rss_mib"] > 0
        assert churn["bytes_per_agent_per_change"] > 0
        assert churn["seconds_to_all_received"] > 0
    assert "| cache | 3 |" in markdown(result)
