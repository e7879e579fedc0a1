"""Faults in what the cluster says: a service flapping between no endpoints and some
(UDP included: a client keeping one socket must not be blackholed when they come back,
kubernetes issue 48370), the node losing its zone label, the node's own Node object
deleted and created again."""

from __future__ import annotations

import time

import pytest

from proxy.netns_lab.probe import UdpFlow
from tests.e2e.agent_support import endpoint, endpoint_slice, node_object, service, wait_for
from tests.faults.conftest import BOTH_PORTS, FaultNode, settle

pytestmark = pytest.mark.root

FLAP = "198.18.128.40"
NEAR = "198.18.128.50"
CYCLES = 3


def test_service_flapping_between_none_and_some(fault_node: FaultNode) -> None:
    node, lab, sim = fault_node, fault_node.lab, fault_node.sim
    web1 = lab.backends["web-1"]
    some = [endpoint(web1.ipv4, node=web1.node)]
    sim.apply(service("flap", [FLAP], BOTH_PORTS))
    sim.apply(endpoint_slice("flap-1", "flap", some, BOTH_PORTS))
    sticky = UdpFlow(lab.client_ns, FLAP, 53, timeout=0.3)  # what a resolver does
    try:
        wait_for(lambda: sticky.ask() == "web-1", 15.0, "flap answering")
        returns: list[float] = []
        with node.traffic() as traffic:
            began = time.monotonic()
            for _ in range(CYCLES):
                sim.apply(endpoint_slice("flap-1", "flap", [], BOTH_PORTS))
                wait_for(lambda: sticky.ask() is None, 15.0, "flap without endpoints")
                settle(1.0)  # the client keeps asking into the void
                written = time.monotonic()
                sim.apply(endpoint_slice("flap-1", "flap", some, BOTH_PORTS))
                wait_for(lambda: sticky.ask() == "web-1", 15.0,
                         "the same UDP socket answered again (no blackhole)")
                returns.append(time.monotonic() - written)
        report = traffic.report(since=began)
    finally:
        sticky.close()
    node.record(f"service flapping 0<->1 x{CYCLES} (UDP, one socket)", report,
                max(returns), restarts=node.restarts(),
                notes="converge: endpoints back -> the same UDP socket answered")
    assert report.failed == 0, report.failures()  # the other services never noticed
    assert node.agent.alive() and node.restarts() == 0


def test_zone_label_lost_and_node_deleted_and_recreated(fault_node: FaultNode) -> None:
    node, lab, sim = fault_node, fault_node.lab, fault_node.sim
    b = lab.backends
    sim.apply(service("near", [NEAR], trafficDistribution="PreferClose"))
    sim.apply(endpoint_slice("near-1", "near", [
        endpoint(b["web-1"].ipv4, node="node-a", zone="zone-a"),
        endpoint(b["web-2"].ipv4, node="node-b", zone="zone-b")]))
    lab.wait_for(lab.client_ns, NEAR, 80, {"web-1"})
    with node.traffic() as traffic:
        began = time.monotonic()
        unlabelled = node_object()
        del unlabelled["metadata"]["labels"]["topology.kubernetes.io/zone"]
        sim.apply(unlabelled)
        lab.wait_for(lab.client_ns, NEAR, 80, {"web-1", "web-2"})  # no zone: whole cluster
        sim.delete("v1", "Node", "node-a", namespace=None)
        settle(2.0)
        assert node.agent.alive()
        sim.apply(node_object())  # back, in zone-a
        lab.wait_for(lab.client_ns, NEAR, 80, {"web-1"})
        converged = time.monotonic() - began
    report = traffic.report(since=began)
    node.record("zone label lost; own Node deleted and re-created", report, converged,
                restarts=node.restarts(), notes="converge: the whole sequence")
    assert report.failed == 0, report.failures()
    assert node.agent.alive() and node.restarts() == 0
