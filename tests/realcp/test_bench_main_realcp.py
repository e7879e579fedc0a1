"""`python -m bench --size small` keeps working for the scenarios on the real control plane
(each starts its own): the cold start and one change beside kube-proxy, and N agents on
one API server (both first-list modes; the bench restarts its own API server before each
run); their tables and plots land in RESULTS.md. Nothing asserted on time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import __main__ as bench_main
from labs.realcp.build import Binaries

pytestmark = [pytest.mark.realcp, pytest.mark.root, pytest.mark.slow]


def test_small_run_on_the_real_control_plane(realcp_binaries: Binaries,
                                             tmp_path: Path) -> None:
    # realcp_binaries: built (or found in the cache) once for the tier, before the
    # scenarios' own control planes look for them.
    status = bench_main.main(["--size", "small", "--only", "cold-start", "fleet",
                              "--out", str(tmp_path)])
    text = (tmp_path / "RESULTS.md").read_text()
    assert status == 0, text
    saved = json.loads((tmp_path / "results-small.json").read_text())["results"]
    (cold,) = saved["cold-start"]
    for proxy in ("sliceproxy", "sliceproxy-nftables", "kube-proxy"):
        assert cold["result"]["proxies"][proxy]["latency"]["missed"] == 0, proxy
    (fleet,) = saved["fleet"]
    runs = fleet["result"]["runs"]
    assert [(r["first_list"], r["agents"]) for r in runs] == [("cache", 3), ("consistent", 3)]
    for r in runs:
        start, churn = r["start"], r["churn"]
        objects = start["objects_per_agent"]
        assert objects["EndpointSlice"] >= 20 and objects["Service"] >= 20, objects
        assert objects["Node"] == 1, objects  # its own, by field selector
        assert start["bytes_per_agent"] > 0 and churn["bytes_per_agent_per_change"] > 0
        for server in ("apiserver", "etcd"):
            assert start[server]["peak_rss_mib"] > 0
        assert start["apiserver"]["cpu_s"] > 0
    assert "readiness write -> rule" in text and "first list" in text
    for name in ("cold-start", "fleet"):
        assert (tmp_path / "plots" / f"{name}-small.png").read_bytes()[:4] == b"\x89PNG"
