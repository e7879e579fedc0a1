"""Real traffic through the rules IptablesDataPlane (both back ends) and NftablesDataPlane
write in a lab's node namespace: connections from the client namespace (or the node
itself) to service addresses, answered by echo backends that say their name.

Which endpoints each kind of traffic may reach under each policy is checked on the rules
themselves by the packet tracer (tests/unit/test_trace_modes.py); what stays here is
what only a kernel shows: real spreading, REJECT answered at once, conntrack keeping
and clearing flows, hairpin and affinity as the kernel carries them out, a refused
restore."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.dataplane.base import ApplyError
from proxy.dataplane.xtables.restore_runner import Backend, IptablesRunner, RestoreInput, whole
from proxy.model.types import Family
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.netns import entered
from tests.e2e.conftest import Cluster, NodePlane
from tests.unit.builders import ep, eps_slice, service

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

VIP4, VIP6 = "198.18.128.10", "fd00:198:18::10"
EXTERNAL_IP = "198.18.2.100"  # off every lab link: the client routes it via the node
PORTS = ({"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"})
SLICE_PORTS = ({"name": "http", "port": 8080},
               {"name": "dns", "port": 8081, "protocol": "UDP"})


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    specs = [BackendSpec("web-1"), BackendSpec("web-2"), BackendSpec("web-3"),
             BackendSpec("web-4", node="node-b")]
    with Lab(specs) as lab:
        lab.start_backends()
        # The kernel rate-limits ICMP errors per peer (a burst of 6, then one a second),
        # REJECT's included: one client firing many probes would see timeouts after
        # its first few refusals. A real client's one connection is refused at once.
        lab.sysctl(lab.node_ns, "net.ipv4.icmp_ratelimit", "0")
        lab.sysctl(lab.node_ns, "net.ipv6.icmp.ratelimit", "0")
        yield lab


PLANES = {"legacy": ("iptables", Backend.LEGACY), "nft": ("iptables", Backend.NFT),
          "nftables": ("nftables", None)}
# nftables: services spread over several shard tables, as on a big node (render.py).
SHARDS = {"nftables": 4}


@pytest.fixture(params=list(PLANES))
def plane(lab: Lab, request: pytest.FixtureRequest) -> Iterator[NodePlane]:
    """Every data plane written in the node namespace: iptables on both back ends, and
    the native nftables mode."""
    mode, backend = PLANES[request.param]
    kw = {"shards": SHARDS[request.param]} if request.param in SHARDS else {}
    node_plane = NodePlane(lab.node_ns, backend, mode=mode, **kw)
    try:
        yield node_plane
    finally:
        node_plane.cleanup()


def svc(name: str = "web", ips: tuple[str, ...] = (VIP4,),
        ports: tuple[dict[str, Any], ...] = PORTS, **spec: Any) -> dict[str, Any]:
    return service(name, ips=ips, ports=ports, **spec)


def endpoints(lab: Lab, *names: str, service_name: str = "web", v6: bool = False,
              **conditions: Any) -> dict[str, Any]:
    eps = []
    for name in names:
        b = lab.backends[name]
        eps.append(ep(str(b.ipv6 if v6 else b.ipv4), node=b.node, **conditions))
    return eps_slice(f"{service_name}-{'v6' if v6 else 'v4'}-{'-'.join(names) or 'none'}",
                     eps, service_name=service_name, ports=SLICE_PORTS,
                     address_type="IPv6" if v6 else "IPv4")


def test_cluster_ip_reaches_every_ready_backend_and_only_those(
        lab: Lab, plane: NodePlane) -> None:
    cluster = Cluster()
    not_ready = endpoints(lab, "web-4", ready=False)
    not_ready["metadata"]["name"] = "web-not-ready"
    plane.sync(cluster.become(svc(), endpoints(lab, "web-1", "web-2", "web-3"), not_ready),
               full=True)
    got = lab.ask(lab.client_ns, VIP4, 80, count=150)
    assert set(got) == {"web-1", "web-2", "web-3"}, got
    # 1/3 each: 50 expected; 20..80 is more than five standard deviations either way.
    assert all(20 <= n <= 80 for n in got.values()), got
    udp = lab.ask(lab.client_ns, VIP4, 53, proto="udp", count=60)
    assert set(udp) == {"web-1", "web-2", "web-3"}, udp
    # From the node itself (nat OUTPUT) too.
    assert set(lab.ask(lab.node_ns, VIP4, 80, count=30)) <= {"web-1", "web-2", "web-3"}


def test_removed_endpoint_gets_no_new_connections(lab: Lab, plane: NodePlane) -> None:
    cluster = Cluster()
    plane.sync(cluster.become(svc(), endpoints(lab, "web-1", "web-2")), full=True)
    assert set(lab.ask(lab.client_ns, VIP4, 80, count=30)) == {"web-1", "web-2"}
    with lab.hold(lab.client_ns, VIP4, 80) as flow:
        first = flow.ask()
        other = "web-2" if first == "web-1" else "web-1"
        report = plane.sync(cluster.become(svc(), endpoints(lab, other)))
        assert not report.full
        assert lab.ask(lab.client_ns, VIP4, 80, count=40) == {other: 40}
        # An established connection keeps its endpoint (TCP is not cleared).
        assert flow.ask() == first


def test_no_endpoints_is_refused_at_once_not_a_hang(lab: Lab, plane: NodePlane) -> None:
    cluster = Cluster()
    plane.sync(cluster.become(svc(type="NodePort", externalIPs=[EXTERNAL_IP],
                                  ports=({"name": "http", "port": 80, "nodePort": 30080},
                                         PORTS[1]))), full=True)
    for ns in (lab.client_ns, lab.node_ns):
        assert lab.ask(ns, VIP4, 80, count=5, timeout=2.0) == {"refused": 5}
    assert lab.ask(lab.client_ns, VIP4, 53, proto="udp", count=5, timeout=2.0) == {"refused": 5}
    assert lab.ask(lab.client_ns, EXTERNAL_IP, 80, count=3, timeout=2.0) == {"refused": 3}
    assert lab.ask(lab.client_ns, lab.node_ip4, 30080, count=3, timeout=2.0) == {"refused": 3}


def test_node_port_and_external_ip_from_outside(lab: Lab, plane: NodePlane) -> None:
    cluster = Cluster()
    obj = svc(type="NodePort", externalIPs=[EXTERNAL_IP],
              ports=({"name": "http", "port": 80, "nodePort": 30080},
                     {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}))
    plane.sync(cluster.become(obj, endpoints(lab, "web-1", "web-2")), full=True)
    want = {"web-1", "web-2"}
    assert set(lab.ask(lab.client_ns, lab.node_ip4, 30080, count=30)) == want
    assert set(lab.ask(lab.client_ns, lab.node_ip4, 30053, proto="udp", count=30)) == want
    assert set(lab.ask(lab.client_ns, EXTERNAL_IP, 80, count=30)) == want


def test_a_backend_reaches_itself_through_its_service(lab: Lab, plane: NodePlane) -> None:
    """Hairpin: without masquerading, the reply would go from the pod to itself and the
    connection would never complete."""
    cluster = Cluster()
    plane.sync(cluster.become(svc(), endpoints(lab, "web-1")), full=True)
    assert lab.ask(lab.backends["web-1"].ns, VIP4, 80, count=10) == {"web-1": 10}


def test_client_ip_affinity_keeps_a_client_on_one_backend(lab: Lab, plane: NodePlane) -> None:
    cluster = Cluster()
    plane.sync(cluster.become(svc(sessionAffinity="ClientIP"),
                              endpoints(lab, "web-1", "web-2", "web-3")), full=True)
    got = lab.ask(lab.client_ns, VIP4, 80, count=30)
    assert len(got) == 1 and next(iter(got)).startswith("web-"), got
    # Without affinity the same client is spread again.
    plane.sync(cluster.become(svc(), endpoints(lab, "web-1", "web-2", "web-3")))
    assert len(lab.ask(lab.client_ns, VIP4, 80, count=30)) > 1


# --- conntrack ----------------------------------------------------------------------------


class UdpClient:
    """One UDP socket from the client namespace: every datagram has the same source
    port, so all of them belong to one conntrack entry."""

    def __init__(self, ns: str, ip: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with entered(ns):
            self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.connect((ip, port))

    def ask(self, timeout: float = 0.5) -> str:
        self.sock.settimeout(timeout)
        self.sock.send(b"who\n")
        try:
            return self.sock.recv(512).decode().strip()
        except TimeoutError:
            return "timeout"
        except ConnectionRefusedError:
            return "refused"

    def answers(self, want: str, deadline: float = 5.0) -> str:
        """Ask until `want` answers or the deadline passes; the last answer."""
        end = time.monotonic() + deadline
        got = self.ask()
        while got != want and time.monotonic() < end:
            got = self.ask()
        return got

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("clear", [True, False], ids=["cleared", "control"])
def test_udp_flow_moves_off_a_removed_endpoint_when_conntrack_is_cleared(
        lab: Lab, clear: bool, v6: bool, mode: str) -> None:
    plane = NodePlane(lab.node_ns, clear_conntrack=clear, mode=mode)
    client = UdpClient(lab.client_ns, VIP6 if v6 else VIP4, 53)
    dual = svc(ips=(VIP4, VIP6), ipFamilies=["IPv4", "IPv6"])
    try:
        cluster = Cluster()
        plane.sync(cluster.become(dual, endpoints(lab, "web-1", v6=v6)), full=True)
        assert client.ask() == "web-1"
        report = plane.sync(cluster.become(dual, endpoints(lab, "web-2", v6=v6)))
        # web-1 still runs: only the conntrack entry decides where datagrams go.
        if clear:
            assert report.conntrack_cleared >= 1
            assert [client.ask() for _ in range(5)] == ["web-2"] * 5
        else:
            assert report.conntrack_cleared == 0
            assert [client.ask() for _ in range(5)] == ["web-1"] * 5
    finally:
        client.close()
        plane.cleanup()


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
@pytest.mark.parametrize("clear", [True, False], ids=["cleared", "control"])
def test_udp_service_gaining_its_first_endpoint_is_reachable_at_once(
        lab: Lab, clear: bool, mode: str) -> None:
    plane = NodePlane(lab.node_ns, clear_conntrack=clear, mode=mode)
    vip = "198.18.128.77"
    client = UdpClient(lab.client_ns, vip, 53)
    try:
        cluster = Cluster()
        plane.sync(cluster.become(), full=True)
        # No rule for this address yet: the node routes the datagrams on, and keeps a
        # conntrack entry for them that would bypass the nat table from now on.
        assert client.ask(timeout=0.3) == "timeout"
        report = plane.sync(cluster.become(svc("late", ips=(vip,)),
                                           endpoints(lab, "web-3", service_name="late")))
        if clear:
            assert report.conntrack_cleared >= 1
            assert client.answers("web-3") == "web-3"
        else:
            # The stale entry keeps them from the new rule: routed on (iptables), or
            # refused as a cluster IP's unknown port (nftables: the entry never saw a
            # reply, so it is still new to `ct state`).
            answers = {client.ask(timeout=0.3) for _ in range(3)}
            assert answers == {"timeout" if mode == "iptables" else "refused"}, answers
    finally:
        client.close()
        plane.cleanup()


# --- a refused apply ------------------------------------------------------------------------


class SabotagedRunner(IptablesRunner):
    """The real runner, with a bad rule slipped into the nat section when asked."""

    inject: str | None = None

    def restore(self, script: RestoreInput, *, noflush: bool = True,
                counters: bool = False) -> None:
        text = whole(script)
        if self.inject and "*nat\n" in text:
            head, tail = text.split("*nat\n", 1)
            nat, rest = tail.split("COMMIT\n", 1)
            text = f"{head}*nat\n{nat}{self.inject}\nCOMMIT\n{rest}"
        super().restore(text, noflush=noflush, counters=counters)


def test_refused_apply_leaves_traffic_on_the_old_rules(lab: Lab, backend: Backend) -> None:
    with entered(lab.node_ns):
        runners = {f: SabotagedRunner(f, backend) for f in Family}
    plane = NodePlane(lab.node_ns, runners=runners)
    try:
        cluster = Cluster()
        plane.sync(cluster.become(svc(), endpoints(lab, "web-1")), full=True)
        assert lab.ask(lab.client_ns, VIP4, 80, count=10) == {"web-1": 10}
        runners[Family.V4].inject = "-A SPX-SERVICES -j SPX-NO-SUCH-CHAIN"
        with pytest.raises(ApplyError) as refused:
            plane.sync(cluster.become(svc(), endpoints(lab, "web-2")))
        assert "SPX-NO-SUCH-CHAIN" in f"{refused.value} {refused.value.offending}"
        # The old rules carry on, unchanged.
        assert lab.ask(lab.client_ns, VIP4, 80, count=20) == {"web-1": 20}
        # Once the kernel accepts again, the retry is a full sync and catches up.
        runners[Family.V4].inject = None
        report = plane.sync(cluster.model.state)
        assert report.full
        assert lab.ask(lab.client_ns, VIP4, 80, count=20) == {"web-2": 20}
    finally:
        plane.cleanup()


def test_iptc_applier_carries_real_traffic(lab: Lab) -> None:
    """python-iptables writes IPv4 (ip6tables-legacy-restore IPv6) on legacy tables."""
    plane = NodePlane(lab.node_ns, Backend.LEGACY, applier="iptc")
    try:
        cluster = Cluster()
        dual = svc(ips=(VIP4, VIP6), ipFamilies=["IPv4", "IPv6"])
        v6 = endpoints(lab, "web-3", v6=True)
        plane.sync(cluster.become(dual, endpoints(lab, "web-1", "web-2"), v6), full=True)
        assert set(lab.ask(lab.client_ns, VIP4, 80, count=40)) == {"web-1", "web-2"}
        assert lab.ask(lab.client_ns, VIP6, 80, count=10) == {"web-3": 10}
        report = plane.sync(cluster.become(dual, endpoints(lab, "web-2"), v6))
        assert not report.full
        assert lab.ask(lab.client_ns, VIP4, 80, count=20) == {"web-2": 20}
        plane.sync(cluster.become(dual, v6))  # no IPv4 endpoints: -D jump, -I REJECT
        assert lab.ask(lab.client_ns, VIP4, 80, count=3, timeout=2.0) == {"refused": 3}
    finally:
        plane.cleanup()
