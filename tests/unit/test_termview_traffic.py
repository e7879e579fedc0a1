"""The terminal view of a dump with traffic counts (proxy/cmd/termview.py): the port's
total on its own line, and each endpoint's connections beside what the rules chose,
where the port is counted per endpoint."""

from __future__ import annotations

from typing import Any

from proxy.cmd.termview import render


def doc(traffic: dict[str, Any] | None) -> dict[str, Any]:
    endpoints = [{"endpoint": f"198.18.1.1{i}:8080", "ready": True, "node": "node-a",
                  "selected_for": ["cluster"], "reason": "cluster: ready"} for i in (0, 1)]
    return {"node": {"name": "node-a"}, "services": [{
        "service": "demo/web", "port": "http", "family": "IPv4", "protocol": "TCP",
        "port_number": 80, "cluster_ips": ["198.18.128.10"],
        "policies": {"internal": "Cluster", "external": "Cluster"},
        "topology": {"mode": "none", "reason": "no topology requested"},
        "endpoints": endpoints, "applied_rules": [], "traffic": traffic}]}


def test_each_endpoints_connections_sit_beside_what_the_rules_chose() -> None:
    text = render(doc({"connections": 12, "endpoints": {
        "198.18.1.10:8080": {"connections": 7}, "198.18.1.11:8080": {"connections": 5}}}))
    lines = text.splitlines()
    assert "  traffic  12 new connections" in lines
    header = next(line for line in lines if "ENDPOINT" in line)
    assert header.split() == ["ENDPOINT", "STATE", "NODE", "ZONE", "CHOSEN", "CONNS", "REASON"]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  198.18.1.")}
    assert rows["198.18.1.10:8080"][5] == "7" and rows["198.18.1.11:8080"][5] == "5"


def test_a_port_counted_per_port_says_how_to_count_its_endpoints() -> None:
    text = render(doc({"connections": 3, "endpoints": None}))
    assert ("  traffic  3 new connections (counted per port: "
            "sliceproxy.io/traffic-per-endpoint for each endpoint's)") in text.splitlines()
    assert "CONNS" not in text
    # No reading (explain, offline): no traffic line at all.
    assert "traffic" not in render(doc(None))
