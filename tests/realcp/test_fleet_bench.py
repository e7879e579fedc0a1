"""The fleet benchmark (bench/reflector_fleet/) keeps working on a real API server:
run tiny (both first-list modes), it completes and its results are sane and non-empty.
Never timing. On a control plane of its own: the bench restarts the API server before
each run, and the session's kube-controller-manager can lose its leader lease meanwhile
and exit, which left every later test of the tier without EndpointSlices."""

from __future__ import annotations

import pytest

from bench.reflector_fleet import delete_objects, markdown, preload, real_target, run, settings_for
from labs.realcp.build import Binaries
from labs.realcp.controlplane import ControlPlane

pytestmark = [pytest.mark.realcp, pytest.mark.root, pytest.mark.slow]


def test_fleet_bench_on_the_real_server(realcp_binaries: Binaries) -> None:
    settings = settings_for("small", server="real", agents=(3,), services=4, endpoints=2,
                            changes=3, rate=20.0, first_lists=("cache", "consistent"),
                            deadline=120.0)
    with ControlPlane(realcp_binaries) as cp, real_target(cp) as target:
        preload(target, settings, 3, lambda _: None)
        try:
            result = run(target, settings)
        finally:
            delete_objects(target, settings, 3)
    assert [(r["first_list"], r["agents"]) for r in result["runs"]] == [
        ("cache", 3), ("consistent", 3)]
    for r in result["runs"]:
        start, churn = r["start"], r["churn"]
        objects = start["objects_per_agent"]
        # The cluster may hold other tests' objects: at least ours.
        assert objects["EndpointSlice"] >= 4 and objects["Service"] >= 4
        assert objects["Node"] == 1  # its own, by field selector
        assert start["bytes_per_agent"] > 0
        for server in ("apiserver", "etcd"):
            assert start[server]["peak_rss_mib"] > 0
            assert start[server]["cpu_s"] >= 0
        assert churn["bytes_per_agent_per_change"] > 0
    assert "| consistent | 3 |" in markdown(result)
