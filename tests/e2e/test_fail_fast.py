"""Failing fast on a vanished backend (common/fail_fast.py), with real connections: a
client waiting in recv() on a TCP connection through a service to a pod that dies and
leaves the slice gets ECONNRESET at once, not minutes of silence; a terminating pod
that still serves keeps its connections. In every rule-based mode (iptables on both
back ends, nftables): the reset's table is the shared layer's own, beside each.

The lab's client is outside the pod network, so its flows are masqueraded (the reply
goes to the node's address): the provoking segment follows the reply tuple. The node's
own connections (host network) go through nat OUTPUT and our output chain."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.ctnetlink import ConntrackSocket
from proxy.dataplane.common.netlink_constants import IPS_SRC_NAT
from proxy.dataplane.xtables.restore_runner import Backend
from proxy.model.types import Family
from proxy.netns_lab import BackendSpec, Lab, poll, probe
from proxy.netns_lab.netns import entered
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    namespace_object,
    node_object,
    start_sim,
)
from tests.e2e.agent_support import service as agent_service
from tests.e2e.conftest import POD_CIDRS, Cluster, NodePlane
from tests.unit.builders import ep, eps_slice, service

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

VIPS = {Family.V4: "198.18.128.20", Family.V6: "fd00:198:18::20"}
PORTS = ({"name": "http", "port": 80},)
SLICE_PORTS = ({"name": "http", "port": 8080},)
GOAL = 2.0  # seconds from the endpoint's removal to the client's error (issue 39)
PLANES = {"legacy": ("iptables", Backend.LEGACY), "nft": ("iptables", Backend.NFT),
          "nftables": ("nftables", None)}


@pytest.fixture
def lab() -> Iterator[Lab]:
    # A lab per test: a backend is killed in each.
    with Lab([BackendSpec("web-1"), BackendSpec("web-2")]) as lab:
        lab.start_backends()
        yield lab


def _plane(lab: Lab, name: str, node_wide: bool) -> NodePlane:
    mode, backend = PLANES[name]
    options = DataplaneOptions("node-a", cluster_cidrs=POD_CIDRS, fail_fast=node_wide)
    return NodePlane(lab.node_ns, backend, options=options, mode=mode)


def _objects(lab: Lab, annotated: bool,
             **conditions: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The dual-stack service and its slices: every backend, with `conditions` by name;
    a name whose conditions are None has left the slices."""
    annotations = {"sliceproxy.io/fail-fast": "true"} if annotated else None
    out = [service("web", ips=tuple(VIPS.values()), ports=PORTS, annotations=annotations,
                   ipFamilies=["IPv4", "IPv6"])]
    for family in Family:
        eps = [ep(str(b.ipv4 if family is Family.V4 else b.ipv6), node=b.node,
                  **(conditions.get(b.name) or {}))
               for b in lab.backends.values() if conditions.get(b.name, {}) is not None]
        out.append(eps_slice(f"web-{family.label.lower()}", eps, service_name="web",
                             ports=SLICE_PORTS, address_type=family.label))
    return out


class Waiting(probe.Idle):
    """A connection's client blocked in recv() on the service's address."""

    def __init__(self, ns: str, family: Family = Family.V4) -> None:
        super().__init__(ns, VIPS[family], 80)

    def reset_since(self, since: float, within: float = GOAL + 1,
                    detail: Callable[[], object] | None = None) -> float:
        """Polled a little past the goal."""
        return super().reset_since(since, within, detail)


def _masqueraded(lab: Lab, family: Family) -> bool:
    with entered(lab.node_ns):
        sock = ConntrackSocket()
        try:
            flows = [e for e in sock.dump(family, (6,)) if str(e.dst) == VIPS[family]]
        finally:
            sock.close()
    return bool(flows) and all(e.status & IPS_SRC_NAT for e in flows)


def _kill(lab: Lab, name: str) -> None:
    """The pod dies: nothing answers at its address any more."""
    lab.exec(lab.backends[name].ns, ["ip", "link", "set", "eth0", "down"], check=True)


# (plane, opted in by, client, family): every plane by annotation and by flag from the
# client namespace (masqueraded), over IPv4 and IPv6; a host-network client (nat
# OUTPUT, our output chain) beside iptables-legacy and beside the nftables mode.
CASES = [*((p, how, "client", Family.V4) for p in PLANES for how in ("annotation", "flag")),
         *((p, "annotation", "client", Family.V6) for p in PLANES),
         ("legacy", "annotation", "node", Family.V4),
         ("nftables", "annotation", "node", Family.V4)]


@pytest.mark.parametrize(("plane_name", "how", "client", "family"), CASES,
                         ids=lambda v: v.label if isinstance(v, Family) else v)
def test_client_of_a_vanished_endpoint_gets_a_reset_within_2s(
        lab: Lab, plane_name: str, how: str, client: str, family: Family) -> None:
    plane = _plane(lab, plane_name, node_wide=how == "flag")
    try:
        cluster = Cluster()
        plane.sync(cluster.become(*_objects(lab, how == "annotation")), full=True)
        waiting = Waiting(lab.client_ns if client == "client" else lab.node_ns, family)
        try:
            if client == "client":  # the case the reply tuple's destination is for
                assert _masqueraded(lab, family), "the lab's client flow is not masqueraded"
            _kill(lab, waiting.backend)
            removed = time.monotonic()
            plane.sync(cluster.become(*_objects(lab, how == "annotation",
                                                **{waiting.backend: None})))
            took = waiting.reset_since(removed)
            print(f"fail fast ({plane_name}, {how}, {client}, {family.label}): ECONNRESET "
                  f"{took:.3f} s after the removal")
            assert took <= GOAL
        finally:
            waiting.close()
    finally:
        plane.cleanup()


@pytest.mark.parametrize("plane_name", ["nft", "nftables"])
def test_terminating_endpoint_still_serving_keeps_its_connection(
        lab: Lab, plane_name: str) -> None:
    plane = _plane(lab, plane_name, node_wide=True)
    try:
        cluster = Cluster()
        plane.sync(cluster.become(*_objects(lab, True)), full=True)
        waiting = Waiting(lab.client_ns)
        try:
            draining = {"ready": False, "serving": True, "terminating": True}
            report = plane.sync(cluster.become(*_objects(lab, True,
                                                         **{waiting.backend: draining})))
            assert not report.full
            # New connections go elsewhere; the held one still talks to its pod (a reset,
            # had one been provoked, would have come back within milliseconds of the sync).
            other = {"web-1", "web-2"} - {waiting.backend}
            assert lab.ask(lab.client_ns, VIPS[Family.V4], 80, count=10) == {other.pop(): 10}
            waiting.sock.sendall(b"who\n")
            poll.wait(lambda: waiting.ended, 2.0, "the pod's answer")
            assert waiting.ended is not None and waiting.ended[0] == (
                f"data {(waiting.backend + chr(10)).encode()!r}")
        finally:
            waiting.close()
    finally:
        plane.cleanup()


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_real_agent_resets_within_2s_of_the_slice_write(lab: Lab, tmp_path: Path,
                                                        mode: str) -> None:
    """The whole path: the slice written to the API server (the simulator), the agent's
    watch, its sync, the reset. The node's --fail-fast, no annotation."""
    vip = VIPS[Family.V4]
    b = lab.backends
    with start_sim(lab, [node_object(), namespace_object("demo")]) as sim:
        sim.apply(agent_service("web", [vip]))
        sim.apply(endpoint_slice("web-v4", "web", [endpoint(b[n].ipv4) for n in b]))
        agent = AgentProcess(lab, sim, tmp_path, "--proxy-mode", mode, "--fail-fast").start()
        try:
            agent.wait_ready()
            lab.wait_for(lab.client_ns, vip, 80, set(b))
            waiting = Waiting(lab.client_ns)
            try:
                _kill(lab, waiting.backend)
                removed = time.monotonic()
                sim.apply(endpoint_slice("web-v4", "web", [
                    endpoint(b[n].ipv4) for n in b if n != waiting.backend]))
                took = waiting.reset_since(removed, detail=agent.log_tail)
                print(f"fail fast (agent, {mode}): ECONNRESET {took:.3f} s after the "
                      "slice was written")
                assert took <= GOAL
            finally:
                waiting.close()
            # Counted once the sync that reset it has reported (it logs after the reset).
            poll.wait(lambda: agent.metrics().get("sliceproxy_tcp_flows_reset_total", 0) >= 1,
                      10, "the reset counted in /metrics",
                      detail=lambda: agent.metrics().get("sliceproxy_tcp_flows_reset_total"))
        finally:
            agent.stop()


def test_another_service_to_the_same_pod_keeps_its_connection(lab: Lab) -> None:
    """A service deleted: its endpoints vanish from it alone. A connection to the same
    pod through another service is that service's, and stays."""
    vip2 = "198.18.128.21"
    pod = lab.backends["web-1"]

    def objects(*names: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for name, vip in (("web", VIPS[Family.V4]), ("other", vip2)):
            if name in names:
                out += [service(name, ips=(vip,), ports=PORTS,
                                annotations={"sliceproxy.io/fail-fast": "true"}),
                        eps_slice(f"{name}-a", [ep(str(pod.ipv4), node=pod.node)],
                                  service_name=name, ports=SLICE_PORTS)]
        return out

    plane = _plane(lab, "nftables", node_wide=False)
    try:
        cluster = Cluster()
        plane.sync(cluster.become(*objects("web", "other")), full=True)
        doomed = Waiting(lab.client_ns)
        with lab.hold(lab.client_ns, vip2, 80) as kept:
            assert kept.ask() == doomed.backend == "web-1"
            try:
                removed = time.monotonic()
                plane.sync(cluster.become(*objects("other")))
                assert doomed.reset_since(removed) <= GOAL
                assert kept.ask() == "web-1"  # after the reset: nothing was sent its way
            finally:
                doomed.close()
    finally:
        plane.cleanup()
