"""What a user of a Service notices, checked on the rules each rule-based mode writes:
the real data plane (render, transaction, apply) writes into a fake kernel
(tests/fakekernel) and a tracer says where a connection's first packet goes, which
endpoints it may reach and with what probability, masqueraded or not, or dropped or
rejected. One table of cases, run against the iptables mode, the nftables mode, and
the nftables mode with its services spread over several shard tables.

The node is node-a (zone-a) at 198.18.0.1 / fd00:18::1; pods are 198.18.1.0/24 and
fd00:18:1::/64; endpoints 198.18.1.5 and .6 run on node-a, 198.18.1.20 on node-b.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import ip_network
from typing import Any

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.nftables import slot_tail
from proxy.dataplane.nftables.render import SLOT_MAP_MIN
from tests.fakekernel.iptables import IptablesKernel
from tests.fakekernel.nftables import FakeNft, NftFakeError
from tests.fakekernel.packet import Node, Packet, Trace, TraceError, Verdict
from tests.fakekernel.planes import NODE_NAME, FakePlane
from tests.unit.builders import ep, eps_slice, service

VIP, VIP6 = "198.18.128.10", "fd00:198:18::10"
NODE_IP, NODE_IP6, OTHER_NODE_IP = "198.18.0.1", "fd00:18::1", "198.18.0.2"
EXTERNAL_IP = "198.18.2.100"
LB_IP = "198.18.3.1"
POD, POD6 = "198.18.1.50", "fd00:18:1::50"
OUTSIDE = "198.19.0.7"  # off the cluster, inside the LB source range
BLOCKED = "198.19.0.200"  # off the cluster, outside it
RANGE = "198.19.0.0/25"
LOCAL1, LOCAL2, REMOTE = "198.18.1.5", "198.18.1.6", "198.18.1.20"
NODE_PORT = 30080

PLANES = {"iptables": ("iptables", 1), "nftables": ("nftables", 1),
          "nftables-sharded": ("nftables", 4)}


def plane_for(name: str, options: DataplaneOptions | None = None,
              node_ips: tuple[str, ...] = (NODE_IP, NODE_IP6)) -> FakePlane:
    mode, shards = PLANES[name]
    return FakePlane(mode, options, node_ips=node_ips, shards=shards)


# --- cluster objects ---------------------------------------------------------------------------


def web(**spec: Any) -> dict[str, Any]:
    """Service ns/web at VIP: http 80 (NodePort 30080 unless ClusterIP) and dns 53/UDP."""
    kind = spec.get("type", "ClusterIP")
    http: dict[str, Any] = {"name": "http", "port": 80}
    if kind != "ClusterIP":
        http["nodePort"] = NODE_PORT
    ips = spec.pop("ips", (VIP,))
    obj = service("web", ips=ips, ports=(http, {"name": "dns", "port": 53, "protocol": "UDP"}),
                  **spec)
    if kind == "LoadBalancer":
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    return obj


def slice_of(*endpoints: dict[str, Any], name: str = "web-a", v6: bool = False
             ) -> dict[str, Any]:
    return eps_slice(name, list(endpoints), service_name="web",
                     ports=({"name": "http", "port": 8080},
                            {"name": "dns", "port": 5353, "protocol": "UDP"}),
                     address_type="IPv6" if v6 else "IPv4")


def local(ip: str, **kw: Any) -> dict[str, Any]:
    return ep(ip, node=NODE_NAME, zone="zone-a", **kw)


def remote(ip: str, **kw: Any) -> dict[str, Any]:
    return ep(ip, node="node-b", zone="zone-b", **kw)


def at(*ips: str, port: int = 8080) -> tuple[str, ...]:
    return tuple(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)


# --- expectations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """Accepted: spread evenly over `endpoints` (none: not DNATed at all), masqueraded
    or not; or dropped / rejected."""

    endpoints: tuple[str, ...] = ()
    masquerade: bool = False
    verdict: Verdict = Verdict.ACCEPT


DROP = Expect(verdict=Verdict.DROP)
REJECT = Expect(verdict=Verdict.REJECT)
UNTOUCHED = Expect()  # passes on as it came: no rule of ours for it


def check(trace: Trace, want: Expect) -> None:
    # Every way the packet can go is accounted for, each with its probability.
    assert sum(o.probability for o in trace.outcomes) == pytest.approx(1.0), trace
    assert trace.verdict is want.verdict, trace
    if want.verdict is not Verdict.ACCEPT:
        return
    got = trace.endpoints()
    assert set(got) == set(want.endpoints), trace
    for endpoint in want.endpoints:
        assert got[endpoint] == pytest.approx(1 / len(want.endpoints), abs=1e-6), got
    assert trace.masquerade is want.masquerade, trace


def from_pod(dest: str, port: int = 80, protocol: str = "tcp") -> Packet:
    return Packet.of(POD6 if ":" in dest else POD, dest, port, protocol)


def from_outside(dest: str, port: int = 80, source: str = OUTSIDE) -> Packet:
    return Packet.of(source, dest, port)


def from_node(dest: str, port: int = 80) -> Packet:
    return Packet.of(NODE_IP6 if ":" in dest else NODE_IP, dest, port, local=True)


Probe = tuple[Packet, Expect | dict[str, Expect]]  # per mode ("iptables"/"nftables")


@dataclass(frozen=True)
class Case:
    name: str
    objects: Callable[[], list[dict[str, Any]]]
    probes: tuple[Probe, ...]
    options: DataplaneOptions | None = None


PODS = tuple(ip_network(c) for c in ("198.18.1.0/24", "fd00:18:1::/64"))
BOTH_LOCAL = {"internalTrafficPolicy": "Local", "externalTrafficPolicy": "Local"}

CASES = (
    Case("cluster IP reaches the ready endpoints only", lambda: [
        web(), slice_of(local(LOCAL1), local(LOCAL2), remote(REMOTE, ready=False))], (
        (from_pod(VIP), Expect(at(LOCAL1, LOCAL2))),
        (from_pod(VIP, 53, "udp"), Expect(at(LOCAL1, LOCAL2, port=5353))),
        # Off-cluster clients may be answered from another node: masqueraded.
        (from_outside(VIP), Expect(at(LOCAL1, LOCAL2), masquerade=True)),
        (from_node(VIP), Expect(at(LOCAL1, LOCAL2), masquerade=True)),
        # Only the service's protocol and port are taken.
        (from_pod(VIP, 80, "udp"), {"iptables": UNTOUCHED, "nftables": REJECT}),
        (from_pod(VIP, 81), {"iptables": UNTOUCHED, "nftables": REJECT}),
    )),
    Case("terminating endpoints serve only while nothing is ready", lambda: [
        web(), slice_of(local(LOCAL1), local(LOCAL2, ready=False, serving=True,
                                               terminating=True))], (
        (from_pod(VIP), Expect(at(LOCAL1))),
    )),
    Case("serving terminating endpoints take over when none is ready", lambda: [
        web(), slice_of(local(LOCAL2, ready=False, serving=True, terminating=True),
                        local(LOCAL1, ready=False, serving=False, terminating=True))], (
        (from_pod(VIP), Expect(at(LOCAL2))),
    )),
    Case("no endpoints: refused at once everywhere", lambda: [
        web(type="NodePort", externalIPs=[EXTERNAL_IP])], (
        (from_pod(VIP), REJECT),
        (from_pod(VIP, 53, "udp"), REJECT),
        (from_node(VIP), REJECT),
        (from_outside(EXTERNAL_IP), REJECT),
        (from_outside(NODE_IP, NODE_PORT), REJECT),
    )),
    Case("NodePort and externalIP from outside are masqueraded", lambda: [
        web(type="NodePort", externalIPs=[EXTERNAL_IP]),
        slice_of(local(LOCAL1), remote(REMOTE))], (
        (from_outside(NODE_IP, NODE_PORT), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        (from_outside(EXTERNAL_IP), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        (from_pod(EXTERNAL_IP), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        (from_pod(NODE_IP, NODE_PORT), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        (from_node(NODE_IP, NODE_PORT), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        # A node address that is not this node's is not a NodePort.
        (from_outside(OTHER_NODE_IP, NODE_PORT), UNTOUCHED),
        # NodePorts are never served on loopback (upstream's localhost-nodeports=false).
        (from_node("127.0.0.1", NODE_PORT), UNTOUCHED),
    )),
    Case("a pod reaching itself through its service is masqueraded (hairpin)", lambda: [
        web(), slice_of(local(LOCAL1))], (
        (Packet.of(LOCAL1, VIP, 80), Expect(at(LOCAL1), masquerade=True)),
        (from_pod(VIP), Expect(at(LOCAL1))),
    )),
    Case("internalTrafficPolicy Local: local endpoints only", lambda: [
        web(internalTrafficPolicy="Local"), slice_of(local(LOCAL1), remote(REMOTE))], (
        (from_pod(VIP), Expect(at(LOCAL1))),
        (from_node(VIP), Expect(at(LOCAL1), masquerade=True)),
    )),
    Case("internalTrafficPolicy Local without a local endpoint drops", lambda: [
        web(internalTrafficPolicy="Local"), slice_of(remote(REMOTE))], (
        (from_pod(VIP), DROP),
        (from_node(VIP), DROP),
    )),
    Case("externalTrafficPolicy Local keeps the client's address", lambda: [
        web(type="NodePort", externalIPs=[EXTERNAL_IP], externalTrafficPolicy="Local"),
        slice_of(local(LOCAL1), remote(REMOTE))], (
        (from_outside(NODE_IP, NODE_PORT), Expect(at(LOCAL1))),
        (from_outside(EXTERNAL_IP), Expect(at(LOCAL1))),
        # Pods and the node itself are short-circuited to the cluster set.
        (from_pod(NODE_IP, NODE_PORT), Expect(at(LOCAL1, REMOTE))),
        (from_node(NODE_IP, NODE_PORT), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        (from_node(EXTERNAL_IP), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        # Cluster IP traffic keeps the internal policy (Cluster).
        (from_pod(VIP), Expect(at(LOCAL1, REMOTE))),
    )),
    Case("externalTrafficPolicy Local without a local endpoint drops outside traffic",
         lambda: [web(type="NodePort", externalIPs=[EXTERNAL_IP],
                      externalTrafficPolicy="Local"), slice_of(remote(REMOTE))], (
        (from_outside(NODE_IP, NODE_PORT), DROP),
        (from_outside(EXTERNAL_IP), DROP),
        (from_pod(NODE_IP, NODE_PORT), Expect(at(REMOTE))),
        (from_pod(VIP), Expect(at(REMOTE))),
    )),
    Case("externalTrafficPolicy Local falls back to local terminating endpoints", lambda: [
        web(type="NodePort", externalTrafficPolicy="Local"),
        slice_of(local(LOCAL1, ready=False, serving=True, terminating=True),
                 remote(REMOTE))], (
        (from_outside(NODE_IP, NODE_PORT), Expect(at(LOCAL1))),
        (from_pod(VIP), Expect(at(REMOTE))),
    )),
    Case("an endpoint on the node's own address is delivered to the node", lambda: [
        web(type="NodePort"), slice_of(local(NODE_IP))], (
        # Delivered locally (input), so never source-NATed: nothing masquerades there.
        (from_outside(NODE_IP, NODE_PORT), Expect(at(NODE_IP))),
        (from_pod(VIP), Expect(at(NODE_IP))),
    )),
    Case("SCTP ports are served like TCP and UDP ones", lambda: [
        service("web", ips=(VIP,), ports=({"name": "s", "port": 9, "protocol": "SCTP"},)),
        eps_slice("web-a", [local(LOCAL1)], service_name="web",
                  ports=({"name": "s", "port": 99, "protocol": "SCTP"},))], (
        (from_pod(VIP, 9, "sctp"), Expect(at(LOCAL1, port=99))),
        (from_pod(VIP, 9, "tcp"), {"iptables": UNTOUCHED, "nftables": REJECT}),
    )),
    Case("both policies Local short-circuit the node to the cluster set", lambda: [
        web(type="NodePort", externalIPs=[EXTERNAL_IP], **BOTH_LOCAL),
        slice_of(remote(REMOTE))], (
        (from_outside(NODE_IP, NODE_PORT), DROP),
        (from_outside(EXTERNAL_IP), DROP),
        (from_node(VIP), DROP),
        (from_node(NODE_IP, NODE_PORT), Expect(at(REMOTE), masquerade=True)),
        (from_node(EXTERNAL_IP), Expect(at(REMOTE), masquerade=True)),
    )),
    Case("both policies Local with a local endpoint", lambda: [
        web(type="NodePort", externalIPs=[EXTERNAL_IP], **BOTH_LOCAL),
        slice_of(local(LOCAL1), remote(REMOTE))], (
        (from_outside(NODE_IP, NODE_PORT), Expect(at(LOCAL1))),
        (from_node(VIP), Expect(at(LOCAL1), masquerade=True)),
        (from_node(NODE_IP, NODE_PORT), Expect(at(LOCAL1, REMOTE), masquerade=True)),
    )),
    Case("LoadBalancer source ranges admit only their sources", lambda: [
        web(type="LoadBalancer", loadBalancerSourceRanges=[RANGE]),
        slice_of(local(LOCAL1), remote(REMOTE))], (
        (from_outside(LB_IP), Expect(at(LOCAL1, REMOTE), masquerade=True)),
        (from_outside(LB_IP, source=BLOCKED), DROP),
        # The NodePort is not behind the source ranges.
        (from_outside(NODE_IP, NODE_PORT, source=BLOCKED),
         Expect(at(LOCAL1, REMOTE), masquerade=True)),
        (from_pod(VIP), Expect(at(LOCAL1, REMOTE))),
        # A pod is a source like any other: outside the ranges, refused.
        (from_pod(LB_IP), DROP),
    )),
    Case("LoadBalancer source ranges holding the node admit its own traffic", lambda: [
        web(type="LoadBalancer", loadBalancerSourceRanges=[RANGE, "198.18.0.0/24"]),
        slice_of(local(LOCAL1))], (
        (from_node(LB_IP), Expect(at(LOCAL1), masquerade=True)),
        (from_outside(LB_IP, source=BLOCKED), DROP),
    )),
    Case("LoadBalancer without source ranges", lambda: [
        web(type="LoadBalancer"), slice_of(local(LOCAL1))], (
        (from_outside(LB_IP, source=BLOCKED), Expect(at(LOCAL1), masquerade=True)),
        (from_pod(LB_IP), Expect(at(LOCAL1), masquerade=True)),
    )),
    Case("LoadBalancer with Local policy and no local endpoint drops", lambda: [
        web(type="LoadBalancer", externalTrafficPolicy="Local"), slice_of(remote(REMOTE))], (
        (from_outside(LB_IP), DROP),
        (from_pod(LB_IP), Expect(at(REMOTE))),
    )),
    Case("IPv6 and IPv4 cluster IPs of a dual-stack service", lambda: [
        web(ips=(VIP, VIP6), ipFamilies=["IPv4", "IPv6"]),
        slice_of(local(LOCAL1), local(LOCAL2)),
        slice_of(local("fd00:18:1::5"), name="web-6", v6=True)], (
        (from_pod(VIP6), Expect(at("fd00:18:1::5"))),
        (from_pod(VIP6, 53, "udp"), Expect(at("fd00:18:1::5", port=5353))),
        (Packet.of("fd00:19::7", VIP6, 80),
         Expect(at("fd00:18:1::5"), masquerade=True)),
        (from_pod(VIP), Expect(at(LOCAL1, LOCAL2))),
    )),
    Case("topology hints keep traffic in the zone", lambda: [
        web(annotations={"service.kubernetes.io/topology-mode": "Auto"}),
        slice_of(local(LOCAL1, zones=("zone-a",)), remote(REMOTE, zones=("zone-b",)))], (
        (from_pod(VIP), Expect(at(LOCAL1))),
    )),
    Case("topology hints for no endpoint of this zone are ignored", lambda: [
        web(annotations={"service.kubernetes.io/topology-mode": "Auto"}),
        slice_of(remote("198.18.1.21", zones=("zone-b",)), remote(REMOTE, zones=("zone-b",)))],
        ((from_pod(VIP), Expect(at(REMOTE, "198.18.1.21"))),)),
    Case("trafficDistribution PreferClose prefers this zone while it has endpoints",
         lambda: [web(trafficDistribution="PreferClose"),
                  slice_of(local(LOCAL1), remote(REMOTE))], (
        (from_pod(VIP), Expect(at(LOCAL1))),
    )),
    Case("masquerade-all masquerades pods too", lambda: [web(), slice_of(local(LOCAL1))], (
        (from_pod(VIP), Expect(at(LOCAL1), masquerade=True)),
    ), options=DataplaneOptions(NODE_NAME, cluster_cidrs=PODS, masquerade_all=True)),
    Case("several cluster CIDRs: all of them are pods", lambda: [
        web(), slice_of(local(LOCAL1))], (
        (Packet.of("198.18.4.9", VIP, 80), Expect(at(LOCAL1))),
        (from_pod(VIP), Expect(at(LOCAL1))),
        (from_outside(VIP), Expect(at(LOCAL1), masquerade=True)),
    ), options=DataplaneOptions(NODE_NAME, cluster_cidrs=(
        *PODS, ip_network("198.18.4.0/24")))),
    Case("no cluster CIDR: outside clients of a cluster IP are not told apart", lambda: [
        web(), slice_of(local(LOCAL1))], (
        (from_outside(VIP), Expect(at(LOCAL1))),
    ), options=DataplaneOptions(NODE_NAME)),
    Case("NodePorts only on --nodeport-addresses", lambda: [
        web(type="NodePort"), slice_of(local(LOCAL1))], (
        (from_outside(NODE_IP, NODE_PORT), Expect(at(LOCAL1), masquerade=True)),
        (from_outside(OTHER_NODE_IP, NODE_PORT), UNTOUCHED),
    ), options=DataplaneOptions(NODE_NAME, cluster_cidrs=PODS,
                                nodeport_addresses=(ip_network("198.18.0.1/32"),))),
)


@pytest.mark.parametrize("plane_name", list(PLANES))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_behaviour(case: Case, plane_name: str) -> None:
    node_ips = (NODE_IP, NODE_IP6, OTHER_NODE_IP) if case.options and \
        case.options.nodeport_addresses else (NODE_IP, NODE_IP6)
    plane = plane_for(plane_name, case.options, node_ips)
    plane.become(*case.objects(), full=True)
    for packet, want in case.probes:
        expected = want[plane.mode] if isinstance(want, dict) else want
        trace = plane.trace(packet)
        try:
            check(trace, expected)
        except AssertionError as exc:
            raise AssertionError(f"{packet}: {exc}\n" + "\n".join(trace.path)) from None


# --- changes over time ---------------------------------------------------------------------------


@pytest.mark.parametrize("plane_name", list(PLANES))
def test_client_ip_affinity_keeps_a_client_on_its_first_endpoint(plane_name: str) -> None:
    plane = plane_for(plane_name)
    eps = slice_of(local(LOCAL1), local(LOCAL2), remote(REMOTE))
    plane.become(web(sessionAffinity="ClientIP"), eps, full=True)
    first = plane.trace(from_pod(VIP))
    check(first, Expect(at(LOCAL1, LOCAL2, REMOTE)))
    for outcome in first.outcomes:
        assert outcome.endpoint is not None
        check(plane.trace(from_pod(VIP), outcome.remembered), Expect((outcome.endpoint,)))
        # Another client is not bound by it.
        check(plane.trace(from_outside(VIP), frozenset()),
              Expect(at(LOCAL1, LOCAL2, REMOTE), masquerade=True))
    # Without affinity the same client is spread again.
    plane.become(web(), eps)
    check(plane.trace(from_pod(VIP), first.outcomes[0].remembered),
          Expect(at(LOCAL1, LOCAL2, REMOTE)))


@pytest.mark.parametrize("plane_name", list(PLANES))
def test_partial_syncs_follow_endpoints_and_services(plane_name: str) -> None:
    plane = plane_for(plane_name)
    plane.become(web(), slice_of(local(LOCAL1), local(LOCAL2)), full=True)
    check(plane.trace(from_pod(VIP)), Expect(at(LOCAL1, LOCAL2)))
    steps: tuple[tuple[list[dict[str, Any]], Expect], ...] = (
        ([web(), slice_of(local(LOCAL2))], Expect(at(LOCAL2))),
        ([web()], REJECT),  # its last endpoint gone
        ([web(), slice_of(remote(REMOTE))], Expect(at(REMOTE))),
        ([web(internalTrafficPolicy="Local"), slice_of(remote(REMOTE))], DROP),
        ([], UNTOUCHED),  # the service gone: its address is nobody's
    )
    for objects, want in steps:
        report = plane.become(*objects)
        assert not report.full
        check(plane.trace(from_pod(VIP)), want)
        # And the kernel holds what a full sync from scratch would have written.
        fresh = plane_for(plane_name)
        fresh.become(*objects, full=True)
        assert plane.written() == fresh.written()


@pytest.mark.parametrize("tails", [False, True])
@pytest.mark.parametrize("plane_name", list(PLANES))
def test_a_large_service_spreads_evenly_and_follows_single_endpoint_changes(
        plane_name: str, tails: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """From SLOT_MAP_MIN endpoints on, nftables balances through a slot map and
    renders a change from the endpoint delta alone (nftables/port_edit.py); with
    `tails`, its slots split between a main map and a tail of 2 to 4 (slot_tail.py),
    and the split moves as endpoints go and come."""
    if tails:
        monkeypatch.setattr(slot_tail, "SPLIT_MIN", SLOT_MAP_MIN + 2)
        monkeypatch.setattr(slot_tail, "TAIL", 2)
        monkeypatch.setattr(slot_tail, "TAIL_MAX", 4)
    plane = plane_for(plane_name)
    pool = [f"198.18.{2 + i // 200}.{1 + i % 200}" for i in range(SLOT_MAP_MIN + 8)]
    plane.become(web(), slice_of(*(remote(a) for a in pool)), full=True)
    check(plane.trace(from_pod(VIP)), Expect(at(*pool)))
    for gone in (pool[0], pool[57], pool[-1]):
        pool.remove(gone)
        assert not plane.become(web(), slice_of(*(remote(a) for a in pool))).full
        check(plane.trace(from_pod(VIP)), Expect(at(*pool)))
    for i in range(6):
        pool.append(f"198.18.9.{9 + i}")
        plane.become(web(), slice_of(*(remote(a) for a in pool)))
        check(plane.trace(from_pod(VIP)), Expect(at(*pool)))
    if plane.mode == "nftables":  # not vacuous: the tail was there, or not
        tail_chains = [name for t in plane.nft.tables.values() for name in t.chains
                       if name.startswith(slot_tail.TAIL_PREFIX)]
        assert bool(tail_chains) is tails


# --- the fake kernels refuse what they do not model ----------------------------------------------


def test_the_iptables_tracer_refuses_a_match_it_does_not_model() -> None:
    kernel = IptablesKernel(Node.of(NODE_IP))
    kernel.restore("*nat\n-A PREROUTING -m owner --uid-owner 0 -j ACCEPT\nCOMMIT\n")
    with pytest.raises(TraceError, match="owner"):
        kernel.trace(from_pod(VIP))


def test_the_fake_nft_refuses_what_nf_tables_would_and_traces_only_what_it_knows() -> None:
    nft = FakeNft()
    base = ("add table ip t\n"
            "add chain ip t pre { type nat hook prerouting priority dstnat; policy accept; }\n")
    nft.run(base)
    # A jump to a chain that does not exist: the whole transaction is refused.
    with pytest.raises(NftFakeError, match="no chain"):
        nft.run("add chain ip t c\nadd rule ip t pre jump missing\n")
    assert set(nft.tables["ip", "t"].chains) == {"pre"}
    with pytest.raises(NftFakeError):
        nft.run("add set ip t s { type ipv4_addr; }\ndelete element ip t s { 198.18.0.9 }\n")
    nft.run("add rule ip t pre meta skuid 0 accept\n")
    with pytest.raises(TraceError, match="skuid"):
        nft.trace(from_pod(VIP), Node.of(NODE_IP))
