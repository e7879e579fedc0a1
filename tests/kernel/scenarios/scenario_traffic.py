"""Traffic through the IPVS data plane, inside the kernel lab (run by
tests/kernel/test_ipvs_traffic.py through scenarios/run.py; never on the host).

The client namespace is outside the node; backends web-1..3 sit on the node's pod
bridge. Service state is built from API objects through the agent's own model and
applied with IpvsDataPlane on a thread inside the node namespace, as the agent does.
"""

from __future__ import annotations

import errno
import socket
import struct
import time
from collections import Counter
from typing import Any

import pytest

from proxy.dataplane.base import ApplyError
from proxy.dataplane.ipvs.kernel import IpvsTable
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import wait
from tests.kernel.scenario_guest import (
    HELD_FLOW_TIMEOUT,
    Cluster,
    NodeThread,
    options,
    read_kernel,
    rendered_view,
)
from tests.unit.builders import ep, eps_slice, service

HTTP = {"name": "http", "port": 80, "protocol": "TCP"}
DNS = {"name": "dns", "port": 53, "protocol": "UDP"}
SLICE_PORTS = ({"name": "http", "port": 8080, "protocol": "TCP"},
               {"name": "dns", "port": 8081, "protocol": "UDP"})


def slices(lab: Lab, svc: str, members: dict[str, dict[str, Any]],
           ipv6: bool = False) -> list[dict[str, Any]]:
    """EndpointSlices of `svc`: backend name -> ep() keyword arguments (node, ready...)."""
    out = [eps_slice(f"{svc}-v4", [ep(str(lab.backends[n].ipv4), **kw)
                                   for n, kw in members.items()],
                     service_name=svc, ports=SLICE_PORTS)]
    if ipv6:
        out.append(eps_slice(f"{svc}-v6", [ep(str(lab.backends[n].ipv6), **kw)
                                           for n, kw in members.items()],
                             service_name=svc, ports=SLICE_PORTS, address_type="IPv6"))
    return out


def local(**kw: Any) -> dict[str, Any]:
    return {"node": "node-a", **kw}


def remote(**kw: Any) -> dict[str, Any]:
    return {"node": "node-b", **kw}


def dests(node: NodeThread, vs: str) -> dict[str, int]:
    """Real servers of virtual server `vs` ("TCP 198.18.128.10:80") with their weights."""
    return read_kernel(node).services.get(vs, {}).get("dests", {})


def reply_destinations(node: NodeThread, port: int) -> Counter[str]:
    """For conntrack flows to `port`: who the backend answered (the reply tuple's dst),
    i.e. the source address the backend saw: the client's, or the node's if masqueraded."""
    out = node.exec("conntrack", "-L", "-p", "tcp", "--orig-port-dst", str(port))
    assert out.returncode == 0, out.stderr
    seen: Counter[str] = Counter()
    for line in out.stdout.splitlines():
        dsts = [f.split("=", 1)[1] for f in line.split() if f.startswith("dst=")]
        if len(dsts) == 2:
            seen[dsts[1]] += 1
    return seen


def test_cluster_ip_reaches_ready_backends_only(lab: Lab, node: NodeThread,
                                                cluster: Cluster) -> None:
    v4, v6 = "198.18.128.10", "fd00:198:18::10"
    state = cluster.apply(
        service("web", ips=(v4, v6), ports=(HTTP, DNS)),
        *slices(lab, "web", {"web-1": local(), "web-2": remote(),
                             "web-3": local(ready=False)}, ipv6=True))
    report = node.sync(state)
    assert report.full
    c = lab.client_ns
    # rr over two real servers and fresh connections: an exact alternation.
    assert lab.ask(c, v4, 80, count=20) == {"web-1": 10, "web-2": 10}
    assert lab.ask(c, v6, 80, count=20) == {"web-1": 10, "web-2": 10}
    assert lab.ask(c, v4, 53, proto="udp", count=20) == {"web-1": 10, "web-2": 10}
    assert lab.ask(c, v6, 53, proto="udp", count=10) == {"web-1": 5, "web-2": 5}
    # From the node itself too (IPVS on the local-out path).
    assert set(lab.ask(lab.node_ns, v4, 80, count=6)) == {"web-1", "web-2"}
    # Only service ports answer on a service address (the VIP filter rejects the rest).
    assert lab.ask(c, v4, 22, count=2, timeout=0.5) == {"refused": 2}
    rules = node.run(lambda: list(node.plane.applied_rules(  # type: ignore[union-attr]
        next(k for k in state.ports if k.port == "http" and k.family.value == 4))))
    b1, b2 = lab.backends["web-1"].ipv4, lab.backends["web-2"].ipv4
    assert f"TCP {v4}:80 rr -> {b1}:8080 weight 1" in rules, rules
    assert f"TCP {v4}:80 rr -> {b2}:8080 weight 1" in rules, rules


def test_endpoint_removal_and_drain_timeout(lab: Lab, node: NodeThread,
                                            cluster: Cluster) -> None:
    node.start_plane(options(ipvs_drain_timeout=2.0))
    vip, c = "198.18.128.11", lab.client_ns
    state = cluster.apply(service("rm", ips=(vip,), ports=(HTTP, DNS)),
                          *slices(lab, "rm", {"web-1": local(), "web-2": local()}))
    node.sync(state)
    assert lab.ask(c, vip, 80, count=10) == {"web-1": 5, "web-2": 5}
    assert lab.ask(c, vip, 53, proto="udp", count=10) == {"web-1": 5, "web-2": 5}
    # An endpoint that never had a connection goes at once when it leaves.
    node.sync(cluster.apply(*slices(lab, "rm", {"web-1": local(), "web-2": local(),
                                                "web-3": local()})))
    b3 = f"{lab.backends['web-3'].ipv4}:8080"
    assert dests(node, f"TCP {vip}:80")[b3] == 1
    node.sync(cluster.apply(*slices(lab, "rm", {"web-1": local(), "web-2": local()})))
    assert b3 not in dests(node, f"TCP {vip}:80")

    removed = time.monotonic()
    node.sync(cluster.apply(*slices(lab, "rm", {"web-1": local()})))
    assert lab.ask(c, vip, 80, count=10) == {"web-1": 10}
    assert lab.ask(c, vip, 53, proto="udp", count=10) == {"web-1": 10}
    b2 = f"{lab.backends['web-2'].ipv4}"
    # UDP: deleted at once. TCP: kept at weight 0 while its (closing) connections last.
    assert dests(node, f"UDP {vip}:53") == {f"{lab.backends['web-1'].ipv4}:8081": 1}
    assert dests(node, f"TCP {vip}:80")[f"{b2}:8080"] == 0

    def gone() -> bool:
        node.housekeeping()
        return f"{b2}:8080" not in dests(node, f"TCP {vip}:80")

    wait(gone, 20.0, "the drained real server to be deleted after the drain timeout",
         interval=0.2)
    # Its earlier connections were still in TIME_WAIT: only the timeout let it go.
    assert time.monotonic() - removed >= 2.0


def test_weight_zero_draining_keeps_an_established_connection(
        lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    node.start_plane(options(ipvs_drain_timeout=120.0))
    vip, c = "198.18.128.12", lab.client_ns
    members = {"web-1": local(), "web-2": local()}
    node.sync(cluster.apply(service("drain", ips=(vip,), ports=(HTTP,)),
                            *slices(lab, "drain", members)))
    with lab.hold(c, vip, 80, timeout=HELD_FLOW_TIMEOUT) as flow:
        held = flow.ask()
        other = ({"web-1", "web-2"} - {held}).pop()
        # The endpoint starts terminating: it leaves the cluster set.
        members[held] = local(ready=False, serving=True, terminating=True)
        node.sync(cluster.apply(*slices(lab, "drain", members)))
        rs = f"{lab.backends[held].ipv4}:8080"
        assert dests(node, f"TCP {vip}:80")[rs] == 0
        assert [flow.ask() for _ in range(3)] == [held] * 3
        assert lab.ask(c, vip, 80, count=10) == {other: 10}
        node.housekeeping()  # an established connection: not deleted
        assert dests(node, f"TCP {vip}:80")[rs] == 0
        assert flow.ask() == held
        # Close with a reset: IPVS forgets a reset connection after its CLOSE timeout
        # (10 s); a FIN would leave it in TIME_WAIT for two minutes.
        flow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def gone() -> bool:
        node.housekeeping()
        return rs not in dests(node, f"TCP {vip}:80")

    # Well before the 120 s drain timeout: deleted because no connection is left.
    wait(gone, 30.0, "the idle real server to be deleted", interval=0.5)
    assert lab.ask(c, vip, 80, count=4) == {other: 4}


def test_node_port_from_a_client_masqueraded(lab: Lab, node: NodeThread,
                                            cluster: Cluster) -> None:
    port = dict(HTTP, nodePort=30080)
    state = cluster.apply(
        service("np", ips=("198.18.128.13", "fd00:198:18::13"), ports=(port,),
                type="NodePort"),
        *slices(lab, "np", {"web-1": local(), "web-2": remote()}, ipv6=True))
    node.sync(state)
    c = lab.client_ns
    assert lab.ask(c, lab.node_ip4, 30080, count=10) == {"web-1": 5, "web-2": 5}
    assert lab.ask(c, lab.node_ip6, 30080, count=10) == {"web-1": 5, "web-2": 5}
    # Every node address takes NodePort traffic (--nodeport-addresses unset).
    assert set(lab.ask(c, "198.18.1.1", 30080, count=4)) == {"web-1", "web-2"}
    # Policy Cluster: the backends saw the node's pod-bridge address, not the client's.
    assert set(reply_destinations(node, 30080)) == {"198.18.1.1", "fd00:18:1::1"}
    # The node port is not open on service addresses or other ports.
    assert lab.ask(c, lab.node_ip4, 30081, count=2, timeout=0.5) == {"refused": 2}


def test_nodeport_addresses_restricts_the_virtual_servers(
        lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    from ipaddress import ip_network

    node.start_plane(options(nodeport_addresses=(ip_network("198.18.0.0/24"),)))
    node.sync(cluster.apply(
        service("npa", ips=("198.18.128.14",), ports=(dict(HTTP, nodePort=30081),),
                type="NodePort"),
        *slices(lab, "npa", {"web-1": local()})))
    have = {k for k in read_kernel(node).services if k.endswith(":30081")}
    assert have == {"TCP 198.18.0.1:30081"}
    assert lab.ask(lab.client_ns, lab.node_ip4, 30081, count=3) == {"web-1": 3}


def test_nodeport_addresses_of_one_family_leave_the_other_whole(
        lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    """Only an IPv6 CIDR given: IPv4 NodePorts stay on every IPv4 node address (no CIDR
    of a family means all of it, as upstream and the other modes)."""
    from ipaddress import ip_network

    node.start_plane(options(nodeport_addresses=(ip_network(f"{lab.node_ip6}/128"),)))
    node.sync(cluster.apply(
        service("npv6", ips=("198.18.128.16", "fd00:198:18::16"),
                ports=(dict(HTTP, nodePort=30082),), type="NodePort"),
        *slices(lab, "npv6", {"web-1": local()}, ipv6=True)))
    have = {k for k in read_kernel(node).services if k.endswith(":30082")}
    assert f"TCP {lab.node_ip4}:30082" in have and "TCP 198.18.1.1:30082" in have, have
    assert [k for k in have if "[" in k] == [f"TCP [{lab.node_ip6}]:30082"], have
    assert lab.ask(lab.client_ns, lab.node_ip4, 30082, count=3) == {"web-1": 3}
    assert lab.ask(lab.client_ns, lab.node_ip6, 30082, count=3) == {"web-1": 3}


def test_client_ip_affinity(lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    vip, c = "198.18.128.15", lab.client_ns
    members = {"web-1": local(), "web-2": local(), "web-3": local()}
    node.sync(cluster.apply(
        service("sticky", ips=(vip,), ports=(HTTP,), sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}}),
        *slices(lab, "sticky", members)))
    assert dests(node, f"TCP {vip}:80")  # programmed
    view = read_kernel(node).services[f"TCP {vip}:80"]
    assert (view["flags"] & 1, view["timeout"]) == (1, 300)
    first = lab.ask(c, vip, 80, count=15)
    assert len(first) == 1, first
    chosen = next(iter(first))
    # The chosen endpoint leaves: the affinity template to a weight-0 real server expires
    # (expire_quiescent_template) and the client sticks to one of the others.
    del members[chosen]
    node.sync(cluster.apply(*slices(lab, "sticky", members)))
    after = lab.ask(c, vip, 80, count=15)
    assert len(after) == 1 and chosen not in after, after


def test_local_traffic_policy(lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    vip, c = "198.18.128.16", lab.client_ns
    port = dict(HTTP, nodePort=30082)
    members = {"web-1": local(), "web-2": remote()}
    node.sync(cluster.apply(
        service("loc", ips=(vip,), ports=(port,), type="NodePort",
                externalTrafficPolicy="Local"),
        *slices(lab, "loc", members)))
    # External traffic: this node's endpoints only, the client's address preserved.
    assert lab.ask(c, lab.node_ip4, 30082, count=6) == {"web-1": 6}
    assert set(reply_destinations(node, 30082)) == {str(lab.client_ip4)}
    # Cluster IP traffic (internal policy Cluster): every endpoint.
    assert lab.ask(c, vip, 80, count=6) == {"web-1": 3, "web-2": 3}
    # The node itself gets the local set too: a virtual server cannot tell sources apart
    # (upstream's IPVS mode alike; docs/upstream-differences.md K3).
    assert lab.ask(lab.node_ns, lab.node_ip4, 30082, count=4) == {"web-1": 4}
    # No local endpoint left: external traffic is dropped, not sent to another node.
    del members["web-1"]
    state = cluster.apply(*slices(lab, "loc", members))
    node.sync(state)
    assert lab.ask(c, lab.node_ip4, 30082, count=3, timeout=0.5) == {"timeout": 3}
    assert lab.ask(c, vip, 80, count=4) == {"web-2": 4}
    # ... but the node itself still reaches the NodePort, through the cluster set
    # (upstream's short-circuit; its IPVS mode falls back to the cluster set).
    assert lab.ask(lab.node_ns, lab.node_ip4, 30082, count=4) == {"web-2": 4}
    key = next(k for k in state.ports if k.name == "loc")
    rules = node.run(lambda: list(node.plane.applied_rules(key)))  # type: ignore[union-attr]
    assert any(r.startswith("drop 198.18.0.1,tcp:30082") for r in rules), rules

    # internalTrafficPolicy Local: cluster IP traffic stays on this node too.
    ivip = "198.18.128.17"
    node.sync(cluster.apply(
        service("iloc", ips=(ivip,), ports=(HTTP,), internalTrafficPolicy="Local"),
        *slices(lab, "iloc", {"web-1": local(), "web-2": remote()})))
    assert lab.ask(c, ivip, 80, count=4) == {"web-1": 4}


def test_external_and_load_balancer_ips_with_source_ranges(
        lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    ext, lb, c = "198.18.2.60", "198.18.2.50", lab.client_ns
    svc = service("lb", ips=("198.18.128.18",), ports=(dict(HTTP, nodePort=30083),),
                  type="LoadBalancer", externalIPs=[ext],
                  loadBalancerSourceRanges=["198.18.0.2/32"])
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": lb}]}}
    node.sync(cluster.apply(svc, *slices(lab, "lb", {"web-1": local(), "web-2": local()})))
    assert lab.ask(c, ext, 80, count=4) == {"web-1": 2, "web-2": 2}
    assert lab.ask(c, lb, 80, count=4) == {"web-1": 2, "web-2": 2}
    # The client is outside the allowed range now: dropped at the load-balancer IP only.
    svc["spec"]["loadBalancerSourceRanges"] = ["198.18.5.0/24"]
    node.sync(cluster.apply(svc))
    assert lab.ask(c, lb, 80, count=2, timeout=0.5) == {"timeout": 2}
    assert lab.ask(c, ext, 80, count=2) == {"web-1": 1, "web-2": 1}


def test_restart_repairs_a_deleted_virtual_server_without_disturbing_others(
        lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    a, b, c = "198.18.128.19", "198.18.128.20", lab.client_ns
    members = {"web-1": local(), "web-2": local()}
    state = cluster.apply(service("a", ips=(a,), ports=(HTTP,)), *slices(lab, "a", members),
                          service("b", ips=(b,), ports=(HTTP,)), *slices(lab, "b", members))
    node.sync(state)
    with lab.hold(c, b, 80, timeout=HELD_FLOW_TIMEOUT) as flow:
        held = flow.ask()
        out = node.exec("ipvsadm", "-D", "-t", f"{a}:80")
        assert out.returncode == 0, out.stderr
        assert lab.ask(c, a, 80, count=2, timeout=0.5) == {"refused": 2}
        # The agent restarts: a new data plane, nothing carried over but the kernel.
        node.start_plane()
        report = node.sync(state)
        assert report.full
        # Exactly the missing virtual server and its two real servers were written.
        assert report.details["ipvs_changes"] == 3, report.details
        assert lab.ask(c, a, 80, count=4) == {"web-1": 2, "web-2": 2}
        assert [flow.ask() for _ in range(3)] == [held] * 3
    assert read_kernel(node).services == rendered_view(state, options(), node).services


def test_failed_netlink_call_is_repaired_by_the_next_sync(
        lab: Lab, node: NodeThread, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    vip, c = "198.18.128.21", lab.client_ns
    state = cluster.apply(service("half", ips=(vip,), ports=(HTTP,)),
                          *slices(lab, "half", {"web-1": local(), "web-2": local()}))
    real_apply = IpvsTable.apply_many
    failed: list[str] = []

    def flaky(self: IpvsTable, ops: list[Any]) -> list[int]:
        """The first real-server addition fails as if the kernel refused it."""
        at = next((i for i, op in enumerate(ops) if op.kind.value == "add-dest"), None)
        if at is None or failed:
            return real_apply(self, ops)
        failed.append(str(ops[at]))
        return [*real_apply(self, ops[:at]), errno.ENOBUFS, *real_apply(self, ops[at + 1:])]

    monkeypatch.setattr(IpvsTable, "apply_many", flaky)
    with pytest.raises(ApplyError) as info:
        node.sync(state)
    assert failed[0] in str(info.value) and "No buffer space" in str(info.value)
    half = dests(node, f"TCP {vip}:80")
    assert len(half) == 1, half  # half-built: one real server missing
    monkeypatch.setattr(IpvsTable, "apply_many", real_apply)
    report = node.sync(state)  # a partial sync was asked for: the plane makes it full
    assert report.full
    assert read_kernel(node).services == rendered_view(state, options(), node).services
    assert lab.ask(c, vip, 80, count=4) == {"web-1": 2, "web-2": 2}


def test_udp_flow_moves_when_its_endpoint_leaves(lab: Lab, node: NodeThread,
                                                 cluster: Cluster) -> None:
    vip = "198.18.128.22"
    members = {"web-1": local(), "web-2": local()}
    node.sync(cluster.apply(service("flow", ips=(vip,), ports=(DNS,)),
                            *slices(lab, "flow", members)))
    # One socket: the same 5-tuple, so one conntrack entry and one IPVS connection.
    with entered(lab.client_ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.settimeout(0.5)
        sock.connect((vip, 53))

        def ask() -> str:
            sock.send(b"who\n")
            try:
                return sock.recv(64).decode().strip()
            except TimeoutError:
                return "timeout"

        first = ask()
        assert first in members
        assert [ask() for _ in range(3)] == [first] * 3
        other = ({"web-1", "web-2"} - {first}).pop()
        del members[first]
        node.sync(cluster.apply(*slices(lab, "flow", members)))
        # Its conntrack entry is gone: Linux >= 5.9 expires a deleted real server's IPVS
        # connections with their conntrack entries (expire_nodest_conn=1); the plane's
        # own clean-up covers older kernels. Either way no stale entry is left.
        stale = node.exec("conntrack", "-L", "-p", "udp", "--orig-dst", vip).stdout
        assert str(lab.backends[first].ipv4) not in stale, stale
        answers = [ask() for _ in range(4)]
        # The flow moves: at most the first datagram after the change is lost.
        assert answers[1:] == [other] * 3, answers
        assert first not in answers
    finally:
        sock.close()
